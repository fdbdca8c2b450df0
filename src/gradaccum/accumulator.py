"""`Accumulator`: one optimizer step per window of micro-batches, exactly as one full-batch step.

Two drives share one engine (`gradaccum.window.Window`):

- whole batch: `step(batch, loss_fn)` splits the batch and steps once;
- streaming: `micro_step(micro_batch, loss_fn)` steps after every `accumulation_steps` calls, and
  `flush()` settles a partial window at the end of the data.

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

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from gradaccum.batching import batch_size, check_micro_batch_size, split_batch
from gradaccum.batchnorm import BatchNormControl
from gradaccum.norms import clip_, total_norm
from gradaccum.options import (
    BatchNormMode,
    Normalize,
    OnNonFinite,
    PartialWindow,
    Precision,
    parse,
)
from gradaccum.precision import PrecisionRuntime
from gradaccum.recovery import AutoSizer, is_auto, step_with_recovery
from gradaccum.result import NonFiniteError, StepResult
from gradaccum.sizing import MemoryPlan
from gradaccum.state import accumulator_state, load_accumulator_state
from gradaccum.sync import agree_on_plan, grad_average_factor, is_fsdp
from gradaccum.window import (
    LossFn,
    Window,
    WindowTotals,
    check_optimizer_holds,
    trainable_parameters,
)

__all__ = ["Accumulator", "NonFiniteError", "StepResult"]


class Accumulator:
    """Gradient accumulation whose every step equals one full-batch step.

    Args:
        model: The model, plain or DDP-wrapped. Its parameters' device is used for batches.
        optimizer: An optimizer over (some of) the model's parameters.
        micro_batch_size: Items per micro-batch for `step()`, or `"auto"`: the largest that
            fits `memory_budget`, planned on the first batch (`gradaccum.recovery`).
        accumulation_steps: Micro-batches per window for `micro_step()`.
        normalize: `"mean"`: `sum(loss) / sum(count)` over the window; `"sum"`: `sum(loss)`.
        scheduler: Stepped once per optimizer step actually taken.
        max_grad_norm: Clip the window's gradient to this total 2-norm.
        precision: `"fp32"`, `"bf16"` or `"fp16"` autocast; fp16 adds a GradScaler.
        accum_dtype: Accumulate in buffers of this dtype for less precise parameters.
        partial_window: What `flush()` does with a partial window: `"step"`, `"drop"`, `"carry"`.
        on_nonfinite: `"skip"` a non-finite window, or `"raise"` `NonFiniteError`.
        batchnorm: `"micro"` (plain PyTorch), `"pooled"` (running statistics updated once per
            window from all its items) or `"frozen"` (eval-mode BatchNorm); see
            `gradaccum.batchnorm`.
        memory_budget: For `micro_batch_size="auto"`: bytes or e.g. `"2GiB"` (required on CPU).
        regrow_after: Auto mode: clean windows after an out-of-memory shrink before a larger
            size is tried again; None never grows back.

    Raises:
        ValueError: For any invalid setting; the message names the fix.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        micro_batch_size: int | str | None = None,
        accumulation_steps: int | None = None,
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
    ) -> None:
        auto = is_auto(micro_batch_size, memory_budget)
        if micro_batch_size is not None and not auto:
            check_micro_batch_size(micro_batch_size)
        if accumulation_steps is not None:
            check_micro_batch_size(accumulation_steps, "accumulation_steps")
        if max_grad_norm is not None and not (
            isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf
        ):
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be a positive finite number.")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler={scheduler!r} has no step(); pass an LRScheduler or None.")
        self.normalize = parse(Normalize, normalize, "normalize")
        self.precision = parse(Precision, precision, "precision")
        self.partial_window = parse(PartialWindow, partial_window, "partial_window")
        self.on_nonfinite = parse(OnNonFinite, on_nonfinite, "on_nonfinite")
        self._batchnorm = BatchNormControl(model, batchnorm)
        params = trainable_parameters(model)
        check_optimizer_holds(optimizer, params)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.micro_batch_size = micro_batch_size
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.memory_budget = memory_budget
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self._runtime = PrecisionRuntime(self.precision, params, accum_dtype)
        if self._runtime.uses_buffers and is_fsdp(model):
            raise ValueError(
                "accum_dtype buffers cannot see FSDP2's deferred gradients; pass "
                "fully_shard(..., mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)) "
                "instead and leave accum_dtype=None."
            )
        self._window = Window(model, params, self.normalize, self._runtime)
        self._auto = AutoSizer(memory_budget, self._runtime.device, regrow_after) if auto else None
        if auto and self._window.fsdp:
            raise ValueError(
                "micro_batch_size='auto' does not support FSDP2 yet; pass the int that "
                "gradaccum.plan_micro_batch chooses on an unsharded copy."
            )
        # Windows dropped as non-finite and as empty so far: part of the state, for exact resume.
        self.nonfinite_windows = 0
        self.empty_windows = 0

    @property
    def plan(self) -> MemoryPlan | None:
        """The memory plan behind `micro_batch_size="auto"`, once the first batch made it."""
        return None if self._auto is None else self._auto.plan

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 GradScaler, or None for fp32 and bf16."""
        return self._runtime.scaler

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly, even mid-window (see `gradaccum.state`)."""
        return accumulator_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; raises ValueError naming any mismatch, changing nothing."""
        load_accumulator_state(self, state)

    def step(self, batch: Any, loss_fn: LossFn) -> StepResult:
        """Split `batch` into micro-batches, accumulate them and take one optimizer step.

        Gradients present before the call are discarded, as `zero_grad()` would; if the call
        raises, they are put back and nothing else has changed.

        Args:
            batch: A tensor or nesting of dict/list/tuple whose tensors share dim 0.
            loss_fn: `loss_fn(model, micro_batch) -> Tensor | LossSum`.

        Returns:
            The window's `StepResult`.
        """
        if self.micro_batch_size is None:
            raise ValueError(
                "step() needs micro_batch_size; pass Accumulator(..., micro_batch_size=8), "
                "or drive the window with micro_step() and accumulation_steps."
            )
        self._check_no_open_window("step()")
        if self._auto is not None:
            return step_with_recovery(self, batch, loss_fn)
        self._accumulate(batch, loss_fn, self.micro_batch_size)
        return self._finish_window(self.micro_batch_size)

    def _accumulate(
        self, batch: Any, loss_fn: LossFn, micro_batch_size: int, defer_sync: bool = False
    ) -> None:
        """Forward and backward every micro-batch of `batch`.

        `defer_sync` leaves the cross-rank gradient reduction to the boundary.
        """
        micro_batches = split_batch(batch, micro_batch_size)
        items = batch_size(batch)
        if self._window.fsdp:
            agree_on_plan(self.model, len(micro_batches), min(items, micro_batch_size))
        self._batchnorm.warn_once(micro_batch_size, items)
        with self._fresh_window_guard():
            for index, micro_batch in enumerate(micro_batches):
                with self._batchnorm.micro_context():
                    self._window.backward(
                        micro_batch,
                        loss_fn,
                        expected_micro_batches=len(micro_batches),
                        last=index == len(micro_batches) - 1 and not defer_sync,
                        items=min(micro_batch_size, items - index * micro_batch_size),
                        window_items=items,
                    )

    def micro_step(self, micro_batch: Any, loss_fn: LossFn) -> StepResult:
        """Accumulate one micro-batch; step when the window holds `accumulation_steps` of them.

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
        steps = self.accumulation_steps
        last = self._window.totals.micro_batches + 1 == steps
        items = batch_size(micro_batch)  # once: the window's backward takes it as checked
        self._batchnorm.warn_once(items, items * steps)
        with self._fresh_window_guard(), self._batchnorm.micro_context():
            self._window.backward(
                micro_batch, loss_fn, expected_micro_batches=steps, last=last, items=items
            )
        if last:
            return self._finish_window(self._window.totals.largest_micro_batch)
        return self._progress()

    def flush(self) -> StepResult:
        """Settle a partial window at the end of the data, as `partial_window` says.

        Returns:
            `"step"`: the step over the items seen; `"drop"`: a result with `stepped=False`
            after discarding them; `"carry"`: the open window's progress, kept for later.
        """
        totals = self._window.totals
        if totals.micro_batches == 0 or self.partial_window is PartialWindow.CARRY:
            return self._progress()
        if self.partial_window is PartialWindow.STEP:
            return self._finish_window(totals.largest_micro_batch)
        result = self._progress()
        self._window.settle_deferred()
        self._window.reset()
        self._batchnorm.discard_window()
        return result

    def _finish_window(self, micro_batch_size: int) -> StepResult:
        """The window boundary: the only place the optimizer, scaler and scheduler are touched."""
        window, scaler, totals = self._window, self._runtime.scaler, self._window.totals
        agreed = window.global_totals()  # 1. all-reduce the counts
        count, loss_total = agreed.count, agreed.loss_sum
        if count == 0:
            self.empty_windows += 1
            return self._discard(totals, count, loss_total, micro_batch_size, grad_norm=None)
        if not math.isfinite(loss_total):  # 4. finite? (the loss: no need to touch gradients)
            return self._skip_nonfinite(totals, count, loss_total, micro_batch_size, None)
        window.synchronize()  # a no-op unless DDP skipped this window's reduction
        window.divide(count, averaged_over=grad_average_factor(self.model))  # 2. rescale
        if scaler is not None:
            self._runtime.publish(window.params)  # GradScaler unscales only .grad
            scaler.unscale_(self.optimizer)  # 3. unscale
        grads = window.gradients()
        grad_norm = total_norm(grads)
        norm_value = float(grad_norm)
        if not math.isfinite(norm_value):  # 4. finite? (the gradients)
            return self._skip_nonfinite(totals, count, loss_total, micro_batch_size, norm_value)
        if self.max_grad_norm is not None:
            clip_(grads, self.max_grad_norm, grad_norm)  # 5. clip
        self._runtime.publish(window.params)
        lr = self._lr()
        if scaler is not None:  # 6. step
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self._batchnorm.end_window()  # "pooled": one running-statistics update
        if self.scheduler is not None:
            self.scheduler.step()  # 7. schedule
        self.optimizer.zero_grad(set_to_none=True)  # 8. zero
        window.reset()
        loss = self._objective(loss_total, count)
        return StepResult(
            loss, count, totals.micro_batches, micro_batch_size, True, False, norm_value, lr
        )

    def _skip_nonfinite(
        self,
        totals: WindowTotals,
        count: int,
        loss_total: float,
        micro_batch_size: int,
        grad_norm: float | None,
    ) -> StepResult:
        """Drop a non-finite window whole: no optimizer or scheduler step; fp16 backs off once."""
        self.nonfinite_windows += 1
        self._runtime.back_off(unscaled=grad_norm is not None)
        raising = self.on_nonfinite is OnNonFinite.RAISE
        culprits = self._nonfinite_parameter_names() if raising else []
        result = self._discard(totals, count, loss_total, micro_batch_size, grad_norm)
        if raising:
            raise NonFiniteError(
                f"window of {totals.micro_batches} micro-batches has loss sum {loss_total} and "
                f"grad norm {grad_norm}; non-finite gradients in: {culprits}. The window was "
                "discarded; pass on_nonfinite='skip' to skip such windows instead."
            )
        return result

    def _discard(
        self,
        totals: WindowTotals,
        count: int,
        loss_total: float,
        micro_batch_size: int,
        grad_norm: float | None,
    ) -> StepResult:
        self._window.settle_deferred()
        self._window.reset()
        self._batchnorm.discard_window()
        loss = self._objective(loss_total, count)
        return StepResult(
            loss, count, totals.micro_batches, micro_batch_size, False, True, grad_norm, self._lr()
        )

    def _progress(self) -> StepResult:
        totals = self._window.totals
        return StepResult(
            self._objective(totals.loss_total(), totals.count),
            totals.count,
            totals.micro_batches,
            totals.largest_micro_batch,
            False,
            False,
            None,
            self._lr(),
        )

    def _objective(self, loss_total: float, count: int) -> float:
        if self.normalize is Normalize.SUM:
            return loss_total
        return loss_total / count if count else 0.0

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _check_no_open_window(self, caller: str) -> None:
        if self._window.totals.micro_batches:
            raise RuntimeError(
                f"{caller} was called while a streaming window holds "
                f"{self._window.totals.micro_batches} micro-batches; call flush() first."
            )

    @contextlib.contextmanager
    def _fresh_window_guard(self) -> Iterator[None]:
        """At a window's start, set old gradients aside; put them back if the window fails."""
        if self._window.totals.micro_batches:
            yield
            return
        params = self._window.params
        previous = [p.grad for p in params]
        for param in params:
            param.grad = None
        try:
            yield
        except BaseException:
            self._window.reset()
            for param, grad in zip(params, previous, strict=True):
                param.grad = grad
            raise

    def _nonfinite_parameter_names(self) -> list[str]:
        names = []
        runtime = self._runtime
        for param, buffered, buffer in zip(
            self._window.params, runtime.buffered, runtime.buffers, strict=True
        ):
            grad = buffer if buffered else param.grad
            if grad is not None and not bool(torch.isfinite(grad).all()):
                names.append(self._param_names.get(id(param), "<unnamed>"))
        return names or ["<none: the loss itself is non-finite>"]
