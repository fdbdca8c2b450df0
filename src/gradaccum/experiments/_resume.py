"""Checkpoints of a training run: where it stands, how often to save it, how to pick it up again.

A run's `checkpoint.pt` (written atomically with `gradaccum.save_checkpoint`) holds the model,
optimizer, scheduler and Accumulator states, so it may be taken in the middle of a window. Its
`extra` holds the run's `Position` (optimizer steps done, micro-batches done of the window in
progress, epoch and effective batch within the epoch), the samples seen, the validation history,
the training time so far and the configuration. The data order is a pure function of the seed and
the epoch, so resuming regenerates the epoch's order and skips to the position.

`metrics.jsonl` may hold lines written after the last checkpoint (a run killed between two
checkpoints); `truncate_metrics` drops them before a resumed run appends, so no step is logged
twice.

Example:
    >>> every = CheckpointEvery.parse("40micro")
    >>> every, every.count, every.unit
    (CheckpointEvery('40micro'), 40, 'micro')
    >>> str(CheckpointEvery.parse("5"))
    '5step'
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from gradaccum.checkpoint import load_checkpoint, save_checkpoint
from gradaccum.experiments._every import CheckpointEvery
from gradaccum.experiments._files import open_metrics, truncate_metrics, write_text_atomic

if TYPE_CHECKING:
    from gradaccum.accumulator import Accumulator
    from gradaccum.experiments.base import ResolvedRun, TrainConfig

__all__ = [
    "CHECKPOINT_NAME",
    "CheckpointEvery",
    "CheckpointedRun",
    "Position",
    "ResumeError",
    "RunStopped",
    "checkpoint_extra",
    "load_run",
    "open_metrics",
    "plain_config",
    "read_position",
    "save_run",
    "truncate_metrics",
    "write_text_atomic",
]

CHECKPOINT_NAME = "checkpoint.pt"
_LENGTH = ("epochs", "steps")  # what `--resume` may change: the run's length
_FORMAT = "gradaccum-train"
_VERSION = 1


class ResumeError(ValueError):
    """A run cannot be resumed from its folder; the message says why and what to do."""


@dataclass(frozen=True)
class Position:
    """Where a run stands, at a micro-batch boundary.

    Attributes:
        step: Optimizer steps (windows) completed.
        micro: Micro-batches already run of the window in progress (0 at a window boundary).
        micro_batches: Micro-batches run since the start of the run.
        samples: Items of the completed windows.
        elapsed: Training seconds so far, over every session of the run.
    """

    step: int = 0
    micro: int = 0
    micro_batches: int = 0
    samples: int = 0
    elapsed: float = 0.0

    def batch_in_epoch(self, steps_per_epoch: int) -> tuple[int, int]:
        """`(epoch, index)` of the effective batch in progress: 1-based epoch, 0-based index."""
        return self.step // steps_per_epoch + 1, self.step % steps_per_epoch


class CheckpointedRun(Protocol):
    """What `save_run` and `load_run` use of a run (`gradaccum.experiments.runner.TrainingRun`).

    Declared here, so this module needs nothing from the runner that imports it.
    """

    @property
    def out(self) -> Path | None:
        """The run's folder, or None for a run that writes nothing."""
        ...

    @property
    def plan(self) -> ResolvedRun:
        """The resolved configuration."""
        ...

    @property
    def history(self) -> list[dict[str, float]]:
        """The validation rows so far."""
        ...

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The run's optimizer."""
        ...

    @property
    def accumulator(self) -> Accumulator:
        """The run's Accumulator."""
        ...

    @property
    def scheduler(self) -> Any:
        """The run's learning-rate scheduler."""
        ...

    def window_micro_batches(self, step: int) -> int:
        """Micro-batches of window `step + 1`."""
        ...


class RunStopped(Exception):  # noqa: N818 (a stop on request, not an error)
    """Training stopped on request at a micro-batch boundary, after writing its checkpoint.

    Attributes:
        position: Where the run stopped.
        window_micro_batches: Micro-batches of the window in progress.
        checkpoint: The checkpoint written, or None for a run without an out folder.
    """

    def __init__(
        self, position: Position, window_micro_batches: int, checkpoint: Path | None
    ) -> None:
        super().__init__(
            f"stopped at step {position.step}, micro-batch {position.micro} of "
            f"{window_micro_batches}"
        )
        self.position = position
        self.window_micro_batches = window_micro_batches
        self.checkpoint = checkpoint


