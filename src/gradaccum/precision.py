"""Mixed precision under accumulation: autocast, the fp16 GradScaler and fp32 gradient buffers.

`PrecisionRuntime` owns three things for one `Accumulator`:

- the autocast context for forward passes, on the model's own device type;
- for fp16, a `torch.amp.GradScaler` whose scale is fixed inside a window and updated once at the
  boundary (so every micro-batch of a window is scaled alike);
- with `accum_dtype`, higher-precision buffers: after every micro-batch backward the low-precision
  `.grad` is added into its buffer and released, so rounding does not pile up over many steps.

Example:
    >>> import torch
    >>> from gradaccum.options import Precision
    >>> model = torch.nn.Linear(2, 1)
    >>> runtime = PrecisionRuntime(Precision.BF16, list(model.parameters()), accum_dtype=None)
    >>> with runtime.autocast():
    ...     model(torch.ones(1, 2)).dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gradaccum.options import Precision

__all__ = ["PrecisionRuntime"]

_AUTOCAST_DTYPE = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


class PrecisionRuntime:
    """Autocast, loss scaling and gradient buffers for one model.

    Args:
        precision: The autocast mode.
        params: The parameters whose gradients are accumulated.
        accum_dtype: Dtype of accumulation buffers, or None to accumulate in `.grad` directly.
            Buffers are made only for parameters whose dtype is less precise.

    Raises:
        ValueError: If fp16 loss scaling is asked for on fp16 parameters, which GradScaler
            cannot unscale, or `accum_dtype` is not a floating dtype.
    """

    def __init__(
        self,
        precision: Precision,
        params: list[torch.nn.Parameter],
        accum_dtype: torch.dtype | None,
    ) -> None:
        if accum_dtype is not None and (
            not isinstance(accum_dtype, torch.dtype) or not accum_dtype.is_floating_point
        ):
            raise ValueError(
                f"accum_dtype={accum_dtype!r} must be a floating torch.dtype such as "
                "torch.float32, or None."
            )
        self.device = params[0].device
        if precision is Precision.FP16 and any(p.dtype == torch.float16 for p in params):
            raise ValueError(
                "precision='fp16' needs float32 parameters: GradScaler cannot unscale float16 "
                "gradients. Keep the model in float32 (autocast runs the forward in fp16), or use "
                "precision='bf16' with accum_dtype=torch.float32 for low-precision weights."
            )
        self.precision = precision
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if precision is Precision.FP16 else None
        )
        self.buffered = [
            accum_dtype is not None and _less_precise(p.dtype, accum_dtype) for p in params
        ]
        self.accum_dtype = accum_dtype
        self.buffers: list[torch.Tensor | None] = [None] * len(params)
        # Whether any gradient accumulates in a separate higher-precision buffer.
        self.uses_buffers = any(self.buffered)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Return the forward-pass context: autocast for bf16/fp16, nothing for fp32."""
        if self.precision is Precision.FP32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_AUTOCAST_DTYPE[self.precision])

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply `loss` by the fp16 loss scale (fixed for the window); identity otherwise."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def collect(self, params: list[torch.nn.Parameter]) -> None:
        """Move fresh low-precision `.grad` values into their buffers after one backward."""
        if not self.uses_buffers:
            return
        for index, (param, buffered) in enumerate(zip(params, self.buffered, strict=True)):
            if not buffered or param.grad is None:
                continue
            buffer = self.buffers[index]
            if buffer is None:
                self.buffers[index] = param.grad.to(self.accum_dtype)
            else:
                buffer.add_(param.grad)
            param.grad = None

    def gradients(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The tensors that hold the window's accumulated gradients, buffers first-class."""
        if not self.uses_buffers:
            return [p.grad for p in params if p.grad is not None]
        grads = []
        for param, buffered, buffer in zip(params, self.buffered, self.buffers, strict=True):
            grad = buffer if buffered and buffer is not None else param.grad
            if grad is not None:
                grads.append(grad)
        return grads

    def every_gradient(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """One gradient tensor per parameter, zeros where none arrived yet (made in place).

        Ranks reducing gradients by hand must send the same tensors, even for a parameter that
        one rank's micro-batches happened not to reach.
        """
        grads = []
        for index, (param, buffered) in enumerate(zip(params, self.buffered, strict=True)):
            if buffered:
                if self.buffers[index] is None:
                    self.buffers[index] = torch.zeros_like(param, dtype=self.accum_dtype)
                grads.append(self.buffers[index])
            else:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grads.append(param.grad)
        return grads

    def publish(self, params: list[torch.nn.Parameter]) -> None:
        """Write buffered gradients back to `.grad` in each parameter's dtype for the optimizer."""
        if not self.uses_buffers:
            return
        for index, (param, buffered) in enumerate(zip(params, self.buffered, strict=True)):
            buffer = self.buffers[index]
            if buffered and buffer is not None:
                param.grad = buffer.to(param.dtype)
                self.buffers[index] = None

    def back_off(self, *, unscaled: bool) -> None:
        """Lower the fp16 scale exactly once for a non-finite window.

        Args:
            unscaled: Whether `unscale_` ran this window. If it did and found the inf, `update()`
                backs off by itself; if the loss alone was non-finite (finite gradients), or no
                unscale ran, the back-off is applied to the scaler's state directly.
        """
        if self.scaler is None:
            return
        before = self.scaler.state_dict()
        if unscaled:
            self.scaler.update()  # also clears the window's inf records
            if self.scaler.get_scale() < before["scale"]:
                return
        before["scale"] = before["scale"] * before["backoff_factor"]
        before["_growth_tracker"] = 0
        self.scaler.load_state_dict(before)

    def clear_buffers(self) -> None:
        """Drop every buffer (end of a window, or a discarded window)."""
        self.buffers = [None] * len(self.buffers)

    @contextlib.contextmanager
    def stashed(self) -> Iterator[None]:
        """Set the buffers aside for a block and put them back if it raises."""
        saved = self.buffers
        self.buffers = [None] * len(saved)
        try:
            yield
        except BaseException:
            self.buffers = saved
            raise


def _less_precise(dtype: torch.dtype, accum_dtype: torch.dtype) -> bool:
    return torch.finfo(dtype).eps > torch.finfo(accum_dtype).eps
