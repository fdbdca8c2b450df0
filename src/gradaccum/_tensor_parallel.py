"""Meshes with a tensor-parallel dimension: which ranks share a batch, what FSDP2 divides by.

Under tensor parallelism (`parallelize_module`) every rank of a tensor-parallel group sees the
same batch and counts the same items. With FSDP2 on the data-parallel part of a 2-D mesh
(`fully_shard(model, mesh=mesh["dp"])`, or `mesh=` the whole mesh with `dp_mesh_dims=`),
FSDP2 averages gradients over the data-parallel ranks only, while the window's exchange runs
over every rank. So each batch's count and loss reach the exchange once per tensor-parallel
rank: summed as they were, the count was the TP degree too large (a `normalize="sum"` step
that many times too long, `StepResult.count` and `Tokens(n)` windows off alike).
`data_parallel` reads FSDP2's data-parallel size and this rank's place in it;
`one_row_per_batch` keeps one exchange row per data-parallel rank, after checking that the
ranks that share a batch counted alike.

Also here: the checks for models that look distributed without a backend the library drives
(`replicate` of `torch.distributed._composable`, tensor parallel over part of the ranks), and
`loss_parallel_context`: a cross-entropy computed inside torch's `loss_parallel()` (logits sharded
on the class dimension) needs its backward inside that context too, and the library runs the
backward after `loss_fn` has left it.

Example:
    >>> import torch
    >>> table = torch.tensor([[5.0, 0.0], [5.0, 0.0], [2.0, 1.0], [2.0, 1.0]])
    >>> one_row_per_batch(table, index_column=1).tolist()
    [[5.0, 0.0], [2.0, 1.0]]
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from gradaccum import _compat
from gradaccum._agreement import RankMismatchError

__all__ = [
    "DataParallel",
    "composable_replicate_error",
    "data_parallel",
    "dtensor_ranks",
    "loss_parallel_context",
    "one_row_per_batch",
    "sharded_view",
]


class DataParallel(NamedTuple):
    """FSDP2's data-parallel ranks: how many (what it averages over), and this rank's place."""

    size: int
    position: int


def data_parallel(model: torch.nn.Module) -> DataParallel | None:
    """FSDP2's data-parallel size and this rank's index among them, from its mesh (None: unknown).

    FSDP2 divides a gradient by its reduce-scatter group's size times its all-reduce group's
    (HSDP); ranks with the same index (a tensor-parallel group) see the same batch. Read from
    the first parameter group's mesh info, a private attribute of torch's `fully_shard`.
    """
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if callable(get_state) else None
        info = getattr(group, "mesh_info", None)
        if info is None:
            continue
        shard = int(getattr(info, "shard_mesh_size", 1))
        replicate = int(getattr(info, "replicate_mesh_size", 1))
        index = int(getattr(info, "replicate_mesh_rank", 0)) * shard
        return DataParallel(shard * replicate, index + int(getattr(info, "shard_mesh_rank", 0)))
    return None


def one_row_per_batch(table: torch.Tensor, index_column: int) -> torch.Tensor:
    """The exchange table with one row per data-parallel index: each batch counted once.

    Args:
        table: One row per rank; column 0 is the rank's item count.
        index_column: The column holding each rank's data-parallel index.

    Raises:
        RankMismatchError: If ranks that share an index (a tensor-parallel group, which must
            see the same batch) counted different items.
    """
    indices = table[:, index_column].tolist()
    first: dict[float, int] = {}
    for rank, index in enumerate(indices):
        first.setdefault(index, rank)
        if table[rank, 0] != table[first[index], 0]:
            raise RankMismatchError(
                f"ranks {first[index]} and {rank} are in one tensor-parallel group (data-parallel "
                f"index {int(index)}) but counted {int(table[first[index], 0])} and "
                f"{int(table[rank, 0])} items: every rank of a tensor-parallel group must see the "
                "same batch (shard the data over the data-parallel mesh dimension only, e.g. "
                'DistributedSampler(num_replicas=mesh["dp"].size(), rank=mesh["dp"]'
                ".get_local_rank())). The window was discarded on every rank, and nothing was "
                "stepped."
            )
    if len(first) == len(indices):
        return table
    return table[sorted(first.values())]


def dtensor_ranks(model: torch.nn.Module) -> int:
    """The most ranks any DTensor parameter of `model` spans (0: no DTensor parameter)."""
    dtensor = _compat.dtensor_type()
    meshes = (p.device_mesh for p in model.parameters() if isinstance(p, dtensor))
    return max((mesh.size() for mesh in meshes), default=0)


def composable_replicate_error(model: torch.nn.Module) -> ValueError | None:
    """The error for `torch.distributed._composable.replicate` (DDP-based), else None.

    It reduces (and averages) every backward inside hooks the library cannot defer or undo, so
    each micro-batch's mean over ranks would be summed: off on ragged counts. The FSDP-based
    `replicate` and `DistributedDataParallel` are driven exactly.
    """
    for module in model.modules():
        kinds = type(module).__mro__
        if any(k.__module__ == "torch.distributed._composable.replicate" for k in kinds):
            return ValueError(
                "the model (or a submodule) was given to torch.distributed._composable."
                "replicate, which reduces and averages every backward in hooks the Accumulator "
                "cannot defer, so micro-batches of uneven counts would be averaged wrongly. "
                "Wrap it with DistributedDataParallel(model) (device_mesh= is fine) or "
                "torch.distributed.fsdp.fully_shard (for tensor parallel, fully_shard(model, "
                'mesh=mesh["dp"])), and pass that to the Accumulator. Nothing was changed.'
            )
    return None


_GRAPH_NODES_READ = 64  # the loss's head: a cross-entropy sits within a few nodes of the root
_NO_CONTEXT = contextlib.nullcontext()  # reusable: none built per backward


def loss_parallel_context(roots: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
    """Torch's `loss_parallel()` context when a root's cross-entropy ran inside it, else a no-op.

    Inside `loss_parallel()` DTensor computes `log_softmax` and `nll_loss` on logits sharded on
    the class dimension (which it never does otherwise), and their backward only runs inside
    the context too: run after `loss_fn` left it, the backward raised "aten.nll_loss_backward
    got mixed torch.Tensor and DTensor". Read from the saved input of the graph's `nll_loss`
    (sharded on its class dimension); nothing is entered when the context is already active
    (a step run inside `loss_parallel()`: leaving a nested one would end the outer one).
    """
    if all(type(root) is torch.Tensor for root in roots):
        return _NO_CONTEXT  # the common case, without importing DTensor
    dtensor = _compat.dtensor_type()
    if not any(isinstance(root, dtensor) and _class_sharded_nll(root, dtensor) for root in roots):
        return _NO_CONTEXT
    dispatcher = getattr(dtensor, "_op_dispatcher", None)
    handlers = getattr(dispatcher, "_custom_op_handlers", {})
    if torch.ops.aten.nll_loss_backward.default in handlers:
        return _NO_CONTEXT  # already inside loss_parallel()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _class_sharded_nll(root: torch.Tensor, dtensor: type[Any]) -> bool:
    """Whether the graph's head holds an `nll_loss` of class-sharded DTensor log-probabilities.

    Only `loss_parallel()` computes one: DTensor's own rules replicate the class dimension.
    """
    queue, seen = [root.grad_fn], 0
    while queue and seen < _GRAPH_NODES_READ:
        node = queue.pop(0)
        if node is None:
            continue
        seen += 1
        if type(node).__name__.startswith("NllLoss"):
            saved = getattr(node, "_saved_self", None)
            if isinstance(saved, dtensor):
                channel = 1 if saved.dim() >= 2 else 0
                return any(p.is_shard(channel) for p in saved.placements)
        queue.extend(next_node for next_node, _ in node.next_functions)
    return False


def sharded_view(grad: torch.Tensor, layout: Any) -> torch.Tensor:
    """`grad` as the DTensor shard it is, sharing its storage: DDP over a tensor-parallel model.

    `DistributedDataParallel(model, device_mesh=...)` on a `parallelize_module` model replaces
    each DTensor parameter by its local shard, keeping the layout as `param._st_info`, so the
    gradients are plain tensors: their norm was each rank's own (the ranks of a tensor-parallel
    group clipped by different norms, 0.25 off, and `StepResult.grad_norm` was the shard's).
    As DTensors, the norm is global and division and clipping still write to `grad`.
    """
    dtensor = _compat.dtensor_type()
    return dtensor.from_local(
        grad,
        layout.mesh,
        layout.placements,
        run_check=False,
        shape=layout.shape,
        stride=layout.stride,
    )
