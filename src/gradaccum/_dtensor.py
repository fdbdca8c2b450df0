"""Sharded (DTensor) gradients in saved state: local shards on disk, DTensors again in memory.

An FSDP2 window saved mid-window holds DTensor gradients and buffers. A checkpoint stores each
rank's local shard (plain tensors load with `weights_only=True`), and loading wraps it back into
a DTensor laid out like the parameter it belongs to (same mesh, same placements), which needs the
same number of ranks.

Example:
    >>> import torch
    >>> like_param(torch.ones(2), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))).dtype
    torch.float64
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum import _compat

__all__ = ["like_param", "local_shards", "local_tensor"]


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor (an FSDP2-sharded parameter or its gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: its local shard for a DTensor, else `tensor` itself."""
    dtensor = _compat.dtensor_type()
    if isinstance(tensor, dtensor):
        local: torch.Tensor = tensor.to_local()
        return local
    return tensor


def local_shards(value: Any) -> Any:
    """`value` with every DTensor replaced by a copy of this rank's local shard (any nesting)."""
    dtensor = _compat.dtensor_type()
    if isinstance(value, dtensor):
        return value.to_local().detach().clone()
    if isinstance(value, dict):
        return {key: local_shards(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_shards(item) for item in value)
    return value


def like_param(
    tensor: torch.Tensor, param: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`tensor` on `param`'s device in `dtype` (default: `param`'s), sharded as `param` is.

    A plain tensor meant for a DTensor parameter is taken as this rank's local shard.
    """
    dtensor = _compat.dtensor_type()
    dtype = dtype or param.dtype
    if isinstance(param, dtensor) and not isinstance(tensor, dtensor):
        sharded: torch.Tensor = dtensor.from_local(
            tensor.to(param.device, dtype),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
        return sharded
    return tensor.to(param.device, dtype)
