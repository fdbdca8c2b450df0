"""Measuring the activation memory that autograd keeps between a forward and its backward.

A forward pass records, for its backward, the tensors each operation needs (a ReLU's output, a
Linear's input...). Those *saved tensors* are what a micro-batch shrinks: they grow with the number
of items in the batch, while parameters, gradients and optimizer state do not. This module counts
them exactly, with `torch.autograd.graph.saved_tensors_hooks`, instead of estimating them from
shapes or reading an allocator's counters (which do not exist on CPU and include unrelated memory).

What is counted: every distinct storage that autograd saves during `loss_fn(model, batch)`, at its
full size (a saved view keeps its whole storage alive). What is not counted: storages of the
model's parameters and buffers and of the batch's own tensors, which exist whether or not a graph
is built; temporaries freed during the forward; and the transient gradient buffers of the backward
itself. The result is the memory the graph holds at the end of the forward, which is the peak that
lasts until the backward releases it.

Example:
    >>> import torch
    >>> from gradaccum.memory import measure_activation_bytes
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    >>> measure_activation_bytes(model, torch.randn(3, 4), lambda m, x: m(x).sum())
    96
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["measure_activation_bytes"]


def measure_activation_bytes(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable[[torch.nn.Module, Any], Any],
) -> int:
    """Return the bytes of activations autograd saves for the backward of `loss_fn(model, batch)`.

    The forward runs once, under `torch.autograd.graph.saved_tensors_hooks`, and every saved
    tensor's storage is recorded by its address, so a storage saved several times (a ReLU output
    that the next Linear saves again, views of one tensor) is counted once. The graph is then
    released without a backward: no `.grad` is touched and the model's parameters are unchanged.
    The forward runs in the model's current mode and under the caller's autocast, if any.

    Storages of the model's parameters and buffers, and of every tensor in `batch`, are left out:
    they are held anyway. So the micro-batch views made by `gradaccum.split_batch` do not count
    the whole batch they view. Tensors captured by `loss_fn` from elsewhere (a target held in a
    closure, say) are counted if autograd saves them; pass them in `batch` to leave them out.

    Args:
        model: The model whose forward is measured.
        batch: What `loss_fn` receives: a tensor or any nesting of dicts, lists and tuples.
        loss_fn: `loss_fn(model, batch)`, e.g. returning a scalar tensor or a `gradaccum.LossSum`;
            its result is only used to keep the graph alive while measuring.

    Returns:
        The total size in bytes of the distinct storages saved for backward; 0 if the forward
        builds no graph (under `torch.no_grad()`, or with nothing requiring grad).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
        ...                             torch.nn.Linear(32, 1))
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> small = measure_activation_bytes(model, (torch.randn(8, 16), torch.randn(8, 1)), mse)
        >>> large = measure_activation_bytes(model, (torch.randn(32, 16), torch.randn(32, 1)), mse)
        >>> small, large // small  # the Tanh output and the prediction: 8 * (32 + 1) * 4 bytes
        (1056, 4)
    """
    held = {_storage_address(t) for t in _held_tensors(model, batch)}
    saved: dict[tuple[torch.device, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_address(tensor)
        if key is not None and key not in held:
            saved[key] = max(saved.get(key, 0), tensor.untyped_storage().nbytes())
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        result = loss_fn(model, batch)
    # Every saved storage stays alive until `result` (and so its graph) is dropped below, so no
    # address in `saved` can have been reused by another storage during the forward.
    del result
    return sum(saved.values())


def _held_tensors(model: torch.nn.Module, batch: Any) -> Iterator[torch.Tensor]:
    """Tensors that exist whether or not a graph is built: parameters, buffers, the batch."""
    yield from model.parameters()
    yield from model.buffers()
    yield from _batch_tensors(batch)


def _batch_tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _batch_tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _batch_tensors(value)


def _storage_address(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    """Identify a tensor's storage by device and address; None if it has no plain storage."""
    if tensor.is_sparse or tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return None
    if storage.nbytes() == 0:
        return None
    return tensor.device, storage.data_ptr()
