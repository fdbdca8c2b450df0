"""`Accumulator`: one optimizer step per window of micro-batches, exactly as one full-batch step.

Two drives share one engine: `step(batch, loss_fn)` splits a batch and steps once; `micro_step`
steps after every `accumulation_steps` calls, and `flush()` settles a partial window.

It owns and alone calls: the `Window` (totals, parameters, set-aside gradients), the
`PrecisionRuntime` (autocast, loss scale, fp32 buffers), a `GradSync`, the `BatchNormControl`, an
`AutoSizer` (`micro_batch_size="auto"`). The boundary is a transaction: until `optimizer.step()`
returns, any exception (loss, backward, a collective, clipping, the optimizer, Ctrl-C) forgets
the window (`_forget_window()`): parameters, optimizer, scheduler, buffers, gradients as before.

Example:
    >>> import torch
    >>> from gradaccum import Accumulator
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> acc = Accumulator(model, opt, micro_batch_size=3)
    >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
    >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> result = acc.step((x, y), mse)
    >>> result.micro_batches, result.count, result.stepped
    (3, 8, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradaccum._checks import check_fsdp_support, check_savable, check_saved_state, check_settings
from gradaccum._coupled_sizes import run_unsplit_if_coupled, split_changes_step
from gradaccum._engine import Engine
from gradaccum._lr_watch import LearningRateWatch
from gradaccum._open_window import warn_if_left_open
from gradaccum._optimizer_setting import OptimizerSetting
from gradaccum._parameters import trainable_parameters, window_parameters
from gradaccum._run_settings import RunSettings
from gradaccum._schedule_length import length_noted
from gradaccum._trimmed_norms import trimmed_norms_refused
from gradaccum._window_sizes import WindowSizes
from gradaccum.batching import batch_size, split_batch
from gradaccum.batchnorm import BatchNormControl
from gradaccum.divisor import Expectation
from gradaccum.options import (
    AutoSize,
    BatchNormMode,
    Normalize,
    OnNonFinite,
    PartialWindow,
    Precision,
    SyncPolicy,
    Tokens,
    parse,
)
from gradaccum.packing import check_packable, pack_by_tokens
from gradaccum.precision import PrecisionRuntime, warn_if_ignored
from gradaccum.recovery import AutoSizer
from gradaccum.result import NonFiniteError, SkippedInARow, StepResult, learning_rate
from gradaccum.sizing import MemoryPlan
from gradaccum.sync import grad_sync_for
from gradaccum.telemetry import TelemetryMeter
from gradaccum.window import LossFn

__all__ = ["Accumulator", "NonFiniteError", "StepResult"]

STATE_VERSION = 2


class Accumulator(WindowSizes, OptimizerSetting, RunSettings):
    """Gradient accumulation whose every step equals one full-batch step.

    Args:
        model: The model, plain, DDP-wrapped or FSDP2-sharded. Batches go to its device.
        optimizer: An optimizer over (some of) the model's parameters; it may also hold
            parameters outside the model (a learnable loss weight). `acc.optimizer = new`
            between windows steps `new` from the next window on (set `acc.scheduler` too).
        micro_batch_size: Items per micro-batch for `step()`; `"auto"`: the fastest size that
            fits `memory_budget`, timed on the first windows; `"largest"`: the largest that
            fits, planned on the first batch (`gradaccum.recovery`).
        accumulation_steps: Micro-batches per window for `micro_step()`, or `Tokens(n)`: a
            window closes once the items counted over all ranks reach `n`.
        normalize: `"mean"`: `sum(loss) / sum(count)` over the window; `"sum"`: `sum(loss)`.
        scheduler: Stepped once per optimizer step taken, and tried before it (one that would
            raise changes nothing); `step()` takes no argument (step `ReduceLROnPlateau` yourself).
        max_grad_norm: Clip the window's gradient to this total 2-norm.
        precision: `"fp32"`, `"bf16"` or `"fp16"` autocast; fp16 adds a loss scale.
        accum_dtype: Accumulate in buffers of this dtype for less precise parameters.
        partial_window: What `flush()` does with a partial window: `"step"`, `"drop"`, `"carry"`.
        on_nonfinite: `"skip"` a non-finite window, or `"raise"` `NonFiniteError`.
        batchnorm: `"micro"`, `"pooled"` or `"frozen"`; see `gradaccum.batchnorm`.
        memory_budget: For `micro_batch_size="auto"`: bytes or e.g. `"2GiB"` (required on CPU).
        regrow_after: Auto mode: clean windows after an out-of-memory shrink before a larger
            size is tried again; None never grows back.
        batch_dim: The items' dimension of every tensor in a batch: 0, or 1 for sequence-first
            layouts such as `(seq, batch, features)` (see `gradaccum.batching`).
        telemetry: Put a `Telemetry` on every stepped result: the gradient noise scale, items
            per second, micro-batch size and peak memory (`gradaccum.telemetry`).
        sync_policy: FSDP2: reduce-scatter once per window (`"window"`: unsharded gradient
            sums held for the window) or after every micro-batch (`"micro"`: only the shard).

    Raises:
        ValueError: For any invalid setting; the message names the fix.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        micro_batch_size: int | str | None = None,
        accumulation_steps: int | Tokens | None = None,
        normalize: Normalize | str = "mean",
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        precision: Precision | str = "fp32",
        accum_dtype: torch.dtype | None = None,
        partial_window: PartialWindow | str = "step",
        on_nonfinite: OnNonFinite | str = "skip",
        batchnorm: BatchNormMode | str = "micro",
        memory_budget: int | str | None = None,
        regrow_after: int | None = 50,
        batch_dim: int = 0,
        telemetry: bool = False,
        sync_policy: SyncPolicy | str = "window",
    ) -> None:
        auto = check_settings(
            model,
            optimizer,
            micro_batch_size=micro_batch_size,
            accumulation_steps=accumulation_steps,
            memory_budget=memory_budget,
            max_grad_norm=max_grad_norm,
            scheduler=scheduler,
        )
        params = trainable_parameters(model)
        self.batch_dim = batch_dim  # checked (`WindowSizes`)
        self.normalize = parse(Normalize, normalize, "normalize")
        self.precision = parse(Precision, precision, "precision")
        self.partial_window = parse(PartialWindow, partial_window, "partial_window")
        self.on_nonfinite = parse(OnNonFinite, on_nonfinite, "on_nonfinite")
        every = window_parameters(params, optimizer)[0]  # the optimizer's too: fp16 check, buffers
        runtime = PrecisionRuntime(self.precision, [*params, *every], accum_dtype)
        warn_if_ignored(self.precision, [*params, *every])  # a float64 model: autocast does not
        policy = parse(SyncPolicy, sync_policy, "sync_policy")
        check_fsdp_support(model, buffers=runtime.uses_buffers, policy=policy)
        self._auto = None
        if auto:
            mode, dev, dim = AutoSize(micro_batch_size), runtime.device, self.batch_dim
            self._auto = AutoSizer(memory_budget, dev, regrow_after, mode, policy=policy, dim=dim)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.micro_batch_size, self.accumulation_steps = micro_batch_size, accumulation_steps
        self.max_grad_norm, self.memory_budget = max_grad_norm, memory_budget
        sync = grad_sync_for(model, policy, trains=True)
        control = BatchNormControl(model, batchnorm)
        sync.frozen_batchnorm = control.mode is BatchNormMode.FROZEN  # SyncBatchNorm: no collective
        self._engine = Engine(
            model,
            optimizer,
            normalize=self.normalize,
            runtime=runtime,
            sync=sync,
            batchnorm=control,
            batch_dim=self.batch_dim,
        )
        if telemetry:
            self._engine.telemetry = TelemetryMeter(device=runtime.device)
        self.nonfinite_windows = self.empty_windows = 0  # windows skipped so far: in the state
        self._stalled = SkippedInARow(20 if self.precision is Precision.FP16 else 3)
        self._rates = LearningRateWatch()  # a scheduler stepped per micro_step() call: warned
        warn_if_left_open(self, self._engine.window)  # a flush() left out: warned at the end

    @property
    def plan(self) -> MemoryPlan | None:
        """The memory plan behind `micro_batch_size="auto"`, once the first batch made it."""
        return None if self._auto is None else self._auto.plan

    def step(self, batch: Any, loss_fn: LossFn, *, max_tokens: int | None = None) -> StepResult:
        """Split `batch` into micro-batches, accumulate them and take one optimizer step.

        Gradients present before the call are discarded, as `zero_grad()` would; if the call
        raises, they are put back and nothing else has changed.

        Args:
            batch: A tensor or nesting of dict/list/tuple whose tensors share dim 0.
            loss_fn: `loss_fn(model, micro_batch) -> Tensor | LossSum`.
            max_tokens: Split so that rows x longest row <= max_tokens (`gradaccum.packing`).

        Returns:
            The window's `StepResult`.
        """
        engine = self._engine
        if engine.window.is_open:
            raise RuntimeError(
                f"step() was called while a streaming window holds "
                f"{engine.window.micro_batches} micro-batches; call flush('step') or "
                "flush('drop') first."
            )
        if max_tokens is not None:
            return self._step_packed(batch, loss_fn, max_tokens)
        if self.micro_batch_size is None:
            raise ValueError(
                "step() needs micro_batch_size; pass Accumulator(..., micro_batch_size=8), "
                "or drive the window with micro_step() and accumulation_steps."
            )
        if self._auto is not None:
            return self._step_auto(batch, loss_fn)
        assert isinstance(self.micro_batch_size, int)
        items = batch_size(batch, batch_dim=self.batch_dim, allow_empty=engine.sync.world > 1)
        if not items:  # a rank with no data this window still takes part in its collectives
            engine.run_window([], loss_fn, window_items=0, size=[], template=batch)
            return self._close(0)
        size = min(self.micro_batch_size, items)
        micro_batches = split_batch(batch, size, batch_dim=self.batch_dim)
        engine.run_window(micro_batches, loss_fn, window_items=items, size=size)
        return self._close(size)

    def _step_packed(self, batch: Any, loss_fn: LossFn, max_tokens: int) -> StepResult:
        """`step()` by a token budget: micro-batches of varied rows, each within the budget."""
        check_packable(self._auto is not None, self.batch_dim, self.micro_batch_size)
        micro_batches = pack_by_tokens(batch, max_tokens)
        sizes = [batch_size(micro_batch) for micro_batch in micro_batches]
        with trimmed_norms_refused(self.model, micro_batches, batch, loss_fn):
            self._engine.run_window(
                micro_batches, loss_fn, window_items=sum(sizes), size=sizes, template=batch
            )
        return self._close(max(sizes, default=0))

    def _step_auto(self, batch: Any, loss_fn: LossFn) -> StepResult:
        """`step()` in auto mode: plan once, run the window, rerun it whole and smaller on OOM."""
        auto, engine = self._auto, self._engine
        assert auto is not None
        runtime = engine.runtime
        accum = runtime.accum_dtype if runtime.uses_buffers else None
        auto.ensure_plan(
            self.model, batch, loss_fn, self.optimizer, precision=self.precision, accum_dtype=accum
        )
        items = batch_size(batch, batch_dim=self.batch_dim, allow_empty=engine.sync.world > 1)

        def attempt(size: int, note: str | None) -> StepResult:
            size = min(size, items)  # 0 on a rank without items: it joins the collectives alone
            micro_batches = split_batch(batch, size, batch_dim=self.batch_dim) if items else []
            run_unsplit_if_coupled(engine, auto, micro_batches, loss_fn, items, size, batch)
            return self._close(size, note)  # raises out-of-memory too, if another rank ran out

        return auto.run(batch, items, attempt, split_changes_step(engine))  # BatchNorm, loss

    def micro_step(self, micro_batch: Any, loss_fn: LossFn) -> StepResult:
        """Accumulate one micro-batch; step when the window is full (see `accumulation_steps`).

        Args:
            micro_batch: One micro-batch from your loader.
            loss_fn: `loss_fn(model, micro_batch) -> Tensor | LossSum`.

        Returns:
            The window's `StepResult`; `stepped` is True on the window's last micro-batch.
        """
        if self.accumulation_steps is None:
            raise ValueError(
                "micro_step() needs accumulation_steps; pass Accumulator(..., "
                "accumulation_steps=4), or give the whole batch to step()."
            )
        engine, steps = self._engine, self.accumulation_steps
        if isinstance(steps, Tokens):  # a window of a few micro-batches, closed by its count
            expect, last = Expectation(2, until=steps.count, until_term=steps.term), False
        else:
            expect, last = Expectation(steps), engine.window.micro_batches + 1 >= steps
        self._rates.check(self.optimizer, engine.window)
        if engine.run_micro_batch(micro_batch, loss_fn, last=last, expect=expect):
            return self._close(engine.window.largest_micro_batch)
        self._rates.mark(self.optimizer)
        return self._pending()

    def flush(self, partial_window: PartialWindow | str | None = None) -> StepResult:
        """Settle a partial window at the end of the data, as `partial_window` says.

        Args:
            partial_window: This once instead of the setting (the same on every rank): `"drop"`
                a window your loader left open by raising, `"step"` a carried one.

        Returns:
            `"step"`: the step over the items seen; `"drop"`: a result with `stepped=False`
            after discarding them; `"carry"`: the open window's progress, kept for later.
        """
        mode = parse(PartialWindow, partial_window or self.partial_window, "partial_window")
        engine, window, sync = self._engine, self._engine.window, self._engine.sync
        step, carry = (mode is m for m in (PartialWindow.STEP, PartialWindow.CARRY))
        self._rates.forget()  # a carried window may span an epoch's scheduler step
        if carry or not (window.is_open or sync.joins_flush):
            window.carry()  # if open: an evaluation may write its weights and put them back
            return self._pending()
        if window.is_open and step:  # "drop": the window goes, touched (written weights) or not
            engine.check_gradients_untouched(final=True)
        elif not window.is_open:  # DDP: join the ranks a partial window left ("drop": discard it)
            engine.run_window([], lambda model, batch: model(batch), window_items=0, size=[])
        sync.flushing, empty = True, self.empty_windows  # vs a full window: every rank raises
        sync.tokens = isinstance(self.accumulation_steps, Tokens)  # vs a micro-batch's count sum
        if not step:
            result = self._pending()
            engine.discard_window()  # DDP: after the flush's exchange
            return self._stalled.dropped(result, self.accumulation_steps)  # nothing trains?
        result = self._close(window.largest_micro_batch)  # the window's end resets `flushing`
        if result.micro_batches or result.stepped or result.count:
            return result
        self.empty_windows = empty  # nothing ran here, and no rank counted an item
        return self._pending()

    def _close(self, micro_batch_size: int, sizing: str | None = None) -> StepResult:
        """The window boundary, through the engine's transaction; counts what it skipped."""
        engine, scheduler = self._engine, self.scheduler
        micro_batches, counted = engine.window.micro_batches, engine.window.count
        with length_noted(self, scheduler):  # OneCycleLR past total_steps: what the run takes
            outcome = engine.close_window(max_grad_norm=self.max_grad_norm, scheduler=scheduler)
        build = StepResult.stepped if outcome.stepped else StepResult.skipped
        meter, telemetry = self._engine.telemetry, None
        if meter is not None:  # `counted`: this rank's items, for a window resumed mid-way
            summed, norm = self.normalize is Normalize.SUM, outcome.grad_norm
            telemetry = meter.close(
                outcome.stepped, outcome.count, norm, summed, micro_batch_size, counted
            )
        objective = outcome.objective  # set for LossSum.terms windows
        if objective is None:
            objective = _objective(outcome.loss_sum, outcome.count, self.normalize is Normalize.SUM)
        result = build(
            loss=objective,
            count=outcome.count,
            micro_batches=micro_batches,
            micro_batch_size=micro_batch_size,
            grad_norm=outcome.grad_norm,
            lr=outcome.lr,
            terms=outcome.terms,
            sizing=sizing,
            telemetry=telemetry,
        )
        if outcome.stepped:
            self._stalled.stepped()
            return result
        if outcome.count == 0 and self.normalize is Normalize.MEAN:
            self.empty_windows += 1
            return result
        self.nonfinite_windows += 1
        if self.on_nonfinite is OnNonFinite.RAISE:
            raise NonFiniteError.of_window(micro_batches, outcome, self.scaler)
        self._stalled.skipped(outcome)
        return result

    def _pending(self) -> StepResult:
        """The open window's progress; its loss read if asked, by a reader holding no `self`."""
        window, summed = self._engine.window, self.normalize is Normalize.SUM
        count, loss_sum, host = window.count, window.loss_sum, window.loss_host
        snapshot = None if loss_sum is None else loss_sum.detach().clone()  # later adds: in place
        loss: Callable[[], float] = lambda: _objective(  # noqa: E731
            host + (0.0 if snapshot is None else float(snapshot)), count, summed
        )
        return StepResult.pending(
            loss=loss if window.terms is None else window.terms.pending_objective(),
            count=count,
            micro_batches=window.micro_batches,
            micro_batch_size=window.largest_micro_batch,
            lr=learning_rate(self.optimizer),
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly, even mid-window: each component's own state.

        Raises:
            ValueError: In an open window under FSDP2's `sync_policy="window"` (see `_checks`).
        """
        engine, meter = self._engine, self._engine.telemetry
        check_savable(engine.broken, deferred=engine.sync.defers, open_window=engine.window.is_open)
        return {
            "version": STATE_VERSION,
            "settings": self._settings(),
            "engine": engine.state_dict(),
            "auto": None if self._auto is None else self._auto.state_dict(),
            "telemetry": None if meter is None else meter.state_dict(),
            "nonfinite_windows": self.nonfinite_windows,
            "empty_windows": self.empty_windows,
            "nonfinite_in_a_row": self._stalled.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; raises ValueError naming any mismatch, changing nothing."""
        same_split = check_saved_state(state, STATE_VERSION, self._settings())
        self._engine.load_state_dict(state["engine"])  # checks everything, then loads
        if self._auto is not None and same_split and state.get("auto") is not None:
            self._auto.load_state_dict(state["auto"])  # kept only by the same auto mode
        if self._engine.telemetry is not None:  # saved without telemetry: it starts afresh
            saved = state.get("telemetry") or TelemetryMeter().state_dict()
            self._engine.telemetry.load_state_dict(saved, self._engine.window.count)
        self._rates.forget()
        self.nonfinite_windows = int(state["nonfinite_windows"])
        self.empty_windows = int(state["empty_windows"])
        self._stalled.load_state_dict(state.get("nonfinite_in_a_row"))


def _objective(loss_total: float, count: int, summed: bool) -> float:
    """The window's objective: its loss sum, or its mean over `count` (0.0 over no item)."""
    return loss_total if summed else (loss_total / count if count else 0.0)
