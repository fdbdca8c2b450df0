"""Gradient synchronization across ranks: one strategy per backend, chosen from the model.

A `GradSync` answers the four questions the window asks of a backend:

- how to run a micro-batch without reducing gradients (`micro_context`);
- whether, and how, the window's last backward reduces them (`syncs_last_backward`);
- how ranks agree on the window: before it, how many micro-batches each runs (`agree_on_plan`:
  FSDP2 pads ranks with fewer by zero-item micro-batches); after it, counts, loss,
  micro-batches, which params hold a gradient and whether any rank failed (`exchange`, one
  small collective per window);
- how to reduce what the backend did not (`reduce`), and what the backend's own reduction
  divided by (`averaged_over`).

`LocalSync` is the identity on one process. `DDPSync` runs every micro-batch under `no_sync()`
and reduces the window's gradients by hand in one flat all-reduce per dtype at the boundary: the
ranks take the same collective path whatever their micro-batches held (a rank whose last
micro-batch counts no item and has no graph cannot leave the others waiting), and a parameter no
rank used keeps `grad=None`. `FSDP2Sync` defers FSDP2's reduce-scatter to the window's last
backward; when that backward cannot run on every rank, a zero-item synchronized backward settles
the deferred sums instead. The strategies live in `gradaccum._sync_base` (interface, one process)
and `gradaccum._distributed_sync` (DDP, FSDP2).

Example:
    >>> import torch
    >>> sync = grad_sync_for(torch.nn.Linear(2, 1))
    >>> type(sync).__name__, sync.world, sync.averaged_over
    ('LocalSync', 1, 1)
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from gradaccum._agreement import (
    FAILED,
    OUT_OF_MEMORY,
    RankMismatchError,
    RankSummary,
    WindowAgreement,
)
from gradaccum._distributed_sync import DDPSync, FSDP2Sync
from gradaccum._launch import launched_processes
from gradaccum._sync_base import (
    GradSync,
    LocalSync,
    Plan,
    device_for,
    is_fsdp,
    process_group,
    uncompiled,
    world_size,
)
from gradaccum._tensor_parallel import composable_replicate_error, dtensor_ranks
from gradaccum._warnings import warn_user
from gradaccum.options import SyncPolicy

__all__ = [
    "FAILED",
    "OUT_OF_MEMORY",
    "DDPSync",
    "FSDP2Sync",
    "GradSync",
    "LocalSync",
    "Plan",
    "RankMismatchError",
    "RankSummary",
    "WindowAgreement",
    "all_ranks_max",
    "all_ranks_min",
    "any_rank",
    "grad_sync_for",
    "is_fsdp",
    "sync_context",
    "world_size",
]


def grad_sync_for(
    model: torch.nn.Module, policy: SyncPolicy = SyncPolicy.WINDOW, *, trains: bool = False
) -> GradSync:
    """The strategy for `model`: FSDP2, DDP, or local (also for a wrapper on one rank).

    Args:
        model: The model, wrapped or not.
        policy: FSDP2's sync policy.
        trains: The strategy is for training steps (an `Accumulator`), not a probe: warn if
            several ranks run but `model` reduces nothing over them.

    Raises:
        ValueError: For `SyncPolicy.MICRO` on a DDP model (it holds full gradients anyway),
            and for `torch.distributed._composable.replicate`, which averages every backward.
    """
    group, model = process_group(model), uncompiled(model)  # torch.compile(DDP(...)): the DDP
    if group is None and trains and _shards_inside(model):
        raise ValueError(
            "fully_shard was applied to submodules of this model but not to the model itself, "
            "so its own parameters outside them are reduced by no one and the Accumulator "
            "cannot tell the model is sharded. Call fully_shard(model) on the root as well "
            "(after its blocks), as FSDP2's recipe does, then build the optimizer and the "
            "Accumulator. Nothing was changed."
        )
    if trains and (error := composable_replicate_error(model)) is not None:
        raise error
    if group is None and trains and dist.is_available() and dist.is_initialized():
        ranks = dist.get_world_size()
        # tensor parallel over every rank: each sees the same batch, nothing to reduce
        if ranks > 1 and dtensor_ranks(model) < ranks:  # e.g. ddp.module handed over
            warn_user(
                UserWarning(
                    f"torch.distributed runs {ranks} ranks, but the model given to the "
                    "Accumulator is not wrapped in DistributedDataParallel or fully_shard, so "
                    "no gradient is reduced over ranks: each rank steps on its own data alone "
                    "and the replicas drift apart. Pass the DistributedDataParallel wrapper "
                    "itself (not ddp.module), or with tensor parallel fully_shard(model, "
                    'mesh=mesh["dp"]); if every rank trains its own model on purpose, ignore '
                    "this warning."
                )
            )
    if group is None and trains and not (dist.is_available() and dist.is_initialized()):
        _warn_if_launched_as_several()
    if group is None or dist.get_world_size(group) == 1:
        return LocalSync()
    if is_fsdp(model):
        return FSDP2Sync(model, policy)
    if policy is not SyncPolicy.WINDOW:
        raise ValueError(
            f"sync_policy={policy.value!r} is for FSDP2, whose ranks hold gradient shards; a DDP "
            "model holds full gradients either way, so reducing every micro-batch would only "
            "add communication. Leave sync_policy='window'."
        )
    return DDPSync(model)


def _warn_if_launched_as_several() -> None:
    """A launcher (torchrun) started several processes that never joined a process group.

    A single-process script launched by `torchrun --nproc_per_node 2` trains one model per
    process, each on its own data, and nothing says so: warned, naming the fix.
    """
    world = launched_processes()
    if world > 1:
        warn_user(
            UserWarning(
                f"this process is one of {world} (WORLD_SIZE={world}, e.g. from torchrun), but "
                "torch.distributed is not initialized and the model is not wrapped, so no "
                "gradient is reduced over the processes: each trains its own copy on its own "
                "data alone. Call dist.init_process_group(...) and pass "
                "DistributedDataParallel(model) (or a fully_shard model) to the Accumulator "
                "(README, 'Distributed (torchrun)'); if every process trains its own model on "
                "purpose, ignore this warning."
            )
        )


def _shards_inside(model: torch.nn.Module) -> bool:
    """Whether some submodule of `model` (not `model` itself) was given to `fully_shard`."""
    return any(is_fsdp(module) for module in model.modules() if module is not model)


def sync_context(model: torch.nn.Module, *, sync: bool) -> contextlib.AbstractContextManager[None]:
    """Context for one forward and backward outside a window: gradients reduced only if `sync`.

    Used by memory probes, which must not reduce gradients across ranks.
    """
    if sync:
        return contextlib.nullcontext()
    return grad_sync_for(model).micro_context(last=False)


def any_rank(model: torch.nn.Module, flag: bool) -> bool:
    """Whether `flag` is set on any rank: one all-reduce of one number (no-op on one process)."""
    return bool(_reduce_int(model, int(flag), dist.ReduceOp.MAX))


def all_ranks_max(model: torch.nn.Module, values: list[float]) -> list[float]:
    """Each of `values` at its largest over ranks (`values` itself on one process)."""
    group = process_group(model)
    if group is None or dist.get_world_size(group) == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device_for(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in tensor.tolist()]


def all_ranks_min(model: torch.nn.Module, value: int) -> int:
    """The smallest of every rank's `value` (itself on one process), so all ranks agree on it."""
    return _reduce_int(model, value, dist.ReduceOp.MIN)


def _reduce_int(model: torch.nn.Module, value: int, op: dist.ReduceOp.RedOpType) -> int:
    group = process_group(model)
    if group is None or dist.get_world_size(group) == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device_for(group))
    dist.all_reduce(tensor, op=op, group=group)
    return int(tensor.item())
