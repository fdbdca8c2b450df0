"""Gradient synchronization across ranks: deferring it inside a window, and global item counts.

On one process everything here is a no-op. For a model wrapped in
`torch.nn.parallel.DistributedDataParallel`, every micro-batch but the last of a window runs under
`no_sync()`, so gradients are reduced once per window; the window's item count is summed over
ranks, and DDP's division by the world size is undone, so the result is the global item mean.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> with sync_context(model, sync=False):
    ...     pass
    >>> world_size(model), all_reduce_sum(model, [5.0, 2.5])
    (1, [5.0, 2.5])
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_sum",
    "average_gradients",
    "grad_average_factor",
    "sync_context",
    "world_size",
]


def _is_ddp(model: torch.nn.Module) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def world_size(model: torch.nn.Module) -> int:
    """Number of ranks the model's gradients are reduced over (1 when not distributed)."""
    if _is_ddp(model) and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(model.process_group)
    return 1


def sync_context(model: torch.nn.Module, *, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-batch's forward and backward: `no_sync()` unless `sync` is True."""
    if not sync and _is_ddp(model):
        return model.no_sync()
    return contextlib.nullcontext()


def all_reduce_sum(model: torch.nn.Module, values: list[float]) -> list[float]:
    """Sum a few per-rank numbers over the model's ranks in one collective (identity on one).

    Float64 holds integer counts exactly up to 2**53, so counts and loss sums travel together.
    """
    if world_size(model) == 1:
        return values
    device = next(model.parameters()).device
    if dist.get_backend(model.process_group) == "gloo":
        device = torch.device("cpu")
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=model.process_group)
    return total.tolist()


def average_gradients(model: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    """Average `grads` over ranks by hand, as DDP would have on a synchronized backward.

    Used when a window's gradients never went through DDP's own reduction: a partial window
    settled by `flush()`, or gradients held in accumulation buffers that DDP does not see.
    """
    ranks = world_size(model)
    if ranks == 1:
        return
    for grad in grads:
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=model.process_group)
    torch._foreach_div_(grads, float(ranks))


def grad_average_factor(model: torch.nn.Module) -> int:
    """What the wrapper divided the summed gradient by (DDP averages over ranks)."""
    return world_size(model)
