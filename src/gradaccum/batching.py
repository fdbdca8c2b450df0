"""Splitting nested batches into micro-batches and moving them to the model's device.

A batch is a tensor, or any nesting of dicts, lists and tuples (named tuples too) whose tensor
leaves share the leading dimension B. Non-tensor leaves (strings, ints, masks kept as lists...)
go unchanged to every micro-batch. Splitting makes views, never copies.

Example:
    >>> import torch
    >>> from gradaccum import split_batch
    >>> batch = {"x": torch.zeros(5, 3), "y": torch.arange(5), "name": "train"}
    >>> [len(mb["y"]) for mb in split_batch(batch, 2)]
    [2, 2, 1]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["batch_size", "map_tensors", "split_batch", "to_device"]


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split `batch` along its leading dimension into micro-batches of `micro_batch_size`.

    Args:
        batch: A tensor or a nesting of dict/list/tuple whose tensors share the leading dim.
        micro_batch_size: Items per micro-batch; the last one holds the remainder.

    Returns:
        `ceil(B / micro_batch_size)` micro-batches with the batch's structure.

    Raises:
        ValueError: If `micro_batch_size` is not a positive int, the batch is empty, or its
            tensors disagree on the leading dimension.

    Example:
        >>> import torch
        >>> [t.tolist() for t in split_batch(torch.arange(5), 3)]
        [[0, 1, 2], [3, 4]]
    """
    check_micro_batch_size(micro_batch_size)
    size = batch_size(batch)
    starts = range(0, size, micro_batch_size)
    return [map_tensors(batch, lambda t, s=s: t[s : s + micro_batch_size]) for s in starts]


def batch_size(batch: Any) -> int:
    """Return the leading dimension shared by every tensor in `batch`.

    Args:
        batch: A tensor or a nesting of dict/list/tuple holding at least one tensor.

    Returns:
        B, the number of items.

    Raises:
        ValueError: If the batch holds no tensor, a 0-dim tensor, tensors of different leading
            dimensions (the message names their paths), or zero items.

    Example:
        >>> import torch
        >>> batch_size((torch.zeros(4, 2), torch.zeros(4)))
        4
    """
    sizes: dict[str, int] = {}
    for path, tensor in _tensor_leaves(batch, "batch"):
        if tensor.dim() == 0:
            raise ValueError(
                f"{path} is a 0-dim tensor; every tensor in a batch needs a leading (batch) "
                "dimension. Pass per-batch constants as Python numbers instead."
            )
        sizes[path] = tensor.shape[0]
    if not sizes:
        raise ValueError(
            f"the batch ({type(batch).__name__}) holds no tensor; pass a tensor or a "
            "dict/list/tuple of tensors that share the leading dimension."
        )
    distinct = sorted(set(sizes.values()))
    if len(distinct) > 1:
        listing = ", ".join(f"{p}: {n}" for p, n in sizes.items())
        raise ValueError(
            f"batch tensors disagree on the leading dimension ({listing}); every tensor must "
            "have the same number of items along dim 0."
        )
    if distinct[0] == 0:
        raise ValueError("the batch is empty (leading dimension 0); pass at least one item.")
    return distinct[0]


def to_device(batch: Any, device: torch.device) -> Any:
    """Return `batch` with every tensor moved to `device` (non-blocking where it can be).

    A batch already on `device` is returned as it is, without rebuilding its containers.

    Example:
        >>> import torch
        >>> to_device({"x": torch.ones(2)}, torch.device("cpu"))["x"].device.type
        'cpu'
    """
    if all(tensor.device == device for _, tensor in _tensor_leaves(batch, "")):
        return batch
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def check_micro_batch_size(micro_batch_size: object, name: str = "micro_batch_size") -> int:
    """Return `micro_batch_size` if it is a positive int, else raise a ValueError naming the fix."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise ValueError(
            f"{name}={micro_batch_size!r} must be a positive int (items per micro-batch), "
            f"got {type(micro_batch_size).__name__}."
        )
    if micro_batch_size <= 0:
        raise ValueError(f"{name}={micro_batch_size} must be a positive int, e.g. {name}=8.")
    return micro_batch_size


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Rebuild `batch` with `fn` applied to every tensor leaf; other leaves are kept as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: map_tensors(v, fn) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def _tensor_leaves(batch: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _tensor_leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            yield from _tensor_leaves(value, f"{path}[{index}]")
