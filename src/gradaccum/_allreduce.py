"""Summing gradients over ranks by hand: every collective in flight at once, bounded memory.

Used by the DDP strategy, which reduces each window's gradients itself (and broadcasts the
module's buffers from the group's first rank, as DDP's forward would). A gradient of at least
`IN_PLACE_BYTES` is all-reduced in place (no copy); smaller ones travel in flat buckets of at most
`BUCKET_BYTES`, which bounds the temporary memory (one flat buffer of every gradient would double
the gradients' memory). All collectives are started asynchronously and waited for together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BUCKET_BYTES", "IN_PLACE_BYTES", "all_reduce_sum", "broadcast_from_first"]

BUCKET_BYTES = 32 * 2**20  # the largest temporary buffer
IN_PLACE_BYTES = 2**20  # gradients this large are reduced in place rather than copied


def all_reduce_sum(grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum `grads` over the ranks of `group`, in place.

    Every rank must pass tensors of the same shapes, dtypes and order.
    """
    pending: list[tuple[Any, list[torch.Tensor], torch.Tensor | None]] = []
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if nbytes >= IN_PLACE_BYTES and grad.is_contiguous():
            pending.append((_start(grad, group), [grad], None))
            continue
        if bucket and (
            size + nbytes > BUCKET_BYTES
            or (grad.dtype, grad.device) != (bucket[0].dtype, bucket[0].device)
        ):
            pending.append(_start_bucket(bucket, group))
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        pending.append(_start_bucket(bucket, group))
    for work, members, flat in pending:
        work.wait()
        if flat is not None:
            parts = torch.split(flat, [g.numel() for g in members])
            for grad, part in zip(members, parts, strict=True):
                grad.copy_(part.view_as(grad))


def _start(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> Any:
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


def _start_bucket(
    bucket: list[torch.Tensor], group: dist.ProcessGroup | None
) -> tuple[Any, list[torch.Tensor], torch.Tensor | None]:
    flat = torch.cat([grad.reshape(-1) for grad in bucket])
    return _start(flat, group), bucket, flat


def broadcast_from_first(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrite `tensors` with the group's first rank's, in place: one flat broadcast per dtype.

    Every rank must pass tensors of the same shapes, dtypes and order.
    """
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        pending = []
        for members in by_kind.values():
            flat = torch.cat([tensor.reshape(-1) for tensor in members])
            work = dist.broadcast(flat, group_src=0, group=group, async_op=True)
            pending.append((work, members, flat))
        for work, members, flat in pending:
            work.wait()
            parts = torch.split(flat, [tensor.numel() for tensor in members])
            for tensor, part in zip(members, parts, strict=True):
                tensor.copy_(part.view_as(tensor))
