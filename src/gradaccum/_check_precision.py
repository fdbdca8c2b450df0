"""How precisely `check_equivalence` can judge a gap: the least precise dtype a model computes in.

`PrecisionProbe` records the least precise dtype any differentiable result of a run had (a
Llama-style RMSNorm's `x.float()` inside a float64 check, bf16 autocast); `tolerance` turns
that dtype, or the check's own, and the number of micro-batches into the largest relative gap
rounding explains.

Example:
    >>> import torch
    >>> tolerance(torch.float64, micro_batches=4)
    1e-10
    >>> tolerance(torch.bfloat16, micro_batches=16)
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


def tolerance(computed: torch.dtype, micro_batches: int) -> float:
    """The largest relative gap rounding explains for gradients computed in `computed`.

    `computed` is the least precise dtype of the run: the check's own, or one the model computes
    in inside (autocast, `.to(torch.bfloat16)`). In bfloat16 or float16 each micro-batch's
    gradient is rounded to that dtype once more (its own backward's outputs, or the `.grad` it
    is summed into), an error growing like the square root of the number of micro-batches,
    which bfloat16's 8-bit significand makes as large as the forward's own (1.0e-2 over 20
    micro-batches under bf16 autocast; 1.1e-2 to 1.8e-2 over 16 to 32 in bf16 `.grad`).
    """
    if computed in _TOLERANCE:
        return _TOLERANCE[computed]
    eps = torch.finfo(computed).eps
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
