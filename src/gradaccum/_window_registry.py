"""The windows of every live Accumulator, to refuse loading weights under an open one.

`load_checkpoint(path, model=model, optimizer=optimizer)` without `accumulator=` replaces the
weights and the optimizer state, but an Accumulator over the model may hold an open window: the
summed gradients of micro-batches run at the OLD weights. The next `micro_step()` calls added
to that window and stepped on it (a rollback after an error in the loop: 6e-2 off the
full-batch step, silently, and every later window cut at another place). Such a load is now
refused before anything changes, naming `accumulator=acc` (the saved window replaces the open
one) and `acc.flush('drop')`.

Example:
    >>> import torch
    >>> from gradaccum._window_registry import open_windows_over
    >>> model = torch.nn.Linear(2, 1)
    >>> open_windows_over(list(model.parameters()), exclude=None)
    []
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch

__all__ = ["REGISTERED", "open_windows_over", "refuse_loading_under_open_window"]


class _Window(Protocol):
    @property
    def is_open(self) -> bool: ...

    micro_batches: int
    count: int
    params: list[torch.nn.Parameter]


# Every Accumulator's window (added where its optimizer's step hook is set), held weakly.
REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()


def open_windows_over(params: Iterable[torch.Tensor], *, exclude: Any) -> list[_Window]:
    """The open registered windows accumulating into any of `params`, except `exclude`."""
    wanted = {id(p) for p in params}
    return [
        window
        for window in tuple(REGISTERED)  # a copy: a window may be collected meanwhile
        if window is not exclude and window.is_open and any(id(p) in wanted for p in window.params)
    ]


def refuse_loading_under_open_window(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, accumulator: Any
) -> None:
    """Raise a `ValueError` if an Accumulator other than `accumulator` has an open window here.

    The window is one over `model`'s or `optimizer`'s parameters; `accumulator`'s own window
    is replaced by the load, so it is no obstacle.
    """
    own = getattr(getattr(accumulator, "_engine", None), "window", None)
    params = [*model.parameters()]
    params += [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
    found = open_windows_over(params, exclude=own)
    if not found:
        return
    window = found[0]
    raise ValueError(
        f"cannot load a checkpoint into this model: an Accumulator over it has an open window "
        f"of {window.micro_batches} micro-batches ({window.count} items counted) whose "
        "gradients were taken at the current weights; loading new weights under it would mix "
        "them into the next step. Pass accumulator=acc to load_checkpoint (the saved window "
        "state replaces the open one), or discard the open window first with "
        "acc.flush('drop') (acc.flush('step') to keep its update). Nothing was loaded."
    )
