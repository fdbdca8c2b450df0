"""What one call to `Accumulator.step`, `micro_step` or `flush` reports, and its error type.

A result is made by one of three named constructors, one per outcome, never from positional
booleans: `StepResult.stepped(...)`, `StepResult.skipped(...)` and `StepResult.pending(...)`.
On a result, `result.stepped` and `result.skipped` read as the usual booleans.

Example:
    >>> r = StepResult.stepped(loss=0.5, count=8, micro_batches=2, micro_batch_size=4,
    ...                        grad_norm=1.0, lr=0.1)
    >>> r.stepped, r.skipped, r.count // r.micro_batches
    (True, False, 4)
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast, overload

from gradaccum._warnings import warn_user
from gradaccum.telemetry import Telemetry

__all__ = ["NonFiniteError", "PartialStepError", "SkippedInARow", "StepResult", "learning_rate"]


class NonFiniteError(FloatingPointError):
    """A window's loss or gradient was inf or NaN and `on_nonfinite="raise"` was set."""

    @classmethod
    def of_window(cls, micro_batches: int, outcome: Any, scaler: Any = None) -> NonFiniteError:
        """The error for a skipped window's `Outcome` (`gradaccum.window`), naming the fix.

        `scaler`: fp16's GradScaler, whose scale backed off for this window (the one thing it
        changed), or None.
        """
        loss_scale = None if scaler is None else float(scaler.get_scale())
        backed_off = (
            ""
            if loss_scale is None
            else f"; the fp16 loss scale backed off to {loss_scale:g}, as GradScaler does on an "
            "overflow, so a retry runs at the lower scale (overflows while the scale settles "
            "are routine in fp16)"
        )
        return cls(
            f"window of {micro_batches} micro-batches has loss sum {outcome.loss_sum} and "
            f"grad norm {outcome.grad_norm}; non-finite gradients in: "
            f"{list(outcome.nonfinite_names)}. The window was discarded, the parameters, "
            f"optimizer and scheduler unchanged{backed_off}; pass on_nonfinite='skip' to skip "
            "such windows instead."
        )


class SkippedInARow:
    """Warns once when `limit` windows in a row were skipped as non-finite: nothing trains.

    fp16 skips a few windows while its loss scale backs off (a routine start), so its limit is
    higher; in fp32 or bf16 a NaN or inf in every window means the model stopped training, which
    `StepResult.skipped` alone lets a loop miss (a model whose padded positions give NaN logits).
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.in_a_row, self.warned = limit, 0, False
        self.dropped_in_a_row, self.warned_dropped = 0, False

    def state_dict(self) -> dict[str, Any]:
        """The streak so far, for `Accumulator.state_dict`: a resumed run warns as the whole one."""
        return {
            "in_a_row": self.in_a_row,
            "warned": self.warned,
            "dropped_in_a_row": self.dropped_in_a_row,
            "warned_dropped": self.warned_dropped,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore `state_dict()` output; None (a state saved before it was kept) starts afresh."""
        state = state or {}
        self.in_a_row, self.warned = int(state.get("in_a_row", 0)), bool(state.get("warned"))
        self.dropped_in_a_row = int(state.get("dropped_in_a_row", 0))
        self.warned_dropped = bool(state.get("warned_dropped"))

    def stepped(self) -> None:
        """A window stepped: the run is training."""
        self.in_a_row = self.dropped_in_a_row = 0

    def dropped(self, result: StepResult, accumulation_steps: object) -> StepResult:
        """`flush('drop')` discarded a partial window (`result`): two in a row, nothing trains.

        An epoch of fewer micro-batches than `accumulation_steps` (a dataset of 30 in batches
        of 8, `accumulation_steps=8`) never fills a window, so with `partial_window="drop"`
        every epoch's window is dropped and the optimizer never steps, silently.
        """
        if not result.micro_batches:  # nothing was open here (a DDP rank joining the flush)
            return result
        self.dropped_in_a_row += 1
        if self.dropped_in_a_row >= 2 and not self.warned_dropped:
            self.warned_dropped = True
            warn_user(
                RuntimeWarning(
                    f"{self.dropped_in_a_row} partial windows in a row were dropped by flush() "
                    f"with no optimizer step between them (the last held {result.micro_batches} "
                    f"micro-batches, accumulation_steps={accumulation_steps}): each epoch ends "
                    "before a window fills, so the model is not training. Use "
                    "partial_window='carry' (the window goes on into the next epoch) or "
                    "'step' (an exact step over what was seen), or a smaller accumulation_steps."
                )
            )
        return result

    def skipped(self, outcome: Any) -> None:
        """A window was skipped as non-finite (its `Outcome`, `gradaccum.window`)."""
        self.in_a_row += 1
        if self.in_a_row < self.limit or self.warned:
            return
        self.warned = True
        names = list(outcome.nonfinite_names)[:5]
        warn_user(
            RuntimeWarning(
                f"{self.in_a_row} accumulation windows in a row were skipped as non-finite (loss "
                f"sum {outcome.loss_sum}, non-finite gradients in {names}): the model is not "
                "training. Find where the NaN or inf starts (a loss over no item, a log or sqrt "
                "of 0, a lr too high); Accumulator(..., on_nonfinite='raise') stops at the "
                "first such window. StepResult.skipped marks each one."
            )
        )


class PartialStepError(RuntimeError):
    """`optimizer.step()` raised after it had updated some parameters; they cannot be put back.

    The message names them. The Accumulator refuses further windows until a state is loaded
    (`load_checkpoint(..., accumulator=acc)` or `acc.load_state_dict`), so that no retry steps
    the same parameters twice.
    """


