"""A learning rate changed between two `micro_step()` calls of one window: a copied loop's line.

Hand-written accumulation loops often step their scheduler once per micro-batch, where it belongs
once per optimizer step. Kept next to `acc.micro_step()`, that line makes the schedule run
`accumulation_steps` times too fast (a warmup over 1,000 steps ends after 250), silently: the
step only uses the rate the window ends with. `Accumulator(scheduler=...)` warns when a scheduler
it steps is stepped outside too (`gradaccum._commit.SchedulerSteps`); this catches the loops that
step their own, or set `group["lr"]` by hand, per micro-batch. The rates are read per param
group without a device sync (a tensor lr by its identity and version counter), once per
micro-batch, until the first warning.

Example:
    >>> import types, warnings
    >>> import torch
    >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    >>> watch = LearningRateWatch()
    >>> watch.mark(optimizer)
    >>> optimizer.param_groups[0]["lr"] = 0.05  # a scheduler.step() between two micro-batches
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     watch.check(optimizer, types.SimpleNamespace(is_open=True, micro_batches=1))
    >>> caught[0].category.__name__
    'CopiedLoopWarning'
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum._copied_loop import CopiedLoopWarning
from gradaccum._warnings import warn_user

__all__ = ["LearningRateWatch"]


def _rates(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """Each group's lr: a number as is, a tensor by identity and version (no device read)."""
    return tuple(
        (id(lr), lr._version) if isinstance(lr, torch.Tensor) else lr
        for lr in (group.get("lr") for group in optimizer.param_groups)
    )


class LearningRateWatch:
    """Warns once when the optimizer's learning rates change inside an open streaming window."""

    def __init__(self) -> None:
        self._seen: tuple[Any, ...] | None = None  # the rates after the window's last micro-batch
        self.warned = False

    def mark(self, optimizer: torch.optim.Optimizer) -> None:
        """A micro-batch of an open window ran: remember the rates it left."""
        if not self.warned:
            self._seen = _rates(optimizer)

    def forget(self) -> None:
        """The window closed, was carried over to the next epoch, or a state was loaded."""
        self._seen = None

    def check(self, optimizer: torch.optim.Optimizer, window: Any) -> None:
        """Before a micro-batch of `window` (a `Window`): warn if the rates moved since its last.

        A window's first micro-batch is not checked: the boundary's scheduler step moved them.
        """
        if not window.is_open:
            return
        micro_batches = window.micro_batches
        seen, self._seen = self._seen, None
        # Only the groups the last micro-batch saw: one added by add_param_group() mid-window is
        # no rate change (it sits the window out, and `_joined` warns of that).
        if seen is None or self.warned or seen == _rates(optimizer)[: len(seen)]:
            return
        self.warned = True
        warn_user(
            CopiedLoopWarning(
                "the learning rate changed between two micro_step() calls of one accumulation "
                f"window (after its micro-batch {micro_batches}): the window steps once, at the "
                "rate it ends with. If a scheduler.step() (or a manual lr) runs per micro-batch, "
                "the schedule runs accumulation_steps times too fast: step your scheduler only "
                "when result.stepped is True, or pass it as Accumulator(..., scheduler=...), "
                "which steps it once per optimizer step. A one-off change (a "
                "ReduceLROnPlateau.step(val_loss) after a validation that fell inside a window) "
                "is the plain loop's step too; validate when result.stepped to keep it between "
                "windows. A per-epoch scheduler.step() after an epoch whose last, partial window "
                "is still open (no acc.flush() at the epoch's end: the window runs on into the "
                "next epoch) moved the rate inside it: call acc.flush() before it."
            )
        )
