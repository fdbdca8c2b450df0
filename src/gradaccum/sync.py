"""Gradient synchronization across ranks: one strategy per backend, chosen from the model.

A `GradSync` answers the four questions the window asks of a backend:

- how to run a micro-batch without reducing gradients (`micro_context`);
- whether, and how, the window's last backward reduces them (`syncs_last_backward`);
- how ranks agree on the window: counts, loss, micro-batches, which params hold a gradient and
  whether any rank failed (`exchange`, one small collective per window);
- how to reduce what the backend did not (`reduce`), and what the backend's own reduction
  divided by (`averaged_over`).

`LocalSync` is the identity on one process. `DDPSync` runs every micro-batch under `no_sync()`
and reduces the window's gradients by hand in one flat all-reduce per dtype at the boundary: the
ranks take the same collective path whatever their micro-batches held (a rank whose last
micro-batch counts no item and has no graph cannot leave the others waiting), and a parameter no
rank used keeps `grad=None`. `FSDP2Sync` defers FSDP2's reduce-scatter to the window's last
backward; when that backward cannot run on every rank, a zero-item synchronized backward settles
the deferred sums instead.

Example:
    >>> import torch
    >>> sync = grad_sync_for(torch.nn.Linear(2, 1))
    >>> type(sync).__name__, sync.world, sync.averaged_over
    ('LocalSync', 1, 1)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from gradaccum._agreement import (
    FAILED,
    OUT_OF_MEMORY,
    RankMismatchError,
    RankSummary,
    WindowAgreement,
)
from gradaccum._allreduce import all_reduce_sum
from gradaccum.loss import MAX_TERMS

__all__ = [
    "FAILED",
    "OUT_OF_MEMORY",
    "DDPSync",
    "FSDP2Sync",
    "GradSync",
    "LocalSync",
    "RankMismatchError",
    "RankSummary",
    "WindowAgreement",
    "all_ranks_min",
    "any_rank",
    "grad_sync_for",
    "is_fsdp",
    "sync_context",
    "world_size",
]


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
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        group: dist.ProcessGroup = model.process_group
        return group
    if is_fsdp(model):
        return _fsdp_group(model)
    return None


def _fsdp_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The group of an FSDP2 model's mesh, read from any sharded (DTensor) parameter.

    Which parameter does not matter, and some are plain tensors at times: with `fully_shard` on
    each block and then on the root, the root's own parameters are unsharded between its forward
    and its backward. A 2-D (HSDP) mesh reduces over all of its ranks.
    """
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            if mesh.ndim == 1:
                return mesh.get_group()
            world: dist.ProcessGroup | None = dist.group.WORLD
            return world
    return None


def world_size(model: torch.nn.Module) -> int:
    """Number of ranks the model's gradients are reduced over (1 when not distributed)."""
    group = _group(model)
    return 1 if group is None else dist.get_world_size(group)


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return accelerator if accelerator is not None else torch.device("cpu")