def checkpoint_extra(
    position: Position,
    *,
    steps_per_epoch: int,
    history: list[dict[str, float]],
    config: dict[str, Any],
    finished: bool,
) -> dict[str, Any]:
    """The `extra` of a run checkpoint: plain data that `weights_only` loading accepts."""
    epoch, index = position.batch_in_epoch(steps_per_epoch)
    return {
        "format": _FORMAT,
        "version": _VERSION,
        "step": position.step,
        "micro": position.micro,
        "epoch": epoch,
        "batch_in_epoch": index,
        "micro_batches": position.micro_batches,
        "samples": position.samples,
        "elapsed": position.elapsed,
        "history": [dict(row) for row in history],
        "finished": finished,
        "config": config,
    }


def read_position(
    extra: Any,
    *,
    config: dict[str, Any],
    total_steps: int,
    steps_per_epoch: int,
    window_micro_batches: Any,
) -> tuple[Position, list[dict[str, float]]]:
    """Check a run checkpoint's `extra` against the run being resumed; return where it stands.

    Args:
        extra: What `load_checkpoint` returned.
        config: The resumed run's `plain_config`.
        total_steps: Optimizer steps of the whole run.
        steps_per_epoch: Effective batches per epoch.
        window_micro_batches: `window_micro_batches(step)`: micro-batches of window `step + 1`.

    Returns:
        The position and the validation history so far.

    Raises:
        ResumeError: If `extra` is not a training run's, belongs to another configuration, is
            inconsistent, or the run already finished.
    """
    if not isinstance(extra, dict) or extra.get("format") != _FORMAT:
        raise ResumeError(
            f"{CHECKPOINT_NAME} is not a checkpoint of `gradaccum train` (its extra data holds no "
            "run position)"
        )
    if extra.get("version") != _VERSION:
        raise ResumeError(
            f"{CHECKPOINT_NAME} has run-position version {extra.get('version')!r}; this "
            f"gradaccum reads version {_VERSION}"
        )
    mismatch = _config_mismatch(extra.get("config"), config)
    if mismatch:
        raise ResumeError(mismatch)
    if extra.get("finished") and extra.get("step") == total_steps:
        raise ResumeError(
            f"the run already finished (step {extra.get('step')} of {total_steps}); to train it "
            "longer, give more --epochs or --steps with --resume"
        )
    try:
        position = Position(
            step=_count(extra, "step"),
            micro=_count(extra, "micro"),
            micro_batches=_count(extra, "micro_batches"),
            samples=_count(extra, "samples"),
            elapsed=float(extra["elapsed"]),
        )
        history = [{str(k): _number(v) for k, v in row.items()} for row in extra["history"]]
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ResumeError(f"{CHECKPOINT_NAME} holds a damaged run position ({error})") from None
    if position.step >= total_steps or position.micro >= window_micro_batches(position.step):
        raise ResumeError(
            f"{CHECKPOINT_NAME} stands at step {position.step}, micro-batch {position.micro}, "
            f"outside this run of {total_steps} steps; give more --epochs or --steps"
        )
    if (extra.get("epoch"), extra.get("batch_in_epoch")) != position.batch_in_epoch(
        steps_per_epoch
    ):
        raise ResumeError(f"{CHECKPOINT_NAME} holds an inconsistent run position")
    return position, history


def _config_mismatch(saved: Any, config: dict[str, Any]) -> str | None:
    """Why a checkpoint's recorded configuration is not `config` (None if it is)."""
    saved = dict(saved) if isinstance(saved, dict) else {}
    differing = sorted(
        key
        for key in (set(config) | set(saved)) - set(_LENGTH)  # a run may be extended
        if saved.get(key) != config.get(key)
    )
    if not differing:
        return None
    return (
        f"{CHECKPOINT_NAME} was written by another configuration than config.json describes "
        f"(they differ in: {', '.join(differing)}); restore config.json or start a new run"
    )


