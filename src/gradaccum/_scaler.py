"""`acc.scaler`: a GradScaler whose plain-loop calls are refused, naming the fix.

A plain fp16 loop calls `scaler.unscale_(optimizer)` before clipping, then `scaler.step` and
`scaler.update()`. The Accumulator does all three itself, once per window (`PrecisionRuntime`),
so the same calls on `acc.scaler` would unscale, step or update a second time; they raised
torch's bare `AssertionError: Attempted unscale_ but _scale is None` (the Accumulator never
calls `scale()`). They raise a `ValueError` naming the exact forms, before anything changes.
Everything else (`get_scale()`, `state_dict()`, `load_state_dict()`) is GradScaler's own.

Example:
    >>> import torch
    >>> scaler = AccumulatorScaler("cpu")
    >>> scaler.get_scale()
    65536.0
    >>> model = torch.nn.Linear(2, 1)
    >>> try:
    ...     scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    ... except ValueError as error:
    ...     print(str(error)[:44])
    acc.scaler.unscale_(optimizer) is a plain fp
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

__all__ = ["AccumulatorScaler"]


class AccumulatorScaler(torch.amp.GradScaler):
    """The Accumulator's fp16 loss scale; `unscale_`, `step` and `update` are its own."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> NoReturn:
        raise _refused("unscale_(optimizer)")

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> NoReturn:
        raise _refused("step(optimizer)")

    def update(self, new_scale: float | torch.Tensor | None = None) -> NoReturn:
        raise _refused("update()")


def _refused(call: str) -> ValueError:
    return ValueError(
        f"acc.scaler.{call} is a plain fp16 loop's call: the Accumulator unscales each "
        "window's gradients before clipping (max_grad_norm=) and before the optimizer's step "
        "pre-hooks run, steps the optimizer and updates the loss scale, once per window, so "
        "this would do it a second time. Remove the call: clip with Accumulator(..., "
        "max_grad_norm=...) or, by value or per param group, in an optimizer step pre-hook "
        "(README, 'Your own gradient processing'); read the scale with acc.scaler.get_scale(). "
        "Nothing was changed."
    )