class GradSync:
    """The single-process strategy, and the interface every backend implements."""

    world = 1
    averaged_over = 1  # what the backend's own reduction divides the summed gradient by
    syncs_last_backward = False  # whether the last backward itself reduces gradients

    def micro_context(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        """The context a micro-batch's forward and backward run in."""
        return contextlib.nullcontext()

    def backward_context(self, *, reduce: bool) -> contextlib.AbstractContextManager[None]:
        """The context of a backward that reduces (`reduce`) or only accumulates gradients."""
        return contextlib.nullcontext()

    def exchange(self, mine: RankSummary) -> WindowAgreement:
        """Agree on the window over ranks (one small collective when distributed)."""
        return WindowAgreement(
            mine.count,
            mine.loss_sum,
            mine.denominator,
            (0,) if mine.failed else (),
            mine.failed == OUT_OF_MEMORY,
            mine.has_grad,
            mine.graph,
            mine.terms,
        )

    def reduce(self, grads: Sequence[torch.Tensor]) -> None:
        """Sum `grads` over ranks in place (each rank passes the same shapes, same order)."""

    def agree_on_plan(self, micro_batches: int, first_items: int) -> None:
        """Check, before any forward, that ranks plan alike (only FSDP2 needs it)."""

    def begin_window(self) -> None:
        """A window opens."""

    def end_window(self) -> None:
        """A window ended: stepped, skipped or forgotten."""

    def forget_window(self) -> None:
        """A window is forgotten: undo what the backend holds for it."""

    def check_resume(self, open_window: bool) -> None:
        """Raise ValueError if a saved window cannot continue on this backend."""


class LocalSync(GradSync):
    """One process: nothing to defer, exchange or reduce."""


_FLAGS = 6 + 2 * MAX_TERMS  # the exchange row: head, the terms' (count, sum) pairs, flags


class _DistributedSync(GradSync):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.group = _group(model)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    def exchange(self, mine: RankSummary) -> WindowAgreement:
        """One all-gather of every rank's summary; raise on windows that cannot be reconciled.

        Raises:
            RankMismatchError: If ranks scaled their gradients differently or ran different
                numbers of micro-batches; the message lists every rank's figures.
        """
        head = [
            mine.count,
            mine.loss_sum,
            mine.micro_batches,
            mine.denominator,
            mine.failed,
            mine.graph,
        ]
        terms = list(mine.terms) or [0.0] * (2 * MAX_TERMS)  # fixed width: rows must match
        row = torch.tensor(
            head + terms + [float(flag) for flag in mine.has_grad],
            dtype=torch.float64,
            device=_device(self.group),
        )
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row, group=self.group)
        table = torch.stack(rows).cpu()
        failures = table[:, 4]
        failed = tuple(int(r) for r in torch.nonzero(failures).flatten().tolist())
        if not failed:
            self._check_alike(table)
        return WindowAgreement(
            denominator=float(table[:, 3].max().item()),
            count=int(table[:, 0].sum().item()),
            loss_sum=float(table[:, 1].sum().item()),
            failed_ranks=failed,
            all_out_of_memory=bool(failed) and all(failures[list(failed)] == OUT_OF_MEMORY),
            has_grad=tuple(bool(flag) for flag in table[:, _FLAGS:].amax(dim=0).tolist()),
            all_graphs=bool(table[:, 5].all()),
            terms=tuple(table[:, 6:_FLAGS].sum(dim=0).tolist()) if mine.terms else (),
        )

    def uneven_windows(self) -> bool:
        """Whether ranks may run different numbers of micro-batches in one window."""
        return False

    def _compare_plans(self, micro_batches: int, first_items: int) -> None:
        """Before a window's first forward, check every rank plans the same micro-batches.

        Every FSDP2 forward is itself a collective, so a rank with one micro-batch more would
        break the collectives before the window's own exchange could run. `step()` knows its
        plan up front and compares it here: one more tiny all-gather per window, on FSDP2 only.

        Raises:
            RankMismatchError: If ranks plan different numbers or sizes of micro-batches.
        """
        mine = torch.tensor(
            [micro_batches, first_items], dtype=torch.float64, device=_device(self.group)
        )
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.group)
        plans = [tuple(int(v) for v in row.tolist()) for row in rows]
        if len(set(plans)) > 1:
            listing = "; ".join(
                f"rank {rank}: {plan[0]} micro-batches, the first of {plan[1]} items"
                for rank, plan in enumerate(plans)
            )
            raise RankMismatchError(
                f"ranks planned different accumulation windows ({listing}); give every rank the "
                "same batch size, e.g. DistributedSampler(drop_last=True)."
            )

    def _check_alike(self, table: torch.Tensor) -> None:
        """Raise unless ranks ran alike, or may run unevenly with power-of-two denominators."""
        counts, denominators = set(table[:, 2].tolist()), set(table[:, 3].tolist())
        if self.uneven_windows():
            if all(math.frexp(d)[0] == 0.5 for d in denominators):
                return
        elif len(counts) == 1 and len(denominators) == 1:
            return
        listing = "; ".join(
            f"rank {rank}: {int(row[2])} micro-batches, gradient denominator {row[3].item():g}"
            for rank, row in enumerate(table)
        )
        raise RankMismatchError(
            f"ranks ran different accumulation windows ({listing}); on this backend every rank "
            "must run the same number of micro-batches per window, with first micro-batches of "
            "the same size. Give each rank the same batch size, or drop the uneven remainder "
            "(e.g. DistributedSampler(drop_last=True))."
        )


