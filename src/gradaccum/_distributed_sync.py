"""The distributed gradient-sync strategies: DDP and FSDP2 (see `gradaccum.sync`).

Example:
    >>> from gradaccum._distributed_sync import DDPSync, FSDP2Sync
    >>> DDPSync.rescales, FSDP2Sync.rescales  # DDP rescales uneven denominators; FSDP2 agrees first
    (True, False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from gradaccum import _compat
from gradaccum._agreement import (
    OUT_OF_MEMORY,
    RankMismatchError,
    RankSummary,
    WindowAgreement,
    check_flushing_alike,
    check_terms_alike,
    check_windows_alike,
)
from gradaccum._allreduce import all_reduce_sum, broadcast_from_first
from gradaccum._sync_base import (
    FAILED_COUNT,
    GradSync,
    Plan,
    check_comm_hook,
    device_for,
    process_group,
)
from gradaccum._tensor_parallel import data_parallel, one_row_per_batch
from gradaccum.loss import MAX_TERMS
from gradaccum.options import SyncPolicy

__all__ = ["DDPSync", "FSDP2Sync"]

_NO_CONTEXT = contextlib.nullcontext()  # stateless: one instance serves every `with`

_HEAD = 9  # the exchange row: head, the terms' (count, sum) pairs, flags
_FLAGS = _HEAD + 2 * MAX_TERMS


class _DistributedSync(GradSync):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.group = process_group(model)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.batch_index = self.rank  # ranks of one index see one batch (tensor parallel)

    def exchange(self, mine: RankSummary) -> WindowAgreement:
        """One all-gather of every rank's summary; raise on windows that cannot be reconciled.

        Raises:
            RankMismatchError: If ranks scaled their gradients differently or ran different
                numbers of micro-batches; the message lists every rank's figures.
        """
        if self.flushing and self.tokens and self.joins_flush:  # DDP: others may be inside
            self.sum_over_ranks(0, flushing=True)  # a Tokens micro-batch's count sum: meet it
        head = [
            mine.count,
            mine.loss_sum,
            mine.micro_batches,
            mine.denominator,
            mine.failed,
            mine.graph,
            self.flushing,
            mine.signature,  # the terms' names: their pairs are summed by position
            self.batch_index,
        ]
        terms = list(mine.terms) or [0.0] * (2 * MAX_TERMS)  # fixed width: rows must match
        row = torch.tensor(
            head + terms + [float(flag) for flag in mine.has_grad],
            dtype=torch.float64,
            device=device_for(self.group),
        )
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row, group=self.group)
        table = torch.stack(rows).cpu()
        failures = table[:, 4]
        failed = tuple(int(r) for r in torch.nonzero(failures).flatten().tolist())
        if not failed:
            check_windows_alike(table, uneven=self.uneven_windows(), rescales=self.rescales)
            check_flushing_alike(table[:, 6])
            check_terms_alike(table[:, 2].tolist(), table[:, 7].tolist(), mine.term_names)
        data = one_row_per_batch(table, _HEAD - 1) if self.replicas > 1 and not failed else table
        return WindowAgreement(
            denominator=float(table[:, 3].max().item()),
            count=int(data[:, 0].sum().item()),
            loss_sum=float(data[:, 1].sum().item()),
            failed_ranks=failed,
            all_out_of_memory=bool(failed) and all(failures[list(failed)] == OUT_OF_MEMORY),
            has_grad=tuple(bool(flag) for flag in table[:, _FLAGS:].amax(dim=0).tolist()),
            all_graphs=bool(table[:, 5].all()),
            terms=tuple(data[:, _HEAD:_FLAGS].sum(dim=0).tolist()) if mine.terms else (),
        )

    rescales = False  # whether power-of-two denominators are rescaled to one before reducing

    def uneven_windows(self) -> bool:
        """Whether ranks may run different numbers of micro-batches in one window."""
        return False

    def sum_over_ranks(self, value: int, *, flushing: bool = False) -> int:
        """`value` summed over ranks: one all-reduce of (value, failed, flushing).

        Args:
            value: This rank's number, or `FAILED_COUNT` (its micro-batch raised).
            flushing: This rank is in `flush()` (a `Tokens` stream ended), not in a micro-batch.

        Raises:
            RankMismatchError: If a rank sent `FAILED_COUNT`, or some ranks but not all flush.
        """
        mine = [value, int(value == FAILED_COUNT), int(flushing)]
        tensor = torch.tensor(mine, dtype=torch.int64, device=device_for(self.group))
        dist.all_reduce(tensor, group=self.group)
        total, failed, flushers = (int(v) for v in tensor.tolist())
        if failed and value != FAILED_COUNT:
            raise RankMismatchError(
                "another rank raised inside this accumulation window (see its own traceback); "
                "the window was discarded on every rank, and nothing was stepped."
            )
        if 0 < flushers < self.world:
            raise RankMismatchError(
                f"{flushers} of {self.world} ranks called flush() (their data ended) while the "
                "others ran another micro_step() in a Tokens window: the ranks hold different "
                "numbers of micro-batches. The window was discarded on every rank. Give every "
                "rank the same number of micro_step() calls per epoch (DistributedSampler pads "
                "its shards unless drop_last=True)."
            )
        return total

    def _gather_plans(self, micro_batches: int, first_items: int) -> list[tuple[int, int]]:
        """Every rank's planned micro-batches and first micro-batch size: one tiny all-gather."""
        mine = torch.tensor(
            [micro_batches, first_items], dtype=torch.float64, device=device_for(self.group)
        )
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.group)
        return [(int(row[0].item()), int(row[1].item())) for row in rows]


