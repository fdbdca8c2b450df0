"""What a training run measures and reports: validation rows, peak memory and its summary.

Example:
    >>> import torch
    >>> from gradaccum.experiments.tasks import get_task
    >>> task = get_task("digits")
    >>> data = task.make_data(0)
    >>> model = task.make_model(0)
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> peak_memory(model, optimizer, task, data.train, 8) > 0
    True
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from gradaccum.batching import batch_size, map_tensors
from gradaccum.batchnorm import recalibrate
from gradaccum.experiments._resume import write_text_atomic
from gradaccum.experiments._schedule import MicroBatchPlan
from gradaccum.experiments.base import ResolvedRun, RunSummary, Task
from gradaccum.memory import measure_activation_bytes

__all__ = ["peak_memory", "summarize", "validate", "write_jsonl"]


def validate(
    task: Task, model: torch.nn.Module, val: Any, epoch: int, step: int, samples: int, loss: float
) -> dict[str, float]:
    """One `validation.jsonl` row: the task's metric and loss in eval mode, without gradients."""
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


def recalibrate_batchnorm(model: torch.nn.Module, train: Any, batch: int, batches: int) -> None:
    """PreciseBN before a validation: exact BatchNorm statistics over the first training batches.

    Only the running statistics change (no parameter, no RNG draw), and only from the weights and
    the data, so a resumed run recalibrates to the same bits.
    """
    items = batch_size(train)
    loader = (
        map_tensors(train, lambda t, start=start: t[start : start + batch])
        for start in range(0, items, batch)
    )
    recalibrate(model, loader, batches)


def summarize(
    run: ResolvedRun,
    micro: MicroBatchPlan,
    history: list[dict[str, float]],
    samples: int,
    peak: int,
    wall: float,
) -> RunSummary:
    """The `RunSummary` of a finished run (`summary.json`).

    For `MxK` configs the micro-batch fields are M and K as configured; with a token budget they
    are what the packing made: the largest micro-batch's rows, the fullest window's micro-batches.
    """
    metrics = [h["val_metric"] for h in history]
    best = max(metrics) if run.task.higher_is_better else min(metrics)
    packed = run.max_tokens is not None
    return RunSummary(
        config=run.label,
        effective_batch=run.effective_batch,
        micro_batch_size=micro.largest_rows if packed else run.micro_batch_size,
        accumulation_steps=micro.most if packed else run.accumulation_steps,
        optimizer_steps=run.total_steps,
        samples_seen=samples,
        best_metric=best,
        final_metric=metrics[-1],
        metric=run.task.metric,
        peak_memory_bytes=peak,
        samples_per_second=samples / wall if wall > 0 else 0.0,
        wall_seconds=wall,
        history=history,
        max_tokens=run.max_tokens,
        micro_batches_per_step=round(micro.mean, 4),
    )


def peak_memory(
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


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write `rows` as JSON lines, atomically."""
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
