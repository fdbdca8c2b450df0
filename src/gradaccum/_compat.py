"""The torch APIs gradaccum uses that are newer than its oldest supported torch (2.4).

Each helper calls torch's own API where the running torch has it and otherwise does the same
thing with what torch 2.4 offers; nothing is patched into torch. What they stand in for:

- `torch.accelerator` (2.6; its memory statistics 2.8): `current_accelerator`, `synchronize`,
  `max_memory_allocated`, from the device's own module (`torch.cuda`, `torch.xpu`, ...) before;
- `torch.nn.utils.get_total_norm` (2.6): `total_norm`, the norm `clip_grad_norm_` computes;
- the public `torch.distributed.tensor.DTensor` (2.5; `torch.distributed._tensor` before) and
  `torch.distributed.fsdp.FSDPModule` (2.6; `torch.distributed._composable.fsdp` before). FSDP2
  itself needs torch 2.6: `check_fsdp2_supported` refuses the prototype of earlier releases.

Example:
    >>> import torch
    >>> float(total_norm([torch.tensor([3.0]), torch.tensor([4.0], dtype=torch.float64)]))
    5.0
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "check_fsdp2_supported",
    "current_accelerator",
    "dtensor_type",
    "fsdp_module_type",
    "max_memory_allocated",
    "synchronize",
    "total_norm",
]

# The accelerators torch.accelerator knows, in its order; torch 2.4 has a module for each.
_ACCELERATORS = ("cuda", "mtia", "xpu", "mps", "hpu")


def _device_module(device_type: str) -> Any:
    return getattr(torch, device_type, None)


def current_accelerator() -> torch.device | None:
    """`torch.accelerator.current_accelerator()`: the available accelerator's type, or None."""
    if hasattr(torch, "accelerator"):
        found: torch.device | None = torch.accelerator.current_accelerator()
        return found
    for device_type in _ACCELERATORS:
        module = _device_module(device_type)
        is_available = getattr(module, "is_available", None)
        if is_available is not None and is_available():
            return torch.device(device_type)
    return None


def synchronize(device: torch.device) -> None:
    """Wait for every kernel queued on `device` (nothing to wait for on the CPU)."""
    if device.type == "cpu":
        return
    if hasattr(torch, "accelerator"):
        if torch.accelerator.is_available():
            torch.accelerator.synchronize(device)
        return
    module = _device_module(device.type)
    if module is None or not module.is_available():
        return
    if device.type == "mps":  # torch.mps.synchronize() takes no device
        module.synchronize()
    else:
        module.synchronize(device)


def max_memory_allocated(device: torch.device) -> int | None:
    """The device's peak allocated bytes, or None where this torch cannot tell."""
    accelerator = getattr(torch, "accelerator", None)
    reader = getattr(accelerator, "max_memory_allocated", None)
    if reader is None:  # before torch 2.8: the device module's own, where it has one
        reader = getattr(_device_module(device.type), "max_memory_allocated", None)
    return None if reader is None else int(reader(device))


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """`torch.nn.utils.get_total_norm(grads)`: the 2-norm `clip_grad_norm_` computes.

    Before torch 2.6 `clip_grad_norm_` computed it inline, the same way: one fused norm per
    (device, dtype) group, then the norm of those norms on the first gradient's device.
    """
    if hasattr(torch.nn.utils, "get_total_norm"):
        norm: torch.Tensor = torch.nn.utils.get_total_norm(grads)
        return norm
    if not grads:
        return torch.tensor(0.0)
    # torch's own grouping, so the norms are stacked in the order clip_grad_norm_ stacks them.
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    groups = _group_tensors_by_device_and_dtype([grads])  # type: ignore[list-item]
    norms = [
        norm
        for [group], _ in groups.values()
        for norm in torch._foreach_norm(cast("list[torch.Tensor]", group), 2)
    ]
    first = grads[0].device
    stacked = torch.stack([norm.to(first) for norm in norms])
    result: torch.Tensor = torch.linalg.vector_norm(stacked, 2)
    return result


def dtensor_type() -> type[DTensor]:
    """The `DTensor` class (public in torch 2.5, `torch.distributed._tensor` in 2.4)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        module = importlib.import_module("torch.distributed._tensor")
        return cast("type[DTensor]", module.DTensor)
    return DTensor


def fsdp_module_type() -> type[Any] | None:
    """FSDP2's `FSDPModule` class, or None for a torch built without distributed support.

    Public in torch 2.6; torch 2.4 and 2.5 keep it in `torch.distributed._composable.fsdp`,
    found here only so that `check_fsdp2_supported` can refuse such a model by name.
    """
    for path in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            found = getattr(importlib.import_module(path), "FSDPModule", None)
        except ImportError:
            continue
        if isinstance(found, type):
            return found
    return None


def check_fsdp2_supported() -> None:
    """Refuse FSDP2 on a torch whose `fully_shard` is still private (before torch 2.6).

    There FSDP2 is a prototype that runs on CUDA only (not on CPU with gloo, where gradaccum's
    FSDP2 tests run), so gradaccum does not claim it: silently treating such a model as
    undistributed would divide its gradients by the wrong count.

    Raises:
        RuntimeError: Naming the torch release FSDP2 support needs.
    """
    if not hasattr(importlib.import_module("torch.distributed.fsdp"), "FSDPModule"):
        raise RuntimeError(
            "gradaccum supports FSDP2 (fully_shard) from torch 2.6, where it is public "
            "(torch.distributed.fsdp.fully_shard); this model was sharded with the prototype of "
            f"torch {torch.__version__} (torch.distributed._composable.fsdp). Upgrade torch to "
            "2.6 or later, or wrap the model in DistributedDataParallel instead."
        )
