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
from typing import TypeVar

__all__ = ["BatchNormMode", "Normalize", "OnNonFinite", "PartialWindow", "Precision", "parse"]


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
