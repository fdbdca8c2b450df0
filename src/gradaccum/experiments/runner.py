"""Train one configuration of an embedded task, and log it the way `gradaccum train` does.

The loop reads as prose: shuffle the epoch with a seeded order, cut it into effective batches,
hand each to `Accumulator.step`, log one line per optimizer step, validate after each epoch.
Two configurations with the same seed and effective batch see the same batches in the same order,
so `8x2` and `16x1` must end with the same parameters on an additive task.

Example:
    >>> from gradaccum.experiments.base import TrainConfig
    >>> summary = train(TrainConfig(task="digits", batch_size=64, micro_batch_size=32, steps=2))
    >>> summary.optimizer_steps, summary.config
    (2, '32x2')
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gradaccum.accumulator import Accumulator, StepResult
from gradaccum.batching import batch_size, map_tensors
from gradaccum.checkpoint import save_checkpoint
from gradaccum.experiments.base import LrScaling, RunSummary, Task, TrainConfig
from gradaccum.experiments.tasks import get_task
from gradaccum.memory import measure_activation_bytes

__all__ = ["ACCUM_DTYPES", "ResolvedRun", "StepLog", "plain_config", "resolve", "train"]

ACCUM_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class StepLog:
    """One line of `metrics.jsonl`: what one optimizer step did."""

    step: int
    samples: int
    loss: float
    lr: float
    grad_norm: float | None
    time: float


@dataclass(frozen=True)
class ResolvedRun:
    """A `TrainConfig` with every default filled in from its task and checked."""

    config: TrainConfig
    task: Task
    effective_batch: int
    micro_batch_size: int
    lr: float
    total_steps: int
    steps_per_epoch: int


def resolve(config: TrainConfig, train_items: int | None = None) -> ResolvedRun:
    """Fill defaults from the task and validate; raises ValueError naming the fix.

    Args:
        config: The configuration as given.
        train_items: Size of the training set, if already known (saves building the data).
    """
    task = get_task(config.task)
    effective = config.batch_size or task.default_batch_size
    if effective <= 0:
        raise ValueError(f"--batch-size={effective} must be a positive int.")
    micro = config.micro_batch_size if config.micro_batch_size is not None else effective
    if micro == "auto":
        raise ValueError("--micro-batch-size auto is not available yet; pass an int.")
    if not isinstance(micro, int) or micro <= 0:
        raise ValueError(f"--micro-batch-size={micro!r} must be a positive int.")
    if micro > effective:
        raise ValueError(
            f"--micro-batch-size={micro} is larger than --batch-size={effective}; a micro-batch "
            "is a slice of the effective batch."
        )
    if config.epochs is not None and config.steps is not None:
        raise ValueError("give --epochs or --steps, not both.")
    for name in ("epochs", "steps", "warmup"):
        value = getattr(config, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            raise ValueError(f"--{name}={value} must be {'>= 0' if name == 'warmup' else '>= 1'}.")
    if config.accum_dtype is not None and config.accum_dtype not in ACCUM_DTYPES:
        raise ValueError(
            f"--accum-dtype={config.accum_dtype!r} is not known; use one of {sorted(ACCUM_DTYPES)}."
        )
    if train_items is None:
        train_items = batch_size(task.make_data(config.seed).train)
    steps_per_epoch = math.ceil(train_items / effective)
    total = config.steps or steps_per_epoch * (config.epochs or task.default_epochs)
    return ResolvedRun(
        config=config,
        task=task,
        effective_batch=effective,
        micro_batch_size=micro,
        lr=_scaled_lr(config, task, effective),
        total_steps=total,
        steps_per_epoch=steps_per_epoch,
    )


def train(
    config: TrainConfig,
    *,
    out: Path | None = None,
    on_step: Callable[[StepLog, ResolvedRun], None] | None = None,
) -> RunSummary:
    """Train `config` and return its summary; with `out`, write the run's files there.

    Files in `out`: `metrics.jsonl` (one line per optimizer step), `validation.jsonl` (one line
    per epoch), `summary.json` and `checkpoint.pt` (see `gradaccum.load_checkpoint`).

    Args:
        config: What to train.
        out: An existing folder for the run's files, or None to write nothing.
        on_step: Called after every optimizer step (progress bars).
    """
    task = get_task(config.task)
    data = task.make_data(config.seed)
    run = resolve(config, batch_size(data.train))
    model = task.make_model(config.seed, config.norm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup(config.warmup))
    accumulator = Accumulator(
        model,
        optimizer,
        micro_batch_size=run.micro_batch_size,
        scheduler=scheduler,
        precision=config.precision,
        accum_dtype=ACCUM_DTYPES.get(config.accum_dtype or ""),
    )
    peak_bytes = _peak_memory(model, optimizer, task, data.train, run.micro_batch_size)

    metrics = (out / "metrics.jsonl").open("w") if out else None
    history: list[dict[str, float]] = []
    samples, started = 0, time.perf_counter()
    try:
        for step, (epoch, batch, epoch_done) in enumerate(_batches(data.train, run), start=1):
            result: StepResult = accumulator.step(batch, task.loss_fn)
            samples += batch_size(batch)
            log = StepLog(step, samples, result.loss, result.lr, result.grad_norm, _since(started))
            if metrics:
                metrics.write(json.dumps(asdict(log)) + "\n")
            if on_step:
                on_step(log, run)
            if epoch_done or step == run.total_steps:
                history.append(_validate(task, model, data.val, epoch, step, samples, log.loss))
    finally:
        if metrics:
            metrics.close()
    wall = _since(started)
    summary = _summarize(run, history, samples, peak_bytes, wall)
    if out:
        _write_jsonl(out / "validation.jsonl", history)
        (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
        save_checkpoint(
            out / "checkpoint.pt",
            model=model,
            optimizer=optimizer,
            accumulator=accumulator,
            scheduler=scheduler,
            extra={"step": run.total_steps, "samples": samples, "config": plain_config(config)},
        )
    return summary


def plain_config(config: TrainConfig) -> dict[str, Any]:
    """`config` as plain JSON types, so `weights_only` loading and `json` both accept it.

    `asdict` keeps the `LrScaling` enum member, which `torch.load(weights_only=True)` refuses.

    Example:
        >>> plain_config(TrainConfig(task="digits", lr_scaling=LrScaling.SQRT))["lr_scaling"]
        'sqrt'
    """
    return json.loads(json.dumps(asdict(config)))


def _batches(train: Any, run: ResolvedRun) -> Iterator[tuple[int, Any, bool]]:
    """Effective batches in a seeded order per epoch: (epoch, batch, last of its epoch)."""
    items = batch_size(train)
    step = 0
    for epoch in range(1, 1 + math.ceil(run.total_steps / run.steps_per_epoch)):
        generator = torch.Generator().manual_seed(run.config.seed * 1_000_003 + epoch)
        order = torch.randperm(items, generator=generator)
        for start in range(0, items, run.effective_batch):
            index = order[start : start + run.effective_batch]
            step += 1
            yield epoch, map_tensors(train, lambda t, i=index: t[i]), start + len(index) >= items
            if step == run.total_steps:
                return


def _validate(
    task: Task, model: torch.nn.Module, val: Any, epoch: int, step: int, samples: int, loss: float
) -> dict[str, float]:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        scores = task.evaluate(model, val, 256)
    model.train(was_training)
    return {
        "epoch": epoch,
        "step": step,
        "samples": samples,
        "train_loss": loss,
        "val_metric": scores["metric"],
        "val_loss": scores["loss"],
    }


def _summarize(
    run: ResolvedRun, history: list[dict[str, float]], samples: int, peak: int, wall: float
) -> RunSummary:
    metrics = [h["val_metric"] for h in history]
    best = max(metrics) if run.task.higher_is_better else min(metrics)
    return RunSummary(
        config=f"{run.micro_batch_size}x{math.ceil(run.effective_batch / run.micro_batch_size)}",
        effective_batch=run.effective_batch,
        micro_batch_size=run.micro_batch_size,
        accumulation_steps=math.ceil(run.effective_batch / run.micro_batch_size),
        optimizer_steps=run.total_steps,
        samples_seen=samples,
        best_metric=best,
        final_metric=metrics[-1],
        metric=run.task.metric,
        peak_memory_bytes=peak,
        samples_per_second=samples / wall if wall > 0 else 0.0,
        wall_seconds=wall,
        history=history,
    )


def _peak_memory(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    task: Task,
    train: Any,
    micro_batch_size: int,
) -> int:
    """Tensor bytes at the peak of a step: weights, grads, optimizer state, one graph's saves.

    AdamW keeps two moments per weight. The activation part is measured, not estimated, with
    saved-tensor hooks on one micro-batch of the largest size.
    """
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = 2 * weights if isinstance(optimizer, torch.optim.AdamW) else 0
    micro_batch = map_tensors(train, lambda t: t[:micro_batch_size])
    # On a copy and a forked RNG, so measuring leaves BatchNorm statistics and dropout alone.
    with torch.random.fork_rng(devices=[]):
        activations = measure_activation_bytes(copy.deepcopy(model), micro_batch, task.loss_fn)
    return weights * 2 + moments + activations


def _scaled_lr(config: TrainConfig, task: Task, effective: int) -> float:
    base = config.lr if config.lr is not None else task.default_lr
    ratio = effective / task.reference_batch_size
    scaling = LrScaling(config.lr_scaling)
    if scaling is LrScaling.LINEAR:
        return base * ratio
    if scaling is LrScaling.SQRT:
        return base * math.sqrt(ratio)
    return base


def _warmup(steps: int) -> Callable[[int], float]:
    return lambda step: min(1.0, (step + 1) / steps) if steps > 0 else 1.0


def _since(started: float) -> float:
    return time.perf_counter() - started


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
