"""Train one configuration of an embedded task, and log it the way `gradaccum train` does.

The loop reads as prose: shuffle the epoch with a seeded order, cut it into effective batches,
split each into micro-batches (by rows, or packed by a token budget: see
`gradaccum.experiments._schedule`) and feed them to `Accumulator.micro_step` (a window with fewer
micro-batches than `accumulation_steps`, like an epoch's shorter last batch or any packed batch,
is settled by `flush()`), log one line per optimizer step, validate after each epoch. Two
configurations with the same seed and effective batch see the same batches in the same order, so
`8x2`, `16x1` and `16@512t` must end with the same parameters on an additive task.

A run may write `checkpoint.pt` every few steps or micro-batches, stop on request at any
micro-batch boundary (after writing one), resume from it exactly and be extended (`open_run`).

Example:
    >>> from gradaccum.experiments.base import TrainConfig
    >>> summary = train(TrainConfig(task="digits", batch_size=64, micro_batch_size=32, steps=2))
    >>> summary.optimizer_steps, summary.config
    (2, '32x2')
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

import torch

from gradaccum.accumulator import Accumulator, StepResult
from gradaccum.batching import batch_size
from gradaccum.experiments._model import ACCUM_DTYPES, make_model, resolve_micro_batch_size
from gradaccum.experiments._outcome import (
    peak_memory,
    recalibrate_batchnorm,
    summarize,
    validate,
    write_jsonl,
)
from gradaccum.experiments._resume import (
    CHECKPOINT_NAME,
    CheckpointEvery,
    Position,
    ResumeError,
    RunStopped,
    load_run,
    open_metrics,
    plain_config,
    save_run,
    write_text_atomic,
)
from gradaccum.experiments._schedule import (
    MicroBatchPlan,
    check_max_tokens,
    check_token_budget,
    effective_batches,
    micro_batches,
    plan_micro_batches,
)
from gradaccum.experiments.base import LrScaling, ResolvedRun, RunSummary, Task, TrainConfig
from gradaccum.experiments.tasks import get_task

__all__ = [
    "ACCUM_DTYPES",
    "CHECKPOINT_NAME",
    "make_model",
    "resolve_micro_batch_size",
    "CheckpointEvery",
    "Position",
    "ResolvedRun",
    "ResumeError",
    "RunStopped",
    "StepLog",
    "StopCheck",
    "TrainingRun",
    "build_accumulator",
    "open_run",
    "plain_config",
    "resolve",
    "train",
    "write_text_atomic",
]


StopCheck = Callable[[Position], bool]
"""Asked before every micro-batch with the run's position; True stops the run there."""


@dataclass(frozen=True)
class StepLog:
    """One line of `metrics.jsonl`: what one optimizer step did."""

    step: int
    samples: int
    loss: float
    lr: float
    grad_norm: float | None
    time: float
    micro_batches: int | None = None  # micro-batches of the step's window
    noise_scale: float | None = None  # the gradient noise scale B_simple (gradaccum.telemetry)


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
    if config.max_tokens is not None:
        check_max_tokens(config, task)
    micro = config.micro_batch_size if config.micro_batch_size is not None else effective
    if micro == "auto":
        raise ValueError(
            "--micro-batch-size auto must be planned first (resolve_micro_batch_size); pass an int."
        )
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
    if effective > train_items:  # it would run on the whole set, under a label it is not
        raise ValueError(
            f"--batch-size={effective} is larger than {task.name}'s training set ({train_items} "
            f"items); pass --batch-size {train_items} or less."
        )
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
        max_tokens=config.max_tokens,
    )


