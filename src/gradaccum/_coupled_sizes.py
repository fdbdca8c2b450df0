"""What makes the micro-batch size change the step: then `"auto"` may not time smaller sizes.

`micro_batch_size="auto"` times the largest size that fits against smaller ones and keeps the
fastest, because every split gives the same step. Two things break that, and with either
`"auto"` runs the largest size that fits, untimed (as `"largest"` does), exact whenever the
window fits, and `StepResult.sizing` says why:

- a BatchNorm that normalizes with batch statistics (train mode under `batchnorm="micro"` or
  `"pooled"`, or any mode without running statistics): its batch is the micro-batch, so each
  timed size trained another model (a window of 200 timed at 128, 64 and 32 ended 1.1
  relative off the full-batch step under `"micro"`, 7.6e-2 under `"pooled"`, silently);
  `batchnorm="frozen"` or `convert_to_groupnorm` make the size a speed knob again;
- a loss that compares or pools the rows of its micro-batch (in-batch negatives, a batch Dice,
  preference pairs the split cuts, advantages normalized over it, a mixup drawn per
  micro-batch, class weights from its label counts), once warned about (`gradaccum._token_mean`):
  each timed size trained on another objective (InfoNCE over 64 rows, 32 kept: 7.5e-2 off,
  warned once).
  The window that warns ran split before the warning told: it is forgotten (gradients,
  BatchNorm statistics, random number generators as before it) and rerun whole
  (`run_unsplit_if_coupled`), so no window steps on a split `"auto"` would refuse to time.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    >>> batch_statistics_layers(model, frozen=False), batch_statistics_layers(model, frozen=True)
    (['1'], [])
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._agreement import RankMismatchError
from gradaccum._averaged import named_trained_modules
from gradaccum._oom import is_out_of_memory
from gradaccum.options import BatchNormMode
from gradaccum.sync import all_ranks_max

if TYPE_CHECKING:
    from gradaccum._tuner import ThroughputTuner


class Engine(Protocol):
    """What is read of `gradaccum._engine.Engine` (which imports the sizer: no import cycle)."""

    model: torch.nn.Module
    batchnorm: Any  # `BatchNormControl`: its `mode`
    token_mean: Any  # `TokenMeanCheck`: whether a row-coupling warning was told
    sync: Any  # `GradSync`: its world size
    _exchanged: bool  # set: a failure is not announced at an exchange (told here instead)

    def run_window(
        self, micro_batches: Sequence[Any], loss_fn: Any, *, window_items: int, size: int,
        template: Any = None,
    ) -> None: ...  # fmt: skip

    def discard_window(self) -> None: ...


class Sizer(Protocol):
    """What is read of `gradaccum.recovery.AutoSizer` (which imports this module)."""

    timing: bool  # the window running is timed

    def untimed_size(self) -> int: ...


__all__ = [
    "SplitCoupled",
    "batch_statistics_layers",
    "run_unsplit_if_coupled",
    "sizing_note",
    "split_changes_step",
    "untimed_note",
]


class SplitCoupled(Exception):  # noqa: N818 (a signal to the sizer, never seen by a user)
    """An auto-sized window ran split, then its loss was warned to couple rows: rerun it whole."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


def batch_statistics_layers(model: torch.nn.Module, *, frozen: bool) -> list[str]:
    """The trained model's BatchNorm layers that normalize with the micro-batch's statistics.

    `frozen`: `batchnorm="frozen"`, under which every BatchNorm runs on its running statistics.
    """
    if frozen:
        return []
    return [
        name or "<model>"
        for name, module in named_trained_modules(model)
        if isinstance(module, _BatchNorm) and (module.training or module.running_mean is None)
    ]


def split_changes_step(engine: Engine) -> list[str]:
    """Why the next window's size would change its step, if it would (empty: a speed knob)."""
    frozen = engine.batchnorm.mode is BatchNormMode.FROZEN
    reasons = []
    if layers := batch_statistics_layers(engine.model, frozen=frozen):
        shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
        reasons.append(
            f"BatchNorm ({shown}) normalizes each micro-batch with its own statistics "
            "(batchnorm='frozen' or gradaccum.batchnorm.convert_to_groupnorm(model) let auto "
            "time sizes)"
        )
    if engine.token_mean.rows_coupled:
        reasons.append(
            "loss_fn compares, pools or normalizes the rows of its micro-batch, as warned (see "
            "docs/losses.md for an exact recipe)"
        )
    return reasons


