"""Gradient synchronization across ranks: deferring it inside a window, and global item counts.

On one process everything here is a no-op. For a model wrapped in
`torch.nn.parallel.DistributedDataParallel`, every micro-batch but the last of a window runs under
`no_sync()`, so gradients are reduced once per window; the window's item count is summed over
ranks, and DDP's division by the world size is undone, so the result is the global item mean.
A model with FSDP2's `fully_shard` applied is handled alike: its reduce-scatter is deferred with
`set_requires_gradient_sync(False)` and its mean over ranks is undone.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> with sync_context(model, sync=False):
    ...     pass
    >>> world_size(model), agree_on_window(model, 5, 2.5, micro_batches=2, grad_divisor=8.0)
    (1, GlobalTotals(count=5, loss_sum=2.5))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "RankMismatchError",
    "GlobalTotals",
    "agree_on_plan",
    "agree_on_window",
    "all_ranks_min",
    "any_rank",
    "average_gradients",
    "grad_average_factor",
    "is_fsdp",
    "sync_context",
    "world_size",
]


def _is_ddp(model: torch.nn.Module) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether `fully_shard` (FSDP2) was applied to the model."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(model, FSDPModule)


def _group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The process group the model's gradients are reduced over, or None if not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _is_ddp(model):
        return model.process_group
    if is_fsdp(model):
        return next(model.parameters()).device_mesh.get_group()
    return None


def world_size(model: torch.nn.Module) -> int:
    """Number of ranks the model's gradients are reduced over (1 when not distributed)."""
    group = _group(model)
    return 1 if group is None else dist.get_world_size(group)


def sync_context(model: torch.nn.Module, *, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-batch's forward and backward: gradients reduced only if `sync`.

    DDP: `no_sync()`. FSDP2: `set_requires_gradient_sync(False)` on every FSDP module, put back
    afterwards, so the reduce-scatter waits for the window's last backward.
    """
    if sync:
        return contextlib.nullcontext()
    if _is_ddp(model):
        return model.no_sync()
    if is_fsdp(model):
        return _fsdp_deferred(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_deferred(model: torch.nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class RankMismatchError(RuntimeError):
    """Ranks ran windows of different shapes; every rank raises it, so none is left waiting."""


@dataclass(frozen=True)
class GlobalTotals:
    """One window's totals over all ranks."""

    count: int
    loss_sum: float


def agree_on_window(
    model: torch.nn.Module, count: int, loss_sum: float, micro_batches: int, grad_divisor: float
) -> GlobalTotals:
    """Exchange each rank's window totals in one small all-gather and check the ranks agree.

    Called once per window, before the backward pass that reduces gradients, so a rank whose
    window differs raises here, on every rank alike, instead of leaving the others blocked in a
    gradient reduction it never joins.

    Args:
        model: The (possibly DDP-wrapped) model, whose process group is used.
        count: This rank's item count in the window.
        loss_sum: This rank's summed loss in the window.
        micro_batches: Micro-batches this rank ran in the window.
        grad_divisor: What this rank's gradients are divided by (must be the same everywhere).

    Returns:
        The summed count and loss over ranks (this rank's own on one process).

    Raises:
        RankMismatchError: If ranks ran different numbers of micro-batches or scaled their
            gradients differently; the message lists every rank's figures.
    """
    ranks = world_size(model)
    if ranks == 1:
        return GlobalTotals(count, loss_sum)
    group = _group(model)
    mine = torch.tensor(
        [count, loss_sum, micro_batches, grad_divisor], dtype=torch.float64, device=_device(group)
    )
    gathered = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(gathered, mine, group=group)
    rows = [row.tolist() for row in gathered]
    if len({row[2] for row in rows}) > 1 or len({row[3] for row in rows}) > 1:
        listing = "; ".join(
            f"rank {rank}: {int(row[2])} micro-batches, gradient divisor {row[3]:g}"
            for rank, row in enumerate(rows)
        )
        raise RankMismatchError(
            f"ranks ran different accumulation windows ({listing}); every rank must run the same "
            "number of micro-batches per window, with first micro-batches of the same size. "
            "Give each rank the same batch size, or drop the uneven remainder (e.g. "
            "DistributedSampler(drop_last=True))."
        )
    return GlobalTotals(int(sum(row[0] for row in rows)), sum(row[1] for row in rows))


def agree_on_plan(model: torch.nn.Module, micro_batches: int, first_items: int) -> None:
    """Before a window's first forward, check every rank plans the same micro-batches (FSDP2).

    Every FSDP2 forward is itself a collective, so a rank with one micro-batch more would break
    the collectives before the window's own check could run. `step()` knows its plan up front and
    compares it here, at the cost of one more tiny all-gather per window, on FSDP2 only.

    Raises:
        RankMismatchError: If ranks plan different numbers or sizes of micro-batches.
    """
    ranks = world_size(model)
    if ranks == 1:
        return
    group = _group(model)
    mine = torch.tensor([micro_batches, first_items], dtype=torch.float64, device=_device(group))
    gathered = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(gathered, mine, group=group)
    rows = [row.tolist() for row in gathered]
    if len({tuple(row) for row in rows}) > 1:
        listing = "; ".join(
            f"rank {rank}: {int(row[0])} micro-batches, the first of {int(row[1])} items"
            for rank, row in enumerate(rows)
        )
        raise RankMismatchError(
            f"ranks planned different accumulation windows ({listing}); give every rank the same "
            "batch size, e.g. DistributedSampler(drop_last=True)."
        )


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator() or "cpu")


def average_gradients(model: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    """Average `grads` over ranks by hand, as DDP would have on a synchronized backward.

    Used when a window's gradients never went through DDP's own reduction: a partial window
    settled by `flush()`, or gradients held in accumulation buffers that DDP does not see. Every
    rank must pass the same tensors in the same order; they travel as one flat buffer per dtype.
    """
    ranks = world_size(model)
    if ranks == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for group in by_dtype.values():
        flat = torch.cat([grad.reshape(-1) for grad in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=_group(model))
        flat.div_(ranks)
        for grad, part in zip(group, flat.split([g.numel() for g in group]), strict=True):
            grad.copy_(part.view_as(grad))


def grad_average_factor(model: torch.nn.Module) -> int:
    """What the wrapper divided the summed gradient by (DDP and FSDP2 average over ranks)."""
    return world_size(model)


def any_rank(model: torch.nn.Module, flag: bool) -> bool:
    """Whether `flag` is set on any rank: one all-reduce of one number (no-op on one process)."""
    return bool(_reduce_int(model, int(flag), dist.ReduceOp.MAX))


def all_ranks_min(model: torch.nn.Module, value: int) -> int:
    """The smallest of every rank's `value` (itself on one process), so all ranks agree on it."""
    return _reduce_int(model, value, dist.ReduceOp.MIN)


def _reduce_int(model: torch.nn.Module, value: int, op: dist.ReduceOp) -> int:
    if world_size(model) == 1:
        return value
    group = _group(model)
    tensor = torch.tensor([value], dtype=torch.int64, device=_device(group))
    dist.all_reduce(tensor, op=op, group=group)
    return int(tensor.item())
