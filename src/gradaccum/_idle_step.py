"""An optimizer the Accumulator does not step, stepped over its parameters with no gradient.

A stage change builds a new optimizer (`opt = AdamW(model.parameters())`) and keeps the loop's
`opt.step()` after `acc.step(...)`: the Accumulator steps its own optimizer once per window and
clears the gradients after, so the new optimizer sees none and changes nothing, while the old
one trains on, silently. The global step pre-hook (`_step_refusal`) calls `warn_idle_step` for
steps outside any Accumulator's commit and outside micro-batches: an optimizer whose parameters
all hold no gradient, some of them a window's stepped parameters, is warned of once per window
(Accumulator), naming `acc.optimizer = it`. (Stepped between two `micro_step()` calls with the
window's partial sums it does move them, and `_written` refuses the window.)

Example:
    >>> import torch
    >>> warn_idle_step(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from gradaccum._warnings import warn_user
from gradaccum._window_registry import REGISTERED

__all__ = ["warn_idle_step"]

_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()  # the windows warned of


def warn_idle_step(stepped: torch.optim.Optimizer) -> None:
    """Warn once if `stepped` holds a window's parameters and none of its parameters a gradient."""
    params = [p for group in stepped.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):  # it steps something
        return
    ids = set(map(id, params))
    for window in tuple(REGISTERED):  # a copy: a window may be collected meanwhile
        if window.committing or window in _WARNED:
            continue
        if not any(id(p) in ids for p in window.params[: window.held]):
            continue
        _WARNED.add(window)
        mine = type(window.joins.optimizer).__name__
        name = type(stepped).__name__
        warn_user(
            UserWarning(
                f"{name}.step() was called over parameters an Accumulator trains, but none of "
                f"them holds a gradient: the Accumulator steps its own {mine} once per window "
                f"and clears the gradients after, so this step changes nothing. If this {name} "
                "is the one meant to train them (built at a stage change), give it to the "
                "Accumulator between windows, acc.optimizer = it (and acc.scheduler = a "
                "schedule built on it), and remove this step(); otherwise remove this step()."
            )
        )
        return