def untimed_note(size: int, reasons: list[str]) -> str:
    """`StepResult.sizing` for an auto-sized window that may not time smaller sizes."""
    return (
        f"auto {size}: the largest that fits, untimed: {'; '.join(reasons)}; a smaller size "
        "would change the step"
    )


def run_unsplit_if_coupled(
    engine: Engine,
    sizer: Sizer,
    micro_batches: Sequence[Any],
    loss_fn: Any,
    items: int,
    size: int,
    template: Any,
) -> None:
    """`engine.run_window`; a split window whose loss was just warned to couple rows is undone.

    If this window's micro-batches (`size` items each) made the loss checks warn for the first
    time, and a window run untimed would take more of its items at once, the window is
    forgotten before its boundary (nothing stepped) and `SplitCoupled` raised: the sizer rewinds
    the random number generators and reruns it whole. Under DDP the ranks agree in one
    all-reduce, only in timed windows (the loss checks read a run's first micro-batches).

    Raises:
        SplitCoupled: The window was forgotten; rerun it at the sizer's untimed size.
    """
    before, world = engine.token_mean.rows_coupled, engine.sync.world
    timed = world > 1 and sizer.timing
    if timed:  # the others' next collective is the agreement below, not the window's exchange:
        engine._exchanged = True  # a failure is told there (the engine then tells it no more)
    try:
        engine.run_window(micro_batches, loss_fn, window_items=items, size=size, template=template)
    except Exception as error:
        if timed:  # 2: raised, 3: out of memory (every rank reruns smaller)
            with contextlib.suppress(Exception):  # a peer gone: this rank's error stands
                all_ranks_max(engine.model, [3.0 if is_out_of_memory(error) else 2.0])
        raise
    if world > 1 and not timed:  # the same on every rank: no collective after timing
        return
    rerun = (
        not before and engine.token_mean.rows_coupled and size < min(sizer.untimed_size(), items)
    )
    if world > 1:
        agreed = all_ranks_max(engine.model, [float(rerun)])[0]
        if agreed >= 2:  # another rank's window raised: forgotten here too, nothing stepped
            engine.discard_window()
            if agreed == 3:
                raise torch.OutOfMemoryError(
                    "another rank ran out of memory in this window; every rank reruns it smaller."
                )
            raise RankMismatchError(
                "another rank raised inside this accumulation window (see its own traceback); "
                "the window was discarded on every rank, and nothing was stepped."
            )
        rerun = agreed > 0
    if rerun:
        engine.discard_window()
        reasons = split_changes_step(engine) or ["the split changes the step on another rank"]
        raise SplitCoupled([*reasons, f"the window ran at {size} first and was rerun whole"])


def sizing_note(
    tuner: ThroughputTuner | None,
    size: int,
    tried: list[int],
    items: int,
    coupled: list[str] | None = None,
) -> str | None:
    """`StepResult.sizing`: the tuner's reason ("auto"), and any out-of-memory rerun.

    "largest" has no note unless the window ran out of memory and was rerun smaller; "auto"
    where the split changes the step (`coupled`: BatchNorm on batch statistics, a loss coupling
    its rows) says why nothing is timed.
    """
    note = None if tuner is None else tuner.note()
    if coupled is not None:
        note = untimed_note(size, coupled)
    if tuner is not None and not tuner.tuning and size != tuner.chosen:  # shrunk, or regrowing
        note = f"auto {size}: the choice is {tuner.chosen}, out of memory since ({tuner.reason})"
    if note is not None and size > items:
        note = f"{note} (the window's {items} items ran as one micro-batch)"
    if len(tried) == 1:
        return note
    failed = ", ".join(str(s) for s in tried[:-1])
    rerun = f"ran out of memory at {failed}; the window was rerun whole at {size}"
    return f"largest {size}: {rerun}" if note is None else f"{note} ({rerun})"
