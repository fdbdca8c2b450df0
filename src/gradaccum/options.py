"""Typed choices for `Accumulator` settings.

Every setting that the API accepts as a string is an `enum.Enum` here, so code can be explicit
(`Precision.BF16`) while call sites stay short (`precision="bf16"`). `parse` turns either form into
the enum member and rejects anything else with a message that lists the valid choices.

Example:
    >>> from gradaccum.options import Precision, parse
    >>> parse(Precision, "bf16", "precision")
    <Precision.BF16: 'bf16'>
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "AutoSize",
    "BatchNormMode",
    "Normalize",
    "OnNonFinite",
    "PartialWindow",
    "Precision",
    "SyncPolicy",
    "Tokens",
    "parse",
]


class Normalize(str, enum.Enum):
    """What a window's objective divides the summed loss by."""

    MEAN = "mean"  # sum(value) / sum(count) over the whole window
    SUM = "sum"  # sum(value), no division


class Precision(str, enum.Enum):
    """Autocast mode for forward passes; `FP16` adds a GradScaler."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class PartialWindow(str, enum.Enum):
    """What `Accumulator.flush()` does with a window that is not full."""

    STEP = "step"  # an exact step over the items seen
    DROP = "drop"  # discard them
    CARRY = "carry"  # keep them; the window finishes in the next epoch


class OnNonFinite(str, enum.Enum):
    """What to do with a window whose loss or gradient is inf or NaN."""

    SKIP = "skip"
    RAISE = "raise"


class BatchNormMode(str, enum.Enum):
    """How BatchNorm layers in train mode behave under accumulation."""

    MICRO = "micro"  # plain PyTorch: per-micro-batch statistics ("ghost batch norm")
    POOLED = "pooled"
    FROZEN = "frozen"


class SyncPolicy(str, enum.Enum):
    """When FSDP2 reduce-scatters a window's gradients (DDP: always once per window)."""

    WINDOW = "window"  # once, in the last backward: unsharded gradient sums held for the window
    MICRO = "micro"  # in every backward: only the gradient shard held, N times the communication


class AutoSize(str, enum.Enum):
    """What `micro_batch_size` a string asks the Accumulator to find (with `memory_budget`)."""

    FASTEST = "auto"  # time the sizes that fit on the first windows; keep the fastest
    LARGEST = "largest"  # the largest that fits


@dataclass(frozen=True, repr=False)
class Tokens:
    """A window of counted items, for `Accumulator(accumulation_steps=Tokens(n))`.

    `micro_step()` closes the window at the first micro-batch that brings the items counted
    over all ranks to at least `count`: the tokens a `LossSum` counts, or the items of a plain
    mean. Every rank learns the total after each forward (one all-reduce of one number), so all
    ranks close the window together. A window overshoots `count` by less than a micro-batch.
    A `LossSum.terms` loss counts each term apart: `term` names the one whose count fills the
    budget (required for such a loss; its rows would be a silent other budget).

    Example:
        >>> Tokens(65_536)
        Tokens(count=65536)
        >>> Tokens(65_536, term="ce").term
        'ce'
    """

    count: int
    term: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(
                f"Tokens(count={self.count!r}): count must be a positive int, the tokens "
                "(items counted) per window, e.g. Tokens(65536)."
            )
        if self.term is not None and not isinstance(self.term, str):
            raise ValueError(f"Tokens(term={self.term!r}): term must be a term's name, e.g. 'ce'.")

    def __repr__(self) -> str:
        # Saved states compare settings by this text: the one of before `term` stays the same.
        term = "" if self.term is None else f", term={self.term!r}"
        return f"Tokens(count={self.count!r}{term})"


E = TypeVar("E", bound=enum.Enum)


def parse(kind: type[E], value: E | str, name: str) -> E:
    """Return the member of `kind` that `value` names.

    Args:
        kind: The enum class.
        value: A member of `kind` or its string value.
        name: The argument name, used in the error message.

    Returns:
        The enum member.

    Raises:
        ValueError: If `value` names no member; the message lists the valid choices.

    Example:
        >>> parse(Normalize, "sum", "normalize")
        <Normalize.SUM: 'sum'>
    """
    if isinstance(value, kind):
        return value
    for member in kind:
        if value == member.value:
            return member
    choices = ", ".join(repr(m.value) for m in kind)
    raise ValueError(f"{name}={value!r} is not a valid choice; use one of {choices}.")
