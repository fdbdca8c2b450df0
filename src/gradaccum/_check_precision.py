"""How precisely `check_equivalence` can judge a gap: the dtypes a model computes and sums in.

`PrecisionProbe` records the least precise dtype any differentiable result of a run had (a
Llama-style RMSNorm's `x.float()` inside a float64 check); `tolerance` turns that, the check's
own dtype and the number of micro-batches into the largest relative gap rounding explains.

Example:
    >>> import torch
    >>> tolerance(torch.float64, torch.float64, micro_batches=4)
    1e-10
    >>> tolerance(torch.bfloat16, torch.bfloat16, micro_batches=16)
    0.0390625
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PrecisionProbe", "tolerance"]

# Relative gap that rounding alone can explain, per compute dtype.
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
_LOW_PRECISION_TOLERANCE = 1e-2


def tolerance(computed: torch.dtype, dtype: torch.dtype, micro_batches: int) -> float:
    """The largest relative gap rounding explains, computing in `computed`, summing in `dtype`.

    A check in bfloat16 or float16 also sums the micro-batches' gradients in that dtype's
    `.grad` (as an Accumulator without `accum_dtype` does): each sum rounds, an error growing
    like the square root of the number of sums, which bfloat16's 8-bit significand makes as
    large as the forward's own (1.1e-2 to 1.8e-2 over 16 to 32 bf16 micro-batches).
    """
    if computed in _TOLERANCE:
        return _TOLERANCE[computed]
    if dtype in _TOLERANCE:  # summed in float32 or float64: the forward's rounding only
        return _LOW_PRECISION_TOLERANCE
    eps = torch.finfo(dtype).eps
    return max(_LOW_PRECISION_TOLERANCE, eps * (1.0 + math.sqrt(micro_batches)))


class PrecisionProbe(TorchFunctionMode):
    """Records the least precise dtype of any result that carries a gradient."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = torch.finfo(dtype).eps
        self.lowest: torch.dtype | None = None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        for tensor in _leaves(result):
            if tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex()):
                eps = torch.finfo(tensor.dtype).eps
                if eps > self.eps:
                    self.eps, self.lowest = eps, tensor.real.dtype  # complex64 -> float32
        return result


def _leaves(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