def _recorded_mismatch(path: Path, config: dict[str, Any]) -> str | None:
    """`_config_mismatch` of the configuration `path` records, if the file reads at all.

    For a checkpoint the objects refused: a config.json edited to another micro-batch size
    (so other accumulation steps) or BatchNorm mode is then named as such, rather than by the
    library's message for whoever builds an Accumulator by hand.
    """
    try:
        extra = torch.load(path, map_location="cpu", weights_only=True)["extra"]
    except Exception:  # a damaged file: the load's own message says so
        return None
    return _config_mismatch(extra.get("config"), config) if isinstance(extra, dict) else None


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    return value


def _count(extra: dict[str, Any], key: str) -> int:
    value = extra[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key}={value!r} is not a count")
    return value


def plain_config(config: TrainConfig) -> dict[str, Any]:
    """`config` as plain JSON types, so `weights_only` loading and `json` both accept it.

    `asdict` keeps the `LrScaling` enum member, which `torch.load(weights_only=True)` refuses.
    An unset `max_tokens` is left out, so runs started before that option existed still resume.

    Example:
        >>> from gradaccum.experiments.base import LrScaling, TrainConfig
        >>> plain_config(TrainConfig(task="digits", lr_scaling=LrScaling.SQRT))["lr_scaling"]
        'sqrt'
    """
    plain: dict[str, Any] = json.loads(json.dumps(asdict(config)))
    if plain.get("max_tokens") is None:
        del plain["max_tokens"]
    return plain


def save_run(
    run: CheckpointedRun, position: Position, metrics: IO[str] | None, *, finished: bool = False
) -> Path | None:
    """Write `run.out/checkpoint.pt` at `position`, after making the metrics so far durable.

    Returns:
        The checkpoint's path, or None for a run without an out folder (nothing is written).
    """
    if run.out is None:
        return None
    if metrics is not None:
        metrics.flush()
        os.fsync(metrics.fileno())
    path = run.out / CHECKPOINT_NAME
    extra = checkpoint_extra(
        position,
        steps_per_epoch=run.plan.steps_per_epoch,
        history=run.history,
        config=plain_config(run.plan.config),
        finished=finished,
    )
    save_checkpoint(
        path,
        model=run.model,
        optimizer=run.optimizer,
        accumulator=run.accumulator,
        scheduler=run.scheduler,
        extra=extra,
    )
    return path


def load_run(run: CheckpointedRun, out: Path) -> tuple[Position, list[dict[str, float]]]:
    """Restore `run`'s states from `out/checkpoint.pt`; return its position and history.

    Raises:
        ResumeError: If the checkpoint is missing, damaged, of another run or inconsistent.
    """
    path = out / CHECKPOINT_NAME
    if not path.is_file():
        raise ResumeError(
            f"holds no {CHECKPOINT_NAME}: the run stopped before its first checkpoint; start it "
            "again"
        )
    before = _global_rng_states()  # put back if the checkpoint is refused after loading
    try:
        extra = load_checkpoint(
            path,
            model=run.model,
            optimizer=run.optimizer,
            accumulator=run.accumulator,
            scheduler=run.scheduler,
            restore_rng=True,  # a bitwise resume continues the run's random streams
        )
    except (ValueError, OSError) as error:  # CheckpointError is a ValueError
        mismatch = _recorded_mismatch(path, plain_config(run.plan.config))
        raise ResumeError(mismatch or " ".join(str(error).split())) from None
    try:
        position, history = read_position(
            extra,
            config=plain_config(run.plan.config),
            total_steps=run.plan.total_steps,
            steps_per_epoch=run.plan.steps_per_epoch,
            window_micro_batches=run.window_micro_batches,
        )
        open_window = run.accumulator.state_dict()["engine"]["window"]["micro_batches"]
        if open_window != position.micro:
            raise ResumeError(
                f"{CHECKPOINT_NAME} is inconsistent: its Accumulator holds {open_window} "
                f"micro-batches of the open window, its position says {position.micro}"
            )
    except ResumeError:
        _set_global_rng_states(before)
        raise
    return position, history


def _global_rng_states() -> tuple[Any, Any, torch.Tensor, list[torch.Tensor]]:
    """The process-wide RNG states that `load_checkpoint(..., restore_rng=True)` sets."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_global_rng_states(states: tuple[Any, Any, torch.Tensor, list[torch.Tensor]]) -> None:
    python, numpy, cpu, cuda = states
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