_STATIC_FIX = (
    "the first window of a DistributedDataParallel(static_graph=True) model cannot run (DDP "
    "itself reduces every backward in it); give every rank the same batch size for the first "
    "window, or wrap with static_graph=False."
)
_SYNC_BN_FIX = (
    "a model with SyncBatchNorm layers cannot run: their forward and backward are collectives, "
    "so every rank must run as many micro-batches. Give every rank the same batch size (e.g. "
    "DistributedSampler(drop_last=True)), or use batchnorm='frozen' (running statistics, no "
    "collective), plain BatchNorm or gradaccum.batchnorm.convert_to_groupnorm."
)


class DDPSync(_DistributedSync):
    """DDP: every backward under `no_sync()`, then one flat all-reduce (SUM) per window.

    No forward broadcasts buffers (DDP would in a forward that may sync, a collective that a
    rank running fewer micro-batches would miss); every step, taken by all ranks alike,
    broadcasts rank 0's buffers instead, so BatchNorm statistics never drift apart.

    `DistributedDataParallel(static_graph=True)` must see its first iteration synchronize, so
    the very first window lets DDP reduce (and average) every micro-batch's backward itself; the
    library then neither reduces it again nor undoes less than DDP's mean. Every later window
    is reduced by hand.
    """

    rescales = True
    joins_flush = True  # a rank whose data ended on a window boundary still joins flush()

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._native = bool(getattr(model, "static_graph", False))  # the first window, if so
        self._hook_warned = False
        # DDP(broadcast_buffers=True) broadcasts rank 0's buffers in a forward that may sync:
        # a collective that a rank with fewer (or no) micro-batches would miss. The library
        # broadcasts them itself, once per window, when every rank is at the boundary.
        self._ignored = frozenset(getattr(model, "parameters_to_ignore", ()))  # DDP syncs none
        self._inner: torch.nn.Module = getattr(model, "module", model)
        named = self._inner.named_parameters() if self._ignored else ()
        self._local = frozenset(id(p) for name, p in named if name in self._ignored)
        # SyncBatchNorm's train-mode forward and backward are collectives (GPU only: DDP refuses
        # it on CPU): ranks running different numbers of micro-batches would wait for each other.
        self._sync_bns = [m for m in model.modules() if isinstance(m, torch.nn.SyncBatchNorm)]

    def uneven_windows(self) -> bool:
        """Uneven micro-batch counts, except in a static graph's first (DDP-reduced) window."""
        return not self._native

    def agree_on_plan(self, micro_batches: int, first_items: int) -> Plan:
        """A static graph's first window reduces in every backward: ranks must plan alike.

        Raises:
            RankMismatchError: If they do not (every rank raises it, before any forward).
        """
        sync_bn = not self.frozen_batchnorm and any(m.training for m in self._sync_bns)
        if self._native or sync_bn:
            plans = self._gather_plans(micro_batches, first_items)
            if len(set(plan[0] for plan in plans)) > 1 or (self._native and len(set(plans)) > 1):
                listing = "; ".join(
                    f"rank {rank}: {plan[0]} micro-batches, the first of {plan[1]} items"
                    for rank, plan in enumerate(plans)
                )
                raise RankMismatchError(
                    f"ranks planned different accumulation windows ({listing}), which "
                    + (_SYNC_BN_FIX if sync_bn and not self._native else _STATIC_FIX)
                )
        return Plan(micro_batches, None)

    def begin_window(self) -> None:
        """A window opens: DDP averages it only if it is a static graph's first.

        Raises:
            ValueError: Under `DistributedDataParallel.join()`; or in a static graph's first
                window (reduced by DDP) inside `no_sync()` or with a communication hook (every
                rank, before any forward).
        """
        join = getattr(self.model, "_join_config", None)  # set by DistributedDataParallel.join()
        if join is not None and join.enable:
            raise ValueError(
                "DistributedDataParallel.join() cannot run gradaccum windows: it shadows DDP's "
                "own collectives, not the Accumulator's exchange and reduction once per window, "
                "so a rank out of inputs would leave the others waiting (and DDP keeps join "
                "enabled on this model after the context). Wrap the model without join(): give "
                "every rank the same number of micro_step() calls per epoch "
                "(DistributedSampler(drop_last=False) pads the shards), or use step(), whose "
                "ranks may hold different numbers of items, an empty batch included."
            )
        if self._native and not self.model.require_backward_grad_sync:
            raise ValueError(  # DDP would not reduce it, and the library leaves it to DDP
                "a DistributedDataParallel(static_graph=True) model's first window must let DDP "
                "reduce its gradients, but it runs inside model.no_sync(). Call step() and "
                "micro_step() outside no_sync(): the Accumulator itself keeps DDP from reducing "
                "before the window's end. Nothing was changed."
            )
        self._hook_warned |= check_comm_hook(self.model, self._native, self._hook_warned)
        self.averaged_over = self.world if self._native else 1

    def end_window(self) -> None:
        """A window ended (stepped, skipped or forgotten): DDP has seen its first iteration."""
        self.flushing = False
        if self._native and self.averaged_over > 1:
            self._native = False

    def check_resume(self, open_window: bool, origin: Sequence[int] | None = None) -> None:
        """Refuse another rank's open window, or one before a static graph's first window."""
        super().check_resume(open_window, origin)
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
            return _NO_CONTEXT
        self.model.require_forward_param_sync = False  # no buffer broadcast in the forward
        no_sync: contextlib.AbstractContextManager[None] = self.model.no_sync()
        return no_sync

    def sync_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm statistics) to every rank, as DDP's forward would.

        Read afresh every time, as DDP does: a forward may reassign a buffer (a running
        normalizer's `self.mean = self.mean + ...`), and a list kept from construction would
        broadcast into tensors the module no longer holds (the ranks' buffers drifted apart).
        """
        if not getattr(self.model, "broadcast_buffers", True):
            return
        named = self._inner.named_buffers()
        buffers = [b for name, b in named if name not in self._ignored]
        if buffers:
            broadcast_from_first(buffers, self.group)

    def keeps_local(self, param: torch.nn.Parameter) -> bool:
        """DDP's ignored parameters are rank-local: never reduced, as DDP never reduces them."""
        return id(param) in self._local

    def reduce(self, grads: Sequence[torch.Tensor]) -> None:
        """Sum `grads` over ranks in place: async, in bounded flat buckets (`_allreduce`)."""
        if not self._native:
            all_reduce_sum(grads, self.group)


class FSDP2Sync(_DistributedSync):
    """FSDP2: one reduce-scatter per window, or per micro-batch; its mean over ranks undone.

    `SyncPolicy.WINDOW` defers the reduce-scatter to the window's last backward, so each rank
    holds unsharded gradient sums for the window; `SyncPolicy.MICRO` lets every backward
    reduce-scatter, so each rank holds only its gradient shard, at N times the communication.
    """

    def __init__(self, model: torch.nn.Module, policy: SyncPolicy = SyncPolicy.WINDOW) -> None:
        super().__init__(model)
        self.policy = policy
        self.defers = self.syncs_last_backward = policy is SyncPolicy.WINDOW
        # FSDP2 averages over its data-parallel ranks; a tensor-parallel group shares a batch
        dp = data_parallel(model) or (self.world, self.rank)
        self.averaged_over, self.batch_index = dp
        self.replicas = self.world // self.averaged_over
        fsdp_module = _compat.fsdp_module_type()
        self._sharded = [m for m in model.modules() if fsdp_module and isinstance(m, fsdp_module)]

    def forget_window(self) -> None:
        """A forward whose backward never ran leaves parameters unsharded: shard them again."""
        for module in self._sharded:
            module.reshard()

    def micro_context(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        """Window policy: the reduce-scatter off (the last backward may turn it on)."""
        return self._gradient_sync(False) if self.defers else _NO_CONTEXT

    def backward_context(self, *, reduce: bool) -> contextlib.AbstractContextManager[None]:
        """FSDP2 reads the flag in its post-backward hooks, so it can change after a forward."""
        return self._gradient_sync(True) if reduce and self.defers else _NO_CONTEXT

    @contextlib.contextmanager
    def _gradient_sync(self, on: bool) -> Iterator[None]:
        self.model.set_requires_gradient_sync(on)  # type: ignore[operator]
        try:
            yield
        finally:
            # Outside a window the model is as `fully_shard` left it: reducing gradients.
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def average_unsharded(
        self,
        entries: Sequence[tuple[int, torch.nn.Parameter, torch.Tensor | None]],
        zeros: Callable[[int, torch.nn.Parameter], torch.Tensor],
    ) -> list[torch.Tensor]:
        """The optimizer's parameters FSDP2 does not shard, averaged over ranks as it averages.

        A learnable loss weight outside the model, or a module left out of `fully_shard`: FSDP2
        never reduces their gradients, so before this every rank stepped them on its own items
        and the replicas drifted apart. One all-reduce (MAX) of which of them hold a gradient,
        so one that some rank used gets zeros elsewhere and one no rank used keeps `None`; then
        their sum over ranks, divided by the ranks, as FSDP2 divides (the step undoes it).
        """
        device = device_for(self.group)
        held = torch.tensor([float(g is not None) for *_, g in entries], device=device)
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=self.group)
        grads = []
        for (index, param, grad), used in zip(entries, held.tolist(), strict=True):
            grad = zeros(index, param) if grad is None and used else grad
            if grad is not None:
                grads.append(grad)
        if grads:
            all_reduce_sum(grads, self.group)
            torch._foreach_div_(grads, float(self.world))  # TP replicas: summed once each
        return grads

    def uneven_windows(self) -> bool:
        """Ranks plan different micro-batch counts, padded to the largest (`agree_on_plan`)."""
        return True

    def common_denominator(self, denominator: float) -> float:
        """The largest rank's: FSDP2 sums what every backward scaled, so all scale alike.

        A streamed window's first micro-batch may differ in size across ranks; one all-reduce
        of one number per window makes the scales agree (`step()` agrees in its plan instead).
        """
        value = torch.tensor([denominator], dtype=torch.float64, device=device_for(self.group))
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return float(value.item())

    def agree_on_plan(self, micro_batches: int, first_items: int) -> Plan:
        """Every FSDP2 forward and backward is a collective: every rank runs the most any plans.

        A rank with fewer micro-batches runs zero-item ones after its own; and since the
        reduce-scatter sums what each rank's backward scaled, all ranks take one denominator,
        from the largest expected window.
        """
        plans = self._gather_plans(micro_batches, first_items)
        return Plan(max(plan[0] for plan in plans), max(plan[0] * plan[1] for plan in plans))
