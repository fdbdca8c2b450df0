"""The per-micro-batch path shared by every drive: forward, read (sum, count), backward.

A `Window` runs micro-batches and keeps the window's running totals. Gradients accumulate as the
plain SUM of per-item loss gradients times a power-of-two prescale; at the boundary they are
divided once, by the global item count. The prescale only keeps fp16 activation gradients in
range (summed losses are ~count times larger than means). Multiplying by a power of two is exact
in floating point, so it changes no bit of the result: the one real division is by the count.

`accumulate_grad` is the functional form: the exact full-batch gradient, no optimizer step.

Example:
    >>> import torch
    >>> from gradaccum import accumulate_grad
    >>> model = torch.nn.Linear(3, 1)
    >>> x, y = torch.randn(10, 3), torch.randn(10, 1)
    >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> accumulate_grad(model, (x, y), mse, micro_batch_size=4).count
    10
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.batching import batch_size, map_tensors, split_batch, to_device
from gradaccum.loss import LossSum, read_loss
from gradaccum.options import Normalize, Precision, parse
from gradaccum.precision import PrecisionRuntime
from gradaccum.sync import (
    GlobalTotals,
    agree_on_window,
    average_gradients,
    is_fsdp,
    sync_context,
    world_size,
)

__all__ = [
    "LossFn",
    "Window",
    "WindowTotals",
    "accumulate_grad",
    "check_optimizer_holds",
    "trainable_parameters",
]

LossFn = Callable[[torch.nn.Module, Any], "torch.Tensor | LossSum"]


@dataclass
class WindowTotals:
    """Running totals of one accumulation window; all of it is plain data to save and restore.

    Attributes:
        count: Items counted so far (this rank).
        micro_batches: Micro-batches run so far.
        loss_sum: Detached running sum of the loss, or None before the first one.
        grad_divisor: Gradients hold `sum / grad_divisor`; fixed by the window's first micro-batch.
        largest_micro_batch: Leading dimension of the largest micro-batch seen.
    """

    count: int = 0
    micro_batches: int = 0
    loss_sum: torch.Tensor | None = None
    grad_divisor: float | None = None
    largest_micro_batch: int = 0

    def add_loss(self, value: torch.Tensor, weight: int) -> None:
        """Add `value * weight` to the running loss sum: one in-place op, no graph, no sync."""
        if self.loss_sum is None:
            # The loss's own dtype (at least float32): a mixed-dtype add costs ~10x more.
            dtype = torch.promote_types(value.dtype, torch.float32)
            self.loss_sum = torch.zeros((), dtype=dtype, device=value.device)
        self.loss_sum.add_(value.detach(), alpha=weight)

    def loss_total(self) -> float:
        """The summed loss so far as a float (0.0 before any micro-batch)."""
        return 0.0 if self.loss_sum is None else float(self.loss_sum)


class Window:
    """Runs micro-batches of one model and accumulates their summed-loss gradients.

    Args:
        model: The model (possibly DDP-wrapped); micro-batches go to its device.
        params: Its trainable parameters, in a fixed order.
        normalize: The objective, which decides the prescale and the final divisor.
        runtime: Autocast, loss scaling and gradient buffers.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: list[torch.nn.Parameter],
        normalize: Normalize,
        runtime: PrecisionRuntime,
    ) -> None:
        self.model = model
        self.params = params
        self.normalize = normalize
        self.runtime = runtime
        self.totals = WindowTotals()
        self.distributed = world_size(model) > 1
        self.synchronized = False  # whether the last backward reduced gradients across ranks
        self.agreed: GlobalTotals | None = None  # the window's totals over ranks, once exchanged
        self.fsdp = is_fsdp(model)
        # FSDP2 keeps deferred gradient sums to itself; a later backward must carry them out.
        self._last_input: tuple[Any, LossFn] | None = None

    def backward(
        self,
        micro_batch: Any,
        loss_fn: LossFn,
        *,
        expected_micro_batches: int,
        last: bool,
        items: int | None = None,
        window_items: int | None = None,
    ) -> None:
        """Forward and backward one micro-batch, adding its summed-loss gradient.

        The loss is checked before backward, so a bad `loss_fn` result raises and changes no
        gradient. Nothing of the micro-batch's graph outlives this call.

        Args:
            micro_batch: The micro-batch (any nesting of tensors).
            loss_fn: `loss_fn(model, micro_batch) -> Tensor | LossSum`.
            expected_micro_batches: Micro-batches this window is planned to hold.
            last: Whether this is the window's last micro-batch, whose backward reduces
                gradients across ranks.
            items: The micro-batch's leading dimension, if the caller already checked it.
            window_items: Items in the whole window, when known up front (`step()`).
        """
        if items is None:
            items = batch_size(micro_batch)
        micro_batch = to_device(micro_batch, self.runtime.device)
        # DDP cannot see gradients that were moved into buffers, so those are reduced by hand.
        sync = last and not self.runtime.uses_buffers
        with sync_context(self.model, sync=sync):
            with self.runtime.autocast():
                value, weight, count = read_loss(loss_fn(self.model, micro_batch), items)
            totals = self.totals
            if totals.grad_divisor is None:
                totals.grad_divisor = self._grad_divisor(
                    weight, count, items, expected_micro_batches, window_items
                )
            if count > 0 and not value.requires_grad:
                raise ValueError(
                    "the loss does not require grad: it was computed under torch.no_grad(), "
                    "detached, or from frozen parameters only; return the loss with its graph."
                )
            if last and self.distributed:
                # Ranks compare windows before the backward that reduces gradients, so a rank
                # that differs raises everywhere instead of leaving the others waiting.
                self._agree(count, value.detach() * weight)
            # A zero-count micro-batch still runs backward when it can: its gradient is zero, but
            # a DDP rank must join the gradient reduction on a window's last micro-batch.
            if value.requires_grad:
                factor = weight / totals.grad_divisor
                scaled = value if factor == 1.0 else value * factor
                self.runtime.scale(scaled).backward()
                self.runtime.collect(self.params)
        if self.fsdp:
            self._last_input = (micro_batch, loss_fn)
        totals.add_loss(value, weight)
        totals.count += count
        totals.micro_batches += 1
        totals.largest_micro_batch = max(totals.largest_micro_batch, items)
        self.synchronized = sync

    def global_totals(self) -> GlobalTotals:
        """The window's count and loss sum over all ranks (one exchange per window)."""
        if self.agreed is None:
            self._agree(0, None)
        assert self.agreed is not None
        return self.agreed

    def _agree(self, pending_count: int, pending_loss: torch.Tensor | None) -> None:
        totals = self.totals
        loss_sum = totals.loss_total() + (0.0 if pending_loss is None else float(pending_loss))
        self.agreed = agree_on_window(
            self.model,
            totals.count + pending_count,
            loss_sum,
            totals.micro_batches + int(pending_loss is not None),
            totals.grad_divisor or 1.0,
        )

    def gradients(self) -> list[torch.Tensor]:
        """The tensors holding the accumulated gradients (buffers where there are buffers)."""
        return self.runtime.gradients(self.params)

    def synchronize(self) -> None:
        """Reduce the gradients over ranks if the window's backward passes did not."""
        if not self.distributed or self.synchronized:
            return
        if self.fsdp:
            self._settle_fsdp()
        else:
            average_gradients(self.model, self.runtime.every_gradient(self.params))
        self.synchronized = True

    def settle_deferred(self) -> None:
        """Before a window is discarded: FSDP2 would carry its deferred sums into the next one."""
        if self.fsdp:
            self.synchronize()

    def _settle_fsdp(self) -> None:
        """Make FSDP2 reduce-scatter its deferred sums: one synchronized backward of zero items.

        FSDP2 holds a deferred window's partial sums on its own unsharded parameters, out of
        reach; only a backward with the sync on releases them. The last micro-batch cut to zero
        items adds nothing to them (its gradient sums over no item).
        """
        assert self._last_input is not None  # a distributed window ran at least one micro-batch
        micro_batch, loss_fn = self._last_input
        empty = map_tensors(micro_batch, lambda tensor: tensor[:0])
        with self.runtime.autocast():
            value, _, _ = read_loss(loss_fn(self.model, empty), 0)
        value.backward(torch.zeros_like(value))

    def divide(self, total_count: int, averaged_over: int = 1) -> None:
        """Turn accumulated sums into the objective's gradient: the window's one division.

        Args:
            total_count: Items counted in the window over all ranks.
            averaged_over: What a wrapper already divided the gradients by (DDP: world size).
        """
        count = total_count if self.normalize is Normalize.MEAN else 1
        # Gradients hold sum / grad_divisor; a power-of-two divisor makes this division exact
        # up to its one rounding, and a folded one (count == grad_divisor) makes it a no-op.
        divisor = count / (self.totals.grad_divisor or 1.0) / averaged_over
        grads = self.gradients()
        if divisor != 1.0 and grads:
            torch._foreach_div_(grads, divisor)

    def reset(self) -> None:
        """Forget the window: totals, buffers and every `.grad`."""
        self.totals = WindowTotals()
        self.agreed = None
        self._last_input = None
        self.runtime.clear_buffers()
        for param in self.params:
            param.grad = None

    def _grad_divisor(
        self,
        weight: int,
        count: int,
        items: int,
        expected_micro_batches: int,
        window_items: int | None,
    ) -> float:
        """Pick the window's gradient divisor from its first micro-batch.

        Plain means over a batch known up front fold the whole division into each backward, as
        a hand-written loop does (`loss * n_i / B`), so the boundary divides by nothing. Else the
        divisor is the power of two nearest the expected count: summed losses would give fp16
        activation gradients ~count times too large, and scaling by a power of two is exact.
        Ranks must agree on it, so distributed windows size it by items, not this rank's count.
        """
        if self.normalize is Normalize.SUM:
            return 1.0
        if window_items is not None and weight > 1 and not self.distributed:
            return float(window_items)
        first = items if self.distributed or not count else count
        return math.ldexp(1.0, round(math.log2(max(1, first * expected_micro_batches))))


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's parameters that require grad, each once, in registration order.

    Raises:
        ValueError: If the model has no trainable parameter.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no parameter with requires_grad=True; there is nothing "
            "to accumulate. Unfreeze at least one parameter."
        )
    return params


