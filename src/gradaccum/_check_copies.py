"""The copies `check_equivalence` runs on: the model and the batch in the check's dtype.

`cast_copy` deep-copies the model and casts it tensor by tensor (complex ones to the complex
dtype of the same precision; state kept in plain attributes too), `cast` and `cast_array` cast
the batch's tensors and numpy arrays, `refuse_unmaterialized` refuses what has no values (meta,
lazy), and `float32_only` names the modules whose kernels take float32 alone.

Example:
    >>> import torch
    >>> cast_copy(torch.nn.Linear(2, 1), torch.float64).weight.dtype
    torch.float64
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from gradaccum.batching import map_tensors

__all__ = ["cast", "cast_array", "cast_copy", "float32_only", "refuse_unmaterialized", "tensors_of"]

# Complex tensors follow the check's dtype with the complex dtype of the same precision.
_COMPLEX = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def float32_only(model: torch.nn.Module) -> list[str]:
    """The fused fake-quantize modules of quantization-aware training, float32-only kernels.

    prepare_qat's default qconfig uses them; a float64 check fails in their forward.
    """
    return [
        f"{name or '<model>'} ({type(module).__name__})"
        for name, module in model.named_modules()
        if type(module).__name__ == "FusedMovingAvgObsFakeQuantize"
    ]


def refuse_unmaterialized(model: torch.nn.Module, batch: Any) -> None:
    """Raise, naming the fix, if a parameter, buffer or batch tensor holds no values."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if torch.nn.parameter.is_lazy(tensor):
            raise ValueError(
                f"{name} is uninitialized (a lazy module): run one forward pass on a batch first "
                "so that it gets its shape, then check."
            )
        if tensor.is_meta:
            raise ValueError(
                f"{name} is on the meta device: it has a shape but no values, so there is no "
                "gradient to check. Materialize the model first, e.g. "
                "model.to_empty(device='cpu'), then initialize it (reset_parameters() on each "
                "module, or load_state_dict(...))."
            )
    if any(tensor.is_meta for tensor in tensors_of(batch)):
        raise ValueError("the batch holds a meta tensor (no values); pass real data.")


def cast_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A deep copy, cast tensor by tensor: `Module.to(dtype)` would make complex tensors real."""
    try:
        clone = copy.deepcopy(model)
    except RuntimeError as error:  # e.g. a non-leaf tensor held as an attribute
        raise ValueError(
            f"check_equivalence runs on deep copies of the model, and copy.deepcopy failed: "
            f"{error}. Make the model copyable: replace torch.nn.utils.weight_norm with "
            "torch.nn.utils.parametrizations.weight_norm, and keep computed tensors out of "
            "module attributes."
        ) from error
    clone._apply(lambda tensor: cast(tensor, dtype))  # type: ignore[no-untyped-call]
    for module in clone.modules():  # state kept in plain attributes (an RNN's (h, c)) too
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                setattr(module, key, cast(value, dtype))
            elif isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
                setattr(module, key, tuple(cast(v, dtype) for v in value))
    return clone


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.is_complex():
        return tensor.to(_COMPLEX.get(dtype, torch.complex64))
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def cast_array(array: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """A floating (complex) numpy array in `dtype` (its complex twin), as tensors are cast."""
    if array.dtype.kind not in "fc":
        return array
    target = _COMPLEX.get(dtype, torch.complex64) if array.dtype.kind == "c" else dtype
    try:
        return array.astype(torch.empty(0, dtype=target).numpy().dtype)
    except TypeError:  # a dtype numpy does not have (bfloat16): left as it is
        return array


def tensors_of(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_tensors(batch, keep)
    return found