def build_accumulator(
    run: ResolvedRun,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
) -> Accumulator:
    """The streaming `Accumulator` of a run: one window per effective batch.

    The last effective batch of an epoch may have fewer micro-batches, and a batch packed by a
    token budget has fewer than its upper bound (`ResolvedRun.accumulation_steps`); the runner
    settles those windows with `flush()` (`partial_window="step"`: an exact step over its items).
    """
    return Accumulator(
        model,
        optimizer,
        accumulation_steps=run.accumulation_steps,
        scheduler=scheduler,
        precision=run.config.precision,
        accum_dtype=ACCUM_DTYPES.get(run.config.accum_dtype or ""),
        partial_window="step",
        batchnorm=run.config.batchnorm,
        telemetry=True,  # the gradient noise scale in metrics.jsonl: one norm per window
    )


def train(
    config: TrainConfig,
    *,
    out: Path | None = None,
    on_step: Callable[[StepLog, ResolvedRun], None] | None = None,
) -> RunSummary:
    """Train `config` and return its summary; with `out` (a folder), write the run's files there.

    Files: `metrics.jsonl` (one line per optimizer step), `validation.jsonl` (one line per epoch),
    `summary.json` and `checkpoint.pt` (see `gradaccum.load_checkpoint`). `on_step` is called
    after every optimizer step (progress bars).
    """
    return open_run(config, out=out).run(on_step=on_step)


def open_run(config: TrainConfig, *, out: Path | None = None, resume: bool = False) -> TrainingRun:
    """Build a run (data, model, optimizer, scheduler, Accumulator), ready to `run()`.

    Nothing is written. With `resume`, the state of `out/checkpoint.pt` is loaded and checked
    (RNG states included), so errors show before anything changes.

    Args:
        config: What to train (on resume: the configuration the run was started with).
        out: The run's folder, or None to write nothing.
        resume: Continue the run whose checkpoint is in `out`.

    Raises:
        ValueError: If `config` is refused (see `resolve`).
        ResumeError: If `out` cannot be resumed; the message says why.
    """
    return TrainingRun(config, out, resume)


