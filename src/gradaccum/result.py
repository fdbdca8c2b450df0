"""What one call to `Accumulator.step`, `micro_step` or `flush` reports, and its error type.

Example:
    >>> r = StepResult(loss=0.5, count=8, micro_batches=2, micro_batch_size=4, stepped=True,
    ...                skipped=False, grad_norm=1.0, lr=0.1)
    >>> r.count // r.micro_batches
    4
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NonFiniteError", "StepResult"]


class NonFiniteError(FloatingPointError):
    """A window's loss or gradient was inf or NaN and `on_nonfinite="raise"` was set."""


@dataclass(frozen=True)
class StepResult:
    """What one call to `step`, `micro_step` or `flush` did.

    Attributes:
        loss: The window's objective so far (the value optimized when `stepped`).
        count: Items counted in the window.
        micro_batches: Micro-batches run in the window.
        micro_batch_size: Items per micro-batch (the largest seen when streaming).
        stepped: The optimizer stepped.
        skipped: The window was non-finite or counted no item; no update was made.
        grad_norm: Gradient norm before clipping, at the boundary; None elsewhere.
        lr: Learning rate of the first parameter group, as used by this step.
    """

    loss: float
    count: int
    micro_batches: int
    micro_batch_size: int
    stepped: bool
    skipped: bool
    grad_norm: float | None
    lr: float
