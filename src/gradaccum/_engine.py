"""The step algorithm: micro-batches in, one transactional window boundary out.

One micro-batch: forward under autocast, read `(sum, count)`, backward `sum * loss_scale /
denominator` (`gradaccum.divisor`), move low-precision gradients to their buffers. The boundary:
scheduler tried ─► exchange ─► reduce ─► divide once ─► finite? ─► clip ─► optimizer.step() ══
commit ══► loss scale, pooled BatchNorm, close (`gradaccum._commit`). An exception before the
commit, a skipped or dropped window end in `_forget_window()`: grads as before the window, fp32
buffers dropped, BatchNorm and forward-updated buffers back (the RNG: auto sizing's rerun).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from gradaccum import _boundary, _commit
from gradaccum._agreement import RankMismatchError
from gradaccum._boundary import held_gradients, nonfinite_names, rank_summary, reduced_gradients
from gradaccum._buffer_watch import BufferWatch
from gradaccum._commit import SchedulerSteps, refuse_steps_inside, steps_refused, try_scheduler
from gradaccum._commit_agreement import join_as_failed, step_on_every_rank
from gradaccum._empty_micro import count_nothing, rank_items
from gradaccum._engine_state import component_states, restore_components
from gradaccum._layout_watch import SequenceFirstCheck
from gradaccum._loss_call import call_loss_fn, refuse_grad_disabled
from gradaccum._oom import after_step_guard
from gradaccum._outputs import backward, captured_outputs, zero_backward, zero_item_roots
from gradaccum._parameters import ModelParameters
from gradaccum._sync_base import NO_CONTEXT
from gradaccum._terms import TermLedger
from gradaccum.batching import batch_size, on_device, slice_batch, to_device
from gradaccum.batchnorm import BatchNormControl
from gradaccum.divisor import Expectation, Seeds, backward_denominator, divide_, grad_divisor
from gradaccum.loss import LossTerms, TokenMeanCheck, counted_ahead, read_loss, read_terms
from gradaccum.norms import clip_, total_norm
from gradaccum.options import Normalize
from gradaccum.precision import PrecisionRuntime
from gradaccum.result import PartialStepError, learning_rate
from gradaccum.sync import FSDP2Sync, GradSync, RankSummary, WindowAgreement
from gradaccum.telemetry import TelemetryMeter
from gradaccum.window import LossFn, Outcome, Window

__all__ = ["Engine", "Outcome"]


class Engine:
    """Runs micro-batches and window boundaries over the components it is given."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        normalize: Normalize,
        runtime: PrecisionRuntime,
        sync: GradSync,
        batchnorm: BatchNormControl,
        batch_dim: int = 0,
    ) -> None:
        self.model, self.optimizer, self.normalize = model, optimizer, normalize
        self.runtime, self.sync, self.batchnorm = runtime, sync, batchnorm
        self.window, self.batch_dim = Window(optimizer, model), batch_dim
        refuse_steps_inside(optimizer, self.window)  # a user's optimizer.step() mid-window
        self._fsdp = isinstance(sync, FSDP2Sync)  # reduces on its last backward, settles else
        self._params = ModelParameters(model)  # read once: walking the modules costs a window
        self._names = self._params.names  # the same dict, refreshed in place after a resize
        self._agreement: WindowAgreement | None = None  # FSDP2 agrees before the last backward
        self._exchanged = self._next_sum = self._reduced = False  # others sum next: Tokens
        self._last_input: tuple[Any, LossFn] | None = None  # for FSDP2's zero-item settle
        self.token_mean, self._seeds = TokenMeanCheck(model=model), Seeds()
        self._layout = SequenceFirstCheck(model, batch_dim)  # a batch split along time
        self.telemetry: TelemetryMeter | None = None  # opt-in (gradaccum.telemetry)
        self.broken: str | None = None  # set by a half-done optimizer.step(); a load clears it
        self.schedule = SchedulerSteps()  # the scheduler's real steps, after each commit
        self.buffers = BufferWatch(model, [m for _, m in batchnorm.modules], active=sync.world == 1)

    # ---------------------------------------------------------------- micro-batches

    def run_window(
        self,
        micro_batches: Sequence[Any],
        loss_fn: LossFn,
        *,
        window_items: int,
        size: int | Sequence[int],
        template: Any = None,
    ) -> None:
        """Run a window given whole (`step()`): micro-batches of `size` items, or of `sizes`.

        A rank without micro-batches slices FSDP2's zero-item ones from `template` (its batch).
        """
        count = len(micro_batches)
        refuse_grad_disabled("step()", micro_batches=count)  # before anything runs or changes
        if isinstance(size, int):
            size = [min(size, window_items - i * size) for i in range(count)]
        sizes = list(size)
        plan = self.sync.agree_on_plan(count, sizes[0] if sizes else 0)
        counted = counted_ahead(loss_fn, micro_batches) if self.sync.world == 1 else None
        expect = Expectation(count, window_items, counted)
        move = bool(count) and not on_device(micro_batches[0], self.runtime.device)  # one look
        self._open()
        if plan.expected_items is not None or not count:  # one scale on all ranks (FSDP2)
            self.window.denominator = backward_denominator(
                self.normalize, expected_items=plan.expected_items or 1, window_items=None
            )
        try:
            for index in range(plan.micro_batches):
                last = index == plan.micro_batches - 1
                if index < count:  # slices of one batch are where it is: `move` holds for all
                    batch, items = micro_batches[index], sizes[index]
                    self._micro_batch(batch, loss_fn, last, expect, items, move)
                else:  # another rank runs more micro-batches: join its collectives (FSDP2)
                    self._zero_item_micro_batch(
                        micro_batches[0] if count else template, loss_fn, last=last
                    )
        except BaseException as error:
            self._fail(error)
            raise

    def run_micro_batch(
        self, micro_batch: Any, loss_fn: LossFn, *, last: bool, expect: Expectation
    ) -> bool:
        """One streamed micro-batch (`micro_step()`); True if last (`expect.until`: all ranks')."""
        refuse_grad_disabled("micro_step()")  # before the open window is checked or touched
        # One rank: a micro-batch refused for its shape changes nothing, its open window included
        items = None if self.sync.world > 1 else batch_size(micro_batch, batch_dim=self.batch_dim)
        if self.window.is_open:
            self.check_gradients_untouched(last)
        else:
            self._open()
        self._next_sum = expect.until is not None  # the others sum this one's count first
        try:
            last = self._micro_batch(micro_batch, loss_fn, last, expect, items)
        except BaseException as error:
            self._fail(error, rerun=False)  # DDP: the other ranks raise at their next collective
            raise
        if not last:  # the caller's code runs before the next micro-batch: watch the grads
            self.window.mark_gradients()
        return last

    def _open(self) -> None:
        if (broken := self.broken) is not None:  # never taken for the out-of-memory it quotes
            raise PartialStepError(f"no window was run: the last step failed halfway. {broken}")
        params, held = self._params.for_window(self.optimizer)  # refuses a stale resize
        self.batchnorm.open_window()  # may refuse a BatchNorm set since: before any change
        self.runtime.open_window(len(params), None if self.sync.defers else params)  # dtypes
        self.sync.begin_window()
        self._layout.open_window()  # an RNN state from the last window's micro-batches may go on
        self.token_mean.open_window(params)  # masked means compared within a window
        self.window.open(params, held, self.runtime.loss_scale())
        self.buffers.open()
        if self.telemetry is not None:
            self.telemetry.open_window()

    def _micro_batch(
        self,
        micro_batch: Any,
        loss_fn: LossFn,
        last: bool,
        expect: Expectation,
        items: int | None = None,
        move: bool = True,
    ) -> bool:
        window, runtime, sync = self.window, self.runtime, self.sync
        if not (items := items or rank_items(micro_batch, self.batch_dim, sync, fsdp=self._fsdp)):
            return count_nothing(window, sync, last, expect)  # DDP: this rank's loader ran dry
        if move:
            micro_batch = to_device(micro_batch, runtime.device)
        self.batchnorm.warn_once(items, expect.items or items * expect.micro_batches)
        outputs: list[torch.Tensor] = []
        capture = captured_outputs(self.model, outputs) if self._fsdp else NO_CONTEXT
        with sync.micro_context(last=last), self.batchnorm.micro_context(), steps_refused(window):
            with runtime.autocast(), capture, self._layout.watch(items, expect.items):
                result = call_loss_fn(loss_fn, self.model, micro_batch)
            window.check_no_backward_inside()  # no backward or zero_grad() inside loss_fn
            extra: list[tuple[int, torch.Tensor]] = []
            if isinstance(result, LossTerms):  # each term divided by its own count
                terms = read_terms(result)
                ledger = TermLedger.for_micro_batch(
                    window.terms, terms, self.normalize, expect, fsdp=self._fsdp, sync=sync
                )
                window.terms, window.denominator = ledger, 1.0
                value, logged, extra = ledger.roots(terms)
                weight, count = 1, items
            else:
                value, weight, count = read_loss(result, items, needs_graph=True)
                logged = value
            if self.token_mean.pending:  # -100 labels, a copied loop's line: warns (first few)
                self.token_mean.check(result, micro_batch, items, expect.planned, loss_fn)
            if expect.until is not None:
                last = sync.sum_of_counts(window.budget(count, expect.until_term)) >= expect.until
                self._next_sum = not last  # the other ranks' next collective: a sum or exchange
            if window.denominator is None:  # FSDP2 ranks agree on it (they reduce in the backward)
                dtype = value.dtype  # a bf16 loss takes no folded count: its seeds stay exact
                mine = expect.denominator(self.normalize, sync.world, weight, items, count, dtype)
                window.denominator = sync.common_denominator(mine)
            if count > 0 and not value.requires_grad and not extra:  # terms (read_loss: others)
                raise ValueError(
                    "the loss terms do not require grad; return them with their graph."
                )
            if window.terms is not None and extra:  # terms whose count the window learns last
                window.terms.backward_extra(extra, window.params, window.loss_scale, runtime)
            if value.requires_grad:
                scale = window.loss_scale
                root, seed = self._seeds.seeded_loss(value, weight, window.denominator, scale)
                roots, seeds = [root], None if seed is None else [seed]
            else:
                # FSDP2's backward is a collective (it unshards): one through the outputs, +0
                roots = outputs
                seeds = [torch.zeros_like(t) for t in outputs]
            reduce = last and sync.syncs_last_backward  # FSDP2's window policy only:
            if reduce:  # the loss is read (a device sync) only where ranks agree before it
                loss = float(value.detach()) * weight
                reduce = self._reduces_last(count, loss, micro_batches=1, graph=bool(roots))
            if roots:
                with sync.backward_context(reduce=reduce):
                    backward(roots, seeds)
                if runtime.uses_buffers:
                    runtime.collect(window.params)
        window.add(logged, weight, count, items)
        first = window.count == count and not window.terms and sync.averaged_over == 1
        if self.telemetry is not None and first:  # the first that counts (DDP: unreduced)
            scale = (window.denominator or 1.0) / (window.loss_scale * max(count, 1))
            self.telemetry.first_micro_batch(held_gradients(window, runtime), count, scale)
        self._reduced = reduce
        if self._fsdp:
            self._last_input = (micro_batch, loss_fn)
        return last

    def _zero_item_micro_batch(
        self, like: Any, loss_fn: LossFn, *, last: bool, reduce: bool = False
    ) -> None:
        """A micro-batch of no item: one more forward and backward's collectives (FSDP2)."""
        empty = slice_batch(like, 0, 0, batch_dim=self.batch_dim)
        with self.sync.micro_context(last=last):
            roots = zero_item_roots(self.model, empty, loss_fn, self.runtime.autocast)
            reduce = reduce or (last and self._reduces_last(0, 0.0, micro_batches=0, graph=True))
            with self.sync.backward_context(reduce=reduce):
                zero_backward(roots)
        self._reduced = reduce
        self._last_input = (empty, loss_fn)

    def _reduces_last(self, count: int, loss: float, *, micro_batches: int, graph: bool) -> bool:
        """Whether the last backward reduces (FSDP2): on all ranks, or none, then all settle."""
        if not self.sync.syncs_last_backward:
            return False
        pending = RankSummary(
            self.window.count + count,
            self.window.loss_total() + loss,
            self.window.micro_batches + micro_batches,
            self.window.denominator or 1.0,
            graph=graph,
        )
        self._agreement = self._exchange(pending)
        return self._agreement.all_graphs

    def check_gradients_untouched(self, final: bool = False) -> None:  # final: norms, too
        """Refuse a window whose gradients (or weights) someone changed between micro-batches."""
        touched = self.window.touched_gradients_error
        if (problem := self._params.resize_error() or touched(self._names, final)) is not None:
            self._forget_window()
            raise problem

    def close_window(self, *, max_grad_norm: float | None, scheduler: Any = None) -> Outcome:
        """Run the boundary transaction (`scheduler`: tried, then stepped after the commit)."""
        window, runtime = self.window, self.runtime
        agreed = False  # from a clean exchange to the step: a failure joins the step agreement
        try:  # the scheduler is tried before any rank steps, so its error is announced (DDP)
            try_scheduler(self.schedule.checked(scheduler, self.optimizer))
            agreement = self._agreement or self._exchange(rank_summary(window, runtime, self.sync))
            self._agreement = None
            if agreement.failed_ranks:
                raise agreement.failure()
            agreed = True
            count, loss_sum = agreement.count, agreement.loss_sum
            if (empty := count == 0) or not math.isfinite(loss_sum):  # counting 0: no step
                return self._skip(agreement, None, finite=empty)
            self._settle()  # FSDP2: reduce-scatter what the last backward did not
            held = reduced_gradients(window, runtime, self.sync, agreement, reduce=not self._fsdp)
            assert window.denominator is not None  # set by the window's first micro-batch
            divisor = grad_divisor(
                count,
                Normalize.SUM if window.terms else self.normalize,  # terms: divided per term
                agreement.denominator,
                loss_scale=window.loss_scale,
                averaged_over=self.sync.averaged_over,
            )
            divide_(held, divisor)
            norm = total_norm(held)
            norm_value = float(norm)
            if not math.isfinite(norm_value):
                return self._skip(agreement, norm_value, finite=False)
            if max_grad_norm is not None and held:
                clip_(held, max_grad_norm, norm)
            if not runtime.publish(window.params, norm_value, max_grad_norm, window.held):
                return self._skip(agreement, norm_value, finite=False)
            lr = learning_rate(self.optimizer)
            terms, objective = window.terms.report(agreement) if window.terms else (None, None)
            params, sync, agreed = window.params[: window.held], self.sync, False  # it joins
            apart = step_on_every_rank(self.optimizer, params, self._names, self, window, sync)
        except BaseException as error:
            if agreed:  # failed before its step: the other ranks step, then learn it there
                join_as_failed(self.sync, error, self)
            if not self._exchanged:  # the scheduler's try: the other ranks raise at the exchange
                self._fail(error, rerun=False)
            elif window.is_open:  # noted as discarded, unless a half-done step left it changed
                self._forget_window(None if self.broken else error)
            raise
        # Committed. The scheduler steps before the gradients are cleared (the contract's order);
        # each part runs even if one raised: the window ends closed, nothing steps twice or reruns.
        with after_step_guard():
            _commit.run_each(
                lambda: self.schedule.take(scheduler),
                lambda: self.buffers.close(window.micro_batches),  # learns what changes; warns
                lambda: runtime.update_scale(finite=True),
                self.batchnorm.end_window,
                self.sync.sync_buffers,  # DDP: rank 0's statistics everywhere, once per window
                runtime.clear_buffers,
                window.close,
                self._end,
            )
        if apart is not None:
            raise RankMismatchError(apart)
        return Outcome(True, count, loss_sum, norm_value, lr, (), terms, objective)

    def discard_window(self) -> None:
        """Drop an open window on purpose (`flush()` with "drop"), every rank alike."""
        try:  # DDP: the flush's exchange, where a rank closing a full window makes all raise
            if self.sync.flushing and self.sync.joins_flush:
                self._exchange(rank_summary(self.window, self.runtime, self.sync))
            self._settle()
        finally:
            self._forget_window()

    def _skip(self, agreement: WindowAgreement, norm: float | None, *, finite: bool) -> Outcome:
        count, loss_sum, world = agreement.count, agreement.loss_sum, self.sync.world
        names = () if finite else nonfinite_names(self.window, self.runtime, self._names, world)
        ledger = self.window.terms
        terms, objective = ledger.report(agreement) if ledger else (None, None)
        self._settle()
        self._forget_window()
        if not finite:
            self.runtime.update_scale(finite=False)  # the loss scale backs off exactly once
        lr = learning_rate(self.optimizer)
        return Outcome(False, count, loss_sum, norm, lr, names, terms, objective)

    def _exchange(self, summary: RankSummary) -> WindowAgreement:
        self._exchanged = True  # a failure from here on must not exchange again
        return self.sync.exchange(summary)

    def _settle(self) -> None:
        """FSDP2: make it reduce-scatter the window's deferred sums, by a zero-item backward."""
        if self.sync.defers and not self._reduced and self._last_input is not None:
            self._zero_item_micro_batch(*self._last_input, last=False, reduce=True)

    def _fail(self, error: BaseException, *, rerun: bool = True) -> None:
        """A window raised: tell the other ranks (DDP) at their next collective; forget it."""
        window, runtime, sync = self.window, self.runtime, self.sync
        ddp = sync.world > 1 and not self._fsdp and not isinstance(error, RankMismatchError)
        try:  # `Tokens` windows: the others sum their counts next; else they exchange
            if ddp and (self._next_sum or not self._exchanged):
                _boundary.announce_failure(window, runtime, sync, error, rerun, self._next_sum)
        finally:  # even if the notice failed, the window must not stay open
            self._forget_window(error)

    def _forget_window(self, error: BaseException | None = None) -> None:
        """Put back everything the window touched: gradients, buffers, BatchNorm statistics."""
        if error is not None:
            self.window.note_discarded(error)
        self.window.restore()
        self.sync.forget_window()
        self.runtime.clear_buffers()
        self.batchnorm.forget_window()
        self.buffers.forget()
        if self.telemetry is not None:
            self.telemetry.forget_window()  # a closed window's state holds nothing of it
        self._end()

    def _end(self) -> None:
        self.sync.end_window()
        self.buffers.reset()  # a loaded window's copies would be another window's
        self._agreement, self._exchanged, self._reduced = None, False, False
        self._last_input, self._next_sum = None, False

    def state_dict(self) -> dict[str, Any]:
        """The components' own states (a spoiled open window: refused)."""
        parts = (self.window, self.runtime, self.batchnorm, self.sync, self.buffers)
        return component_states(self._names, *parts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check every component's state first, then restore them; raise changing nothing."""
        params, held = self._params.for_window(self.optimizer, loading=True)
        components = (self.window, self.runtime, self.batchnorm, self.sync, self.buffers)
        restore_components(state, *components, params=params, held=held, end=self._end)
        self.broken = None  # the caller restored a consistent state
        self.schedule.forget()  # and may have moved the scheduler on purpose
