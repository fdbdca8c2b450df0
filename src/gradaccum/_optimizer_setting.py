"""The `Accumulator`'s `optimizer` as a settable attribute: replaced between windows, checked.

Training loops build a new optimizer at a stage change (a fine-tuning phase with another
optimizer, or one rebuilt over the unfrozen backbone) and assign it: `acc.optimizer = new`.
Before, that assignment only rebound the attribute: the engine kept stepping the old optimizer,
so the new one never moved a weight and the schedule built on it was refused as "another
optimizer's". Now the assignment is checked as `Accumulator(optimizer=...)` is, and the engine
steps the new optimizer from the next window on. Inside an open window it is refused (the
window's gradients are the old optimizer's to step): settle the window first.

Example:
    >>> import torch
    >>> from gradaccum import Accumulator
    >>> model = torch.nn.Linear(2, 1)
    >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2)
    >>> acc.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> type(acc.optimizer).__name__
    'AdamW'
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum._checks import check_optimizer
from gradaccum._commit import SchedulerSteps, refuse_steps_inside
from gradaccum._joined import JoinWatch

__all__ = ["OptimizerSetting"]


class OptimizerSetting:
    """A settable `optimizer`: the engine steps whichever was set last, between windows."""

    model: torch.nn.Module
    _optimizer: torch.optim.Optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer stepped once per window; another may be set between windows."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer) -> None:
        engine: Any = getattr(self, "_engine", None)  # absent while the constructor runs
        if engine is None or value is engine.optimizer:
            self._optimizer = value
            return
        check_optimizer(value, self.model)  # as the constructor does, before any change
        if engine.window.is_open:
            raise ValueError(
                f"acc.optimizer cannot be replaced inside an open window "
                f"({engine.window.micro_batches} micro-batches so far): their gradients are "
                f"for the {type(engine.optimizer).__name__} to step. Settle the window first "
                "with acc.flush('step') (or flush('drop')), then set acc.optimizer. Nothing "
                "was changed."
            )
        engine.optimizer = value
        engine.window.joins = JoinWatch(value, self.model)  # unfrozen mid-window: its own
        refuse_steps_inside(value, engine.window)  # its step inside an open window: refused
        engine.schedule = SchedulerSteps()  # acc.scheduler is checked against it at next use
        self._optimizer = value
