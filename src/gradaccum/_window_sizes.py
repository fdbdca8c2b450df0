"""The `Accumulator`'s window sizes, `micro_batch_size` and `accumulation_steps`, as attributes.

A training loop may change them between windows, as a batch-size ramp does
(`acc.accumulation_steps = 8`). Each assignment is checked as the constructor checks the
argument: before, `acc.accumulation_steps = 0` (or `"4"`) let `micro_step()` accumulate forever
without ever stepping, and `acc.micro_batch_size = 2.5` failed with a bare `AssertionError`.
Lowered inside an open window, `accumulation_steps` closes it at the next micro-batch: a window
closes once it holds at least that many. `"auto"` sizing needs its planner and budget, built by
the constructor: switching to or from it is refused, naming the fix.
"""

from __future__ import annotations

from typing import Any

from gradaccum._batch_sizes import check_batch_dim, check_micro_batch_size
from gradaccum.options import Normalize, Precision, Tokens

__all__ = ["WindowSizes"]


class WindowSizes:
    """Settable `micro_batch_size` and `accumulation_steps`, checked on every assignment."""

    normalize: Normalize
    precision: Precision
    _batch_dim: int
    _micro_batch_size: int | str | None
    _accumulation_steps: int | Tokens | None

    @property
    def micro_batch_size(self) -> int | str | None:
        """Items per micro-batch for `step()`; another int may be set between windows."""
        return self._micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, value: int | str | None) -> None:
        current = getattr(self, "_micro_batch_size", value)
        auto = getattr(self, "_auto", None) is not None  # the AutoSizer, set before the sizes
        if auto or isinstance(value, str):
            if value != current:
                raise ValueError(
                    f"micro_batch_size cannot change from {current!r} to {value!r}: 'auto' and "
                    "'largest' size with a planner and a memory_budget that only the constructor "
                    "builds. Build a new Accumulator(..., micro_batch_size=..., memory_budget=...) "
                    "and load this one's state_dict() saved between windows into it."
                )
        elif value is not None:
            check_micro_batch_size(value)
        self._micro_batch_size = value

    @property
    def batch_dim(self) -> int:
        """The items' dimension of every tensor in a batch, fixed by the constructor."""
        return self._batch_dim

    @batch_dim.setter
    def batch_dim(self, value: int) -> None:
        current = getattr(self, "_batch_dim", None)  # None while the constructor runs
        if current is not None and value != current:
            raise ValueError(
                f"batch_dim cannot change from {current} to {value!r}: the engine, its layout "
                "check and auto sizing split along the constructor's. Build a new "
                f"Accumulator(..., batch_dim={value!r}) and load this one's state_dict() saved "
                "between windows into it (a saved state records its batch_dim)."
            )
        self._batch_dim = check_batch_dim(value)

    @property
    def accumulation_steps(self) -> int | Tokens | None:
        """Micro-batches per `micro_step()` window, or `Tokens(n)`; may change between windows."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int | Tokens | None) -> None:
        if value is not None and not isinstance(value, Tokens):
            check_micro_batch_size(value, "accumulation_steps")
        engine = getattr(self, "_engine", None)  # absent while the constructor runs
        current = getattr(self, "_accumulation_steps", value)
        if engine is not None and engine.window.is_open and type(value) is not type(current):
            raise ValueError(
                f"accumulation_steps cannot change from {current!r} to {value!r} inside an open "
                f"window ({engine.window.micro_batches} micro-batches so far): a window is "
                "closed by one rule. Change it between windows, or settle this one first with "
                "flush('step') or flush('drop')."
            )
        self._accumulation_steps = value

    def _settings(self) -> dict[str, Any]:
        """The settings that change what a saved partial window means; they must match."""
        steps = self.accumulation_steps
        return {
            "accumulation_steps": repr(steps) if isinstance(steps, Tokens) else steps,
            "micro_batch_size": self.micro_batch_size,
            "normalize": self.normalize.value,
            "precision": self.precision.value,
            "batch_dim": self.batch_dim,
        }