def check_optimizer_holds(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
) -> None:
    """Raise unless `optimizer` is an Optimizer holding some of `params`."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer={optimizer!r} must be a torch.optim.Optimizer.")
    model_ids = {id(p) for p in params}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not model_ids & held:
        raise ValueError(
            "the optimizer holds none of the model's trainable parameters; build it from this "
            "model, e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)."
        )


def accumulate_grad(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: int,
    normalize: Normalize | str = "mean",
) -> LossSum:
    """Fill every `.grad` with the exact full-batch gradient, computed micro-batch by micro-batch.

    Existing gradients are replaced. No optimizer step is taken. On error the previous
    gradients are put back.

    Args:
        model: The model.
        batch: The whole batch (a tensor or nesting of them sharing the leading dimension).
        loss_fn: `loss_fn(model, micro_batch) -> Tensor | LossSum`.
        micro_batch_size: Items per micro-batch.
        normalize: `"mean"` for `sum(value) / sum(count)`, `"sum"` for `sum(value)`.

    Returns:
        `LossSum(value, count)`: the detached summed loss and the total count. With `"mean"`,
        the objective is `value / count`.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> loss = lambda m, x: m(x).pow(2).mean()
        >>> result = accumulate_grad(model, torch.randn(5, 2), loss, micro_batch_size=2)
        >>> model.weight.grad.shape, result.count
        (torch.Size([1, 2]), 5)
    """
    objective = parse(Normalize, normalize, "normalize")
    micro_batches = split_batch(batch, micro_batch_size)
    params = trainable_parameters(model)
    window = Window(model, params, objective, PrecisionRuntime(Precision.FP32, params, None))
    previous = [p.grad for p in params]
    window.reset()
    total_items = batch_size(batch)
    try:
        for index, micro_batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            window.backward(
                micro_batch,
                loss_fn,
                expected_micro_batches=len(micro_batches),
                last=last,
                window_items=total_items,
            )
    except BaseException:
        for param, grad in zip(params, previous, strict=True):
            param.grad = grad
        raise
    totals = window.totals
    if totals.count > 0 or objective is Normalize.SUM:
        window.divide(totals.count)
    assert totals.loss_sum is not None  # split_batch guarantees at least one micro-batch
    return LossSum(totals.loss_sum, totals.count)