class _Build(Protocol):
    def __call__(
        self,
        *,
        loss: float | Callable[[], float],
        count: int,
        micro_batches: int,
        micro_batch_size: int,
        lr: float | None,
        grad_norm: float | None = None,
        terms: Mapping[str, float] | None = None,
        sizing: str | None = None,
        telemetry: Telemetry | None = None,
    ) -> StepResult: ...


class _Outcome:
    """On the class, a constructor for one outcome; on a result, that outcome's boolean."""

    def __init__(self, stepped: bool, skipped: bool) -> None:
        self.flags = (stepped, skipped)

    def __set_name__(self, owner: type[StepResult], name: str) -> None:
        self.name = name
        self.build = self._builder(owner)

    @overload
    def __get__(self, instance: None, owner: type[StepResult]) -> _Build: ...

    @overload
    def __get__(self, instance: StepResult, owner: type[StepResult]) -> bool: ...

    def __get__(self, instance: StepResult | None, owner: type[StepResult]) -> _Build | bool:
        if instance is not None:
            flag: bool = instance.__dict__[self.name]
            return flag
        return self.build

    def _builder(self, owner: type[StepResult]) -> _Build:
        stepped, skipped = self.flags
        return cast(_Build, functools.partial(owner, stepped=stepped, skipped=skipped))


class StepResult:
    """What one call to `step`, `micro_step` or `flush` did (immutable).

    Attributes:
        loss: The window's objective so far (the value optimized when `stepped`).
        count: Items counted in the window (a plain scalar loss: rows; a `LossSum.terms`
            window: its rows too, each term being divided by its own count).
        micro_batches: Micro-batches run in the window.
        micro_batch_size: Items per micro-batch (the largest when streaming or by `max_tokens`).
        stepped: The optimizer stepped.
        skipped: The window was non-finite or counted no item; no update was made.
        grad_norm: Gradient norm before clipping, at the boundary; None elsewhere.
        lr: Learning rate of the first parameter group, as used by this step; None for an
            optimizer that sets its own (e.g. relative-step Adafactor, whose `lr` is None).
        terms: For a `LossSum.terms` loss, each term's window mean (its sum over the window
            and ranks divided by its count or constant), read-only, at a boundary (stepped or
            skipped); empty otherwise, and on a pending `micro_step` result, whose `loss` is
            this rank's objective so far.
        sizing: With `micro_batch_size="auto"`, what size the window ran at and why (timing a
            candidate, or the fastest found, with its items per second), and, in "auto" or
            "largest" mode, the sizes that ran out of memory before the window was rerun whole
            at a smaller one; None otherwise.
        telemetry: With `Accumulator(telemetry=True)`, the step's `Telemetry` (gradient noise
            scale, items per second, micro-batch size, peak memory); None otherwise.
    """

    _FIELDS = (
        "loss",
        "count",
        "micro_batches",
        "micro_batch_size",
        "stepped",
        "skipped",
        "grad_norm",
        "lr",
        "terms",
        "sizing",
        "telemetry",
    )

    count: int
    micro_batches: int
    micro_batch_size: int
    grad_norm: float | None
    lr: float | None
    terms: Mapping[str, float]
    sizing: str | None
    telemetry: Telemetry | None

    stepped = _Outcome(stepped=True, skipped=False)
    skipped = _Outcome(stepped=False, skipped=True)
    pending = _Outcome(stepped=False, skipped=False)

    def __init__(
        self,
        *,
        loss: float | Callable[[], float],
        count: int,
        micro_batches: int,
        micro_batch_size: int,
        stepped: bool,
        skipped: bool,
        lr: float | None,
        grad_norm: float | None = None,
        terms: Mapping[str, float] | None = None,
        sizing: str | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        frozen = types.MappingProxyType(dict(terms or {}))
        values = (
            loss,
            count,
            micro_batches,
            micro_batch_size,
            stepped,
            skipped,
            grad_norm,
            lr,
            frozen,
            sizing,
            telemetry,
        )
        self.__dict__.update(zip(self._FIELDS, values, strict=True))

    @property
    def loss(self) -> float:
        """The window's objective so far; read from the device only when first asked for.

        A pending result of `micro_step` carries it lazily, so a training loop that does not
        read it never waits for the device between micro-batches.
        """
        value = self.__dict__["loss"]
        if callable(value):
            value = float(value())
            self.__dict__["loss"] = value
        loss: float = value
        return loss

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"StepResult is immutable; cannot set {name!r}.")

    def _values(self) -> tuple[Any, ...]:
        values = [getattr(self, name) for name in self._FIELDS]
        values[self._FIELDS.index("terms")] = tuple(sorted(self.terms.items()))  # hashable
        return tuple(values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepResult) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle, `copy` and `deepcopy` by value: the lazy loss read, `terms` a plain dict."""
        values = {name: getattr(self, name) for name in self._FIELDS}
        values["terms"] = dict(self.terms)
        return (_restore, (values,))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS)
        return f"StepResult({fields})"


def _restore(values: dict[str, Any]) -> StepResult:
    """A `StepResult` from `StepResult.__reduce__`'s values (unpickling, copies)."""
    return StepResult(**values)


def learning_rate(optimizer: Any) -> float | None:
    """The first param group's learning rate; None for an optimizer without one (Adafactor)."""
    lr = optimizer.param_groups[0].get("lr")
    try:
        return None if lr is None or isinstance(lr, bool) else float(lr)
    except (TypeError, ValueError):
        return None
