"""The `Accumulator`'s other settings as attributes: checked when set, or fixed at construction.

A training loop changes settings on a live Accumulator: a clipping threshold read from a
config or lowered for a fine-tuning phase (`acc.max_grad_norm = 0.5`), `on_nonfinite` turned to
`"raise"` while debugging. They were plain attributes, read at each boundary unchecked:
`acc.max_grad_norm = float("nan")` stepped the model to NaN weights after the finiteness check,
`-1.0` flipped the step uphill (gradient ascent) and `0` left only momentum and weight decay to
move it, silently; `acc.on_nonfinite = "raise"` (a string) kept skipping. Each assignment is
now checked as the constructor checks the argument, before anything changes.

`normalize`, `precision` and `memory_budget` are built into the engine, the precision runtime
and the auto sizer by the constructor: a new value was ignored while `StepResult.loss` and the
saved state followed it. Changing them is refused, naming the fix (the same value is taken).
`acc.scaler` is the fp16 loss scale's holder: assigning a plain loop's GradScaler to it (an
`AttributeError` of Python's before) is refused naming `acc.scaler.load_state_dict(...)`.

Example:
    >>> import torch
    >>> from gradaccum import Accumulator
    >>> model = torch.nn.Linear(2, 1)
    >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2)
    >>> acc.max_grad_norm = 0.5
    >>> acc.on_nonfinite = "raise"
    >>> acc.on_nonfinite
    <OnNonFinite.RAISE: 'raise'>
"""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

import torch

from gradaccum._checks import check_max_grad_norm
from gradaccum.options import Normalize, OnNonFinite, PartialWindow, Precision, parse

__all__ = ["RunSettings"]

_E = TypeVar("_E", bound=Enum)


class RunSettings:
    """Settable `max_grad_norm`, `on_nonfinite`, `partial_window`; fixed `normalize` and co."""

    _max_grad_norm: float | None
    _on_nonfinite: OnNonFinite
    _partial_window: PartialWindow
    _normalize: Normalize
    _precision: Precision
    _memory_budget: int | str | None
    _engine: Any  # the Accumulator's engine: its precision runtime holds the GradScaler

    @property
    def max_grad_norm(self) -> float | None:
        """The total 2-norm each window's gradient is clipped to (None: no clipping)."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        try:
            check_max_grad_norm(value)
        except ValueError as error:
            raise ValueError(
                f"acc.{error} Set None to stop clipping; acc.max_grad_norm is unchanged "
                f"({getattr(self, '_max_grad_norm', None)!r})."
            ) from None
        self._max_grad_norm = value

    @property
    def on_nonfinite(self) -> OnNonFinite:
        """`"skip"` or `"raise"` a window whose gradients are not finite; settable."""
        return self._on_nonfinite

    @on_nonfinite.setter
    def on_nonfinite(self, value: OnNonFinite | str) -> None:
        self._on_nonfinite = parse(OnNonFinite, value, "on_nonfinite")

    @property
    def partial_window(self) -> PartialWindow:
        """What `flush()` does with a partial window (`"step"`, `"drop"`, `"carry"`); settable."""
        return self._partial_window

    @partial_window.setter
    def partial_window(self, value: PartialWindow | str) -> None:
        self._partial_window = parse(PartialWindow, value, "partial_window")

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 GradScaler holding the loss scale, or None for fp32 and bf16."""
        scaler: torch.amp.GradScaler | None = self._engine.runtime.scaler
        return scaler

    @scaler.setter
    def scaler(self, value: object) -> None:
        if self._precision is Precision.FP16 and value is self.scaler:
            return  # `acc.scaler = acc.scaler`, or an in-place operator's write-back
        fix = (
            "carry a GradScaler's state and settings over with "
            "acc.scaler.load_state_dict(scaler.state_dict()) (init_scale, growth_interval, "
            "backoff_factor and growth_factor included)"
            if self._precision is Precision.FP16
            else f"precision={self._precision.value!r} keeps no loss scale: build the "
            "Accumulator with precision='fp16' for one (it makes its own GradScaler)"
        )
        raise ValueError(
            f"acc.scaler cannot be replaced by {type(value).__name__}: the Accumulator applies "
            f"and updates the loss scale itself, once per window; {fix}. Nothing was changed."
        )

    @property
    def normalize(self) -> Normalize:
        """`"mean"` or `"sum"`, fixed by the constructor."""
        return self._normalize

    @normalize.setter
    def normalize(self, value: Normalize | str) -> None:
        self._normalize = _fixed(self, "normalize", Normalize, value)

    @property
    def precision(self) -> Precision:
        """`"fp32"`, `"bf16"` or `"fp16"`, fixed by the constructor."""
        return self._precision

    @precision.setter
    def precision(self, value: Precision | str) -> None:
        self._precision = _fixed(self, "precision", Precision, value)

    @property
    def memory_budget(self) -> int | str | None:
        """The memory budget `"auto"` sizing plans with, fixed by the constructor."""
        return self._memory_budget

    @memory_budget.setter
    def memory_budget(self, value: int | str | None) -> None:
        current = getattr(self, "_memory_budget", value)
        if value != current:
            raise _refused("memory_budget", current, value)
        self._memory_budget = value


def _fixed(owner: Any, name: str, kind: type[_E], value: _E | str) -> _E:
    """`value` parsed as `kind`; refused if it differs from the value the constructor set."""
    parsed = parse(kind, value, name)
    current = getattr(owner, f"_{name}", None)  # None while the constructor runs
    if current is not None and parsed is not current:
        raise _refused(name, current.value, parsed.value)
    return parsed


def _refused(name: str, current: object, value: object) -> ValueError:
    return ValueError(
        f"{name} cannot change from {current!r} to {value!r} on a built Accumulator: the "
        "constructor built it into the engine, which would go on using the old value. Between "
        "windows (acc.flush() an open one first), build a new Accumulator(model, optimizer, "
        f"..., {name}={value!r}) with the same scheduler and other settings. Nothing was changed."
    )
