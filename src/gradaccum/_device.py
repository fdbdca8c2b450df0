"""Moving a batch's tensors to a device, or mapping a function over them, keeping its nesting.

Part of `gradaccum.batching`, which re-exports these functions: they walk dicts, lists, tuples,
named tuples and dataclasses as the batching does, and keep every other leaf as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from gradaccum._records import (
    dataclass_entries,
    is_dataclass_instance,
    rebuild_dataclass,
    rebuild_mapping,
    rebuild_tuple,
)

__all__ = ["map_tensors", "on_device", "to_device"]


def to_device(batch: Any, device: torch.device) -> Any:
    """Return `batch` with every tensor moved to `device` (non-blocking where it can be).

    A batch already on `device` is returned as it is, without rebuilding its containers. Other
    leaves, numpy arrays included, are kept as they are.

    Raises:
        ValueError: If a tensor is on the meta device (no data to move), naming its shape.

    Example:
        >>> import torch
        >>> to_device({"x": torch.ones(2)}, torch.device("cpu"))["x"].device.type
        'cpu'
    """
    if on_device(batch, device):
        return batch

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta and device.type != "meta":  # torch: "Cannot copy out of meta tensor"
            raise ValueError(
                f"the batch holds a meta tensor of shape {tuple(tensor.shape)}: it has a shape "
                f"but no data, so it cannot be moved to the model's device ({device}). Build the "
                "batch on a real device (not under `with torch.device('meta')` nor with "
                "device='meta'), or take the tensor out of the batch."
            )
        return tensor.to(device, non_blocking=True)

    return map_tensors(batch, move)


def on_device(batch: Any, device: torch.device) -> bool:
    """Whether every tensor of `batch` is on `device` (the slices of one batch answer alike).

    Example:
        >>> on_device((torch.ones(2), [1, 2]), torch.device("cpu"))
        True
    """
    if isinstance(batch, torch.Tensor):
        return batch.device == device
    if isinstance(batch, Mapping):
        values: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    elif is_dataclass_instance(batch):
        values = [value for _, value in dataclass_entries(batch)]
    else:
        return True
    for value in values:  # noqa: SIM110 - a loop: all(generator) costs more, once per micro-batch
        if not on_device(value, device):
            return False
    return True


def map_tensors(
    batch: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
    arrays: Callable[[np.ndarray], Any] | None = None,
) -> Any:
    """Rebuild `batch` with `fn` applied to every tensor leaf (and `arrays` to numpy arrays).

    Other leaves are kept as they are.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return rebuild_mapping(batch, {k: map_tensors(v, fn, arrays) for k, v in batch.items()})
    if isinstance(batch, PackedSequence):  # its batch_sizes stay on the CPU, as RNNs need
        order = (batch.sorted_indices, batch.unsorted_indices)
        moved = [None if t is None else fn(t) for t in order]
        return PackedSequence(fn(batch.data), batch.batch_sizes, *moved)
    if isinstance(batch, tuple) and type(batch) is not tuple:  # named tuples, torch.Size...
        return rebuild_tuple(batch, [map_tensors(v, fn, arrays) for v in batch])
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn, arrays) for v in batch)
    if is_dataclass_instance(batch):
        values = {k: map_tensors(v, fn, arrays) for k, v in dataclass_entries(batch)}
        return rebuild_dataclass(batch, values)
    if arrays is not None and isinstance(batch, np.ndarray):
        return arrays(batch)
    return batch