class DDPSync(_DistributedSync):
    """DDP: every backward under `no_sync()`, then one flat all-reduce (SUM) per window.

    `DistributedDataParallel(static_graph=True)` must see its first iteration synchronize, so
    the very first window lets DDP reduce (and average) every micro-batch's backward itself; the
    library then neither reduces it again nor undoes less than DDP's mean. Every later window
    is reduced by hand.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._native = bool(getattr(model, "static_graph", False))  # the first window, if so

    def uneven_windows(self) -> bool:
        """Uneven micro-batch counts, except in a static graph's first (DDP-reduced) window."""
        return not self._native

    def agree_on_plan(self, micro_batches: int, first_items: int) -> None:
        """A static graph's first window reduces in every backward: ranks must plan alike."""
        if self._native:
            self._compare_plans(micro_batches, first_items)

    def begin_window(self) -> None:
        """A window opens: DDP averages it only if it is a static graph's first."""
        self.averaged_over = self.world if self._native else 1

    def end_window(self) -> None:
        """A window ended (stepped, skipped or forgotten): DDP has seen its first iteration."""
        if self._native and self.averaged_over > 1:
            self._native = False

    def check_resume(self, open_window: bool) -> None:
        """Refuse to continue a saved open window before a static graph's first (native) one."""
        if self._native and open_window:
            raise ValueError(
                "a DistributedDataParallel(static_graph=True) model must synchronize its first "
                "window, which cannot continue a saved open window; save checkpoints at window "
                "boundaries (e.g. --checkpoint-every Nstep), or wrap with static_graph=False."
            )

    def micro_context(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        """Every micro-batch, the last included, leaves DDP's reducer out (but see above)."""
        assert isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        if self._native:
            return contextlib.nullcontext()
        no_sync: contextlib.AbstractContextManager[None] = self.model.no_sync()
        return no_sync

    def reduce(self, grads: Sequence[torch.Tensor]) -> None:
        """Sum `grads` over ranks in place: async, in bounded flat buckets (`_allreduce`)."""
        if not self._native:
            all_reduce_sum(grads, self.group)


class FSDP2Sync(_DistributedSync):
    """FSDP2: reduce-scatter deferred to the window's last backward; its mean over ranks undone."""

    syncs_last_backward = True

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.averaged_over = self.world
        from torch.distributed.fsdp import FSDPModule

        self._sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def forget_window(self) -> None:
        """A forward whose backward never ran leaves parameters unsharded: shard them again."""
        for module in self._sharded:
            module.reshard()

    def micro_context(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        """Forward and backward with the reduce-scatter off; the last backward may turn it on."""
        return self._gradient_sync(False)

    def backward_context(self, *, reduce: bool) -> contextlib.AbstractContextManager[None]:
        """FSDP2 reads the flag in its post-backward hooks, so it can change after a forward."""
        return self._gradient_sync(True) if reduce else contextlib.nullcontext()

    @contextlib.contextmanager
    def _gradient_sync(self, on: bool) -> Iterator[None]:
        self.model.set_requires_gradient_sync(on)  # type: ignore[operator]
        try:
            yield
        finally:
            # Outside a window the model is as `fully_shard` left it: reducing gradients.
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def agree_on_plan(self, micro_batches: int, first_items: int) -> None:
        """Every FSDP2 forward is itself a collective: ranks must plan alike (see below)."""
        self._compare_plans(micro_batches, first_items)


def grad_sync_for(model: torch.nn.Module) -> GradSync:
    """The strategy for `model`: FSDP2, DDP, or local (also for a wrapper on one rank)."""
    group = _group(model)
    if group is None or dist.get_world_size(group) == 1:
        return LocalSync()
    if is_fsdp(model):
        return FSDP2Sync(model)
    return DDPSync(model)


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


def all_ranks_min(model: torch.nn.Module, value: int) -> int:
    """The smallest of every rank's `value` (itself on one process), so all ranks agree on it."""
    return _reduce_int(model, value, dist.ReduceOp.MIN)


def _reduce_int(model: torch.nn.Module, value: int, op: dist.ReduceOp.RedOpType) -> int:
    group = _group(model)
    if group is None or dist.get_world_size(group) == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_device(group))
    dist.all_reduce(tensor, op=op, group=group)
    return int(tensor.item())
