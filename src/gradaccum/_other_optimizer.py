"""The refusal of a scheduler built on another optimizer than the one the Accumulator steps.

Two ways lead there, and the fix differs. A scheduler built on a stale optimizer (a notebook
cell run again) is rebuilt on the Accumulator's optimizer. An optimizer rebuilt at a stage
change is given to the Accumulator with `acc.optimizer = new` (or, after that assignment, the
old schedule is still set and is rebuilt on the new one). Before, both were told "build it on
the optimizer you pass", which misled the user who had just created the optimizer meant to
train, or had just passed it.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> old = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> new = torch.optim.AdamW(model.parameters())
    >>> "acc.optimizer = " in other_optimizer_message(
    ...     torch.optim.lr_scheduler.StepLR(new, 1), new, old)
    True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["other_optimizer_message"]


def other_optimizer_message(
    scheduler: Any, scheduled: torch.optim.Optimizer, optimizer: torch.optim.Optimizer
) -> str:
    """The refusal of `scheduler`, built on `scheduled`, while the Accumulator steps `optimizer`."""
    name, theirs = type(scheduler).__name__, type(scheduled).__name__
    mine = type(optimizer).__name__
    start = f"scheduler={name} sets the learning rate of another optimizer: "
    own = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not any(id(p) in own for group in scheduled.param_groups for p in group["params"]):
        return (
            f"{start}none of the param groups of its {theirs} is one of the Accumulator's "
            f"{mine}, so it would change nothing this one steps. Build it on the optimizer you "
            f"pass: {name}(optimizer, ...)."
        )
    also = ", another object of the same class" if theirs == mine else ""
    return (
        f"{start}its {theirs} trains parameters of this model too, but the Accumulator steps "
        f"its {mine}{also}, so the schedule would change nothing it steps. If the {theirs} is "
        "the one meant to train (rebuilt at a stage change), set acc.optimizer = it between "
        "windows, then acc.scheduler = the schedule built on it; otherwise build the schedule on "
        f"the Accumulator's {mine}: {name}(optimizer, ...) (on a built Accumulator: "
        f"acc.scheduler = {name}(acc.optimizer, ...), or acc.scheduler = None)."
    )
