"""`Outcome`: what a window boundary did, which the `Accumulator` turns into a `StepResult`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Outcome"]


@dataclass(frozen=True)
class Outcome:
    """What a window boundary did (the Accumulator turns it into a `StepResult`)."""

    stepped: bool
    count: int
    loss_sum: float
    grad_norm: float | None
    lr: float | None
    nonfinite_names: tuple[str, ...] = ()
    terms: dict[str, float] | None = None  # LossSum.terms windows: each term's window mean
    objective: float | None = None  # LossSum.terms windows: sum of weight * mean