class TrainingRun:
    """One run of `open_run`: its objects, its position, and the loop that trains it."""

    def __init__(self, config: TrainConfig, out: Path | None, resume: bool) -> None:
        task = get_task(config.task)
        self.data = task.make_data(config.seed)
        self.plan = resolve(config, batch_size(self.data.train))
        if config.max_tokens is not None:
            check_token_budget(self.data.train, config.max_tokens)
        self.micro_plan: MicroBatchPlan = plan_micro_batches(self.data.train, self.plan)
        self.out = out
        self.resumed = resume
        self.model = make_model(config, initial_weights=not resume)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.plan.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _warmup(config.warmup))
        self.accumulator = build_accumulator(self.plan, self.model, self.optimizer, self.scheduler)
        measured = self.micro_plan.measured  # the largest micro-batch (in padded tokens)
        self.peak_bytes = peak_memory(
            self.model, self.optimizer, task, measured, batch_size(measured)
        )
        self.position = Position()  # the next micro-batch; elapsed as of the last checkpoint
        self.history: list[dict[str, float]] = []
        self.noise_scale: float | None = None  # the last step's B_simple (gradaccum.telemetry)
        self.board: Any = None  # a TensorBoardLog while `run(tensorboard=True)` runs
        self._started = time.perf_counter()
        if resume:
            if out is None:
                raise ResumeError("resuming needs the run's folder")
            self.position, self.history = load_run(self, out)

    def window_micro_batches(self, step: int) -> int:
        """Micro-batches of window `step + 1` (an epoch's last batch or a packed one may differ)."""
        return self.micro_plan.per_window[step]

    def run(
        self,
        *,
        on_step: Callable[[StepLog, ResolvedRun], None] | None = None,
        checkpoint_every: CheckpointEvery | None = None,
        stop: StopCheck | None = None,
        tensorboard: bool = False,
    ) -> RunSummary:
        """Train to the end (from the loaded position when resuming) and return the summary.

        Args:
            on_step: Called after every optimizer step (progress bars).
            checkpoint_every: Write `checkpoint.pt` this often (needs `out`); the final
                checkpoint is always written.
            stop: Asked before every micro-batch; when it answers True the run writes its
                checkpoint and raises `RunStopped`.
            tensorboard: Also log to TensorBoard event files in `out/tensorboard` (needs `out`
                and the `tensorboard` extra; see `gradaccum.experiments.tensorboard`).

        Raises:
            RunStopped: When `stop` asked to stop.
        """
        plan = self.plan
        metrics = None
        if tensorboard and self.out is not None:
            from gradaccum.experiments.tensorboard import TensorBoardLog

            self.board = TensorBoardLog(self.out / "tensorboard")
        if self.out is not None:
            resume_step = self.position.step if self.resumed else None
            metrics = open_metrics(self.out / "metrics.jsonl", resume_step=resume_step)
        self._started = time.perf_counter() - self.position.elapsed
        try:
            for epoch, batch, epoch_done in effective_batches(
                self.data.train, plan, self.position.step
            ):
                parts = micro_batches(batch, plan)
                for k in range(self.position.micro, len(parts)):
                    if stop is not None and stop(self._here()):
                        here = self._here()
                        raise RunStopped(here, len(parts), save_run(self, here, metrics))
                    last = k == len(parts) - 1
                    result = self.accumulator.micro_step(parts[k], plan.task.loss_fn)
                    if last and not (result.stepped or result.skipped):
                        result = self.accumulator.flush()  # fewer than accumulation_steps
                    self._advance(result, batch, epoch, epoch_done, last, metrics, on_step)
                    due = checkpoint_every is not None and checkpoint_every.due(
                        micro_batches=self.position.micro_batches,
                        step=self.position.step,
                        window_ended=last,
                    )
                    if due and self.position.step < plan.total_steps:
                        save_run(self, self._here(), metrics)
            final = self._here()
            summary = summarize(
                plan, self.micro_plan, self.history, final.samples, self.peak_bytes, final.elapsed
            )
            summary = replace(summary, noise_scale=self.noise_scale)
            if self.out:
                write_jsonl(self.out / "validation.jsonl", self.history)
                text = json.dumps(asdict(summary), indent=2) + "\n"
                write_text_atomic(self.out / "summary.json", text)
                save_run(self, final, metrics, finished=True)
        finally:
            if metrics:
                metrics.close()
            if self.board is not None:
                self.board.close()
                self.board = None
        return summary

    def _here(self) -> Position:
        return replace(self.position, elapsed=_since(self._started))

    def _advance(
        self,
        result: StepResult,
        batch: Any,
        epoch: int,
        epoch_done: bool,
        window_ended: bool,
        metrics: IO[str] | None,
        on_step: Callable[[StepLog, ResolvedRun], None] | None,
    ) -> None:
        """Count one micro-batch; at a window's end, log the step and validate if due."""
        position = self.position
        if not window_ended:
            self.position = replace(
                position, micro=position.micro + 1, micro_batches=position.micro_batches + 1
            )
            return
        step, samples = position.step + 1, position.samples + batch_size(batch)
        self.position = replace(
            position, step=step, micro=0, micro_batches=position.micro_batches + 1, samples=samples
        )
        log = StepLog(
            step,
            samples,
            result.loss,
            result.lr,
            result.grad_norm,
            _since(self._started),
            micro_batches=position.micro + 1,
            noise_scale=result.telemetry.noise_scale if result.telemetry else None,
        )
        self.noise_scale = log.noise_scale
        if metrics:
            metrics.write(json.dumps(asdict(log)) + "\n")
        if self.board is not None:
            self.board.log_step(asdict(log))
        if on_step:
            on_step(log, self.plan)
        if epoch_done or step == self.plan.total_steps:
            if self.plan.config.recalibrate:
                recalibrate_batchnorm(
                    self.model,
                    self.data.train,
                    self.plan.effective_batch,
                    self.plan.config.recalibrate,
                )
            val = validate(
                self.plan.task, self.model, self.data.val, epoch, step, samples, log.loss
            )
            self.history.append(val)
            if self.board is not None:
                self.board.log_validation(step, self.plan.task.metric, val["val_metric"])


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
