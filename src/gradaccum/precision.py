"""Mixed precision under accumulation: autocast, the fp16 loss scale and fp32 gradient buffers.

`PrecisionRuntime` owns three things for one `Accumulator`:

- the autocast context for forward passes, on the model's own device type;
- for fp16, the loss scale: read from a `torch.amp.GradScaler` when a window opens, fixed for the
  whole window, folded into the window's one division (`gradaccum.divisor`) and updated once at
  the boundary with GradScaler's own rule (back off on a non-finite window, grow after
  `growth_interval` finite ones). The scaler object holds the state, so `acc.scaler` reads as
  usual; nothing here calls `scaler.unscale_`, whose bookkeeping could not be rolled back;
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
import math
from collections.abc import Sequence
from typing import Any

import torch

from gradaccum._dtensor import like_param
from gradaccum._scaler import AccumulatorScaler
from gradaccum._state_layout import check_tensors_fit
from gradaccum._warnings import warn_user
from gradaccum.options import Precision

__all__ = ["PrecisionRuntime", "warn_if_ignored"]

_NO_CONTEXT = contextlib.nullcontext()  # stateless: one instance serves every `with`

_AUTOCAST_DTYPE = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}

# Dtypes autocast never casts: a model holding only these computes as if it were off.
_WIDE = (torch.float64, torch.complex128)


def warn_if_ignored(precision: Precision, params: Sequence[torch.Tensor]) -> None:
    """Warn if bf16/fp16 is asked for on parameters that are all float64 (autocast ignores them).

    The run goes on, in float64: refusing would break a config that sets the precision once for
    models of several dtypes.
    """
    if precision is Precision.FP32 or not all(p.dtype in _WIDE for p in params):
        return
    scale = (
        "; the fp16 loss scale guards no overflow there, it only grows"
        if precision is Precision.FP16
        else ""
    )
    message = (
        f"precision='{precision.value}' has no effect on this model: its parameters are all "
        "float64, and autocast leaves float64 computations alone, so the forward and backward "
        f"run in float64 (exact, without the speed or memory of mixed precision){scale}. Cast "
        "the model to float32 first (model.float()) to train in mixed precision, or pass "
        "precision='fp32'."
    )
    warn_user(UserWarning(message))


class PrecisionRuntime:
    """Autocast, the loss scale and gradient buffers for one model.

    Args:
        precision: The autocast mode.
        params: The model's trainable parameters, then any other the optimizer holds (the
            first one's device; the dtype check).
        accum_dtype: Dtype of accumulation buffers, or None to accumulate in `.grad` directly.
            Buffers are made only for parameters whose dtype is less precise.

    Raises:
        ValueError: If fp16 loss scaling is asked for on fp16 parameters, or `accum_dtype` is
            not a floating dtype or spans less than a parameter it would buffer (float16 for
            bfloat16 weights).
    """

    def __init__(
        self,
        precision: Precision,
        params: Sequence[torch.nn.Parameter],
        accum_dtype: torch.dtype | None,
    ) -> None:
        if accum_dtype is not None and (
            not isinstance(accum_dtype, torch.dtype) or not accum_dtype.is_floating_point
        ):
            raise ValueError(
                f"accum_dtype={accum_dtype!r} must be a floating torch.dtype such as "
                "torch.float32, or None."
            )
        self.device, self._anchor = params[0].device, params[0]  # moved since? (check_dtypes)
        self.precision = precision
        self.accum_dtype = accum_dtype
        self._buffered_dtypes: dict[torch.dtype, bool] = {}
        self.check_dtypes(params, built=False)
        self.scaler = AccumulatorScaler(self.device.type) if precision is Precision.FP16 else None
        self.buffers: list[torch.Tensor | None] = []
        # The caller's own fp16 autocast: warned of once, where it casts anything (not float64).
        self._outer_warned = all(p.dtype in _WIDE for p in params)
        # Whether any parameter of this model accumulates in a separate higher-precision buffer.
        self.uses_buffers = any(self.buffered(p) for p in params)

    def buffered(self, param: torch.Tensor) -> bool:
        """Whether `param`'s gradient accumulates in a higher-precision buffer.

        Only where the buffer's dtype is more precise and spans the parameter's whole range.
        """
        known = self._buffered_dtypes.get(param.dtype)  # asked per parameter per micro-batch
        if known is None:
            known = self._more_precise(param) and self._wide_enough(param)
            self._buffered_dtypes[param.dtype] = known
        return known

    def _more_precise(self, param: torch.Tensor) -> bool:
        return (
            self.accum_dtype is not None
            and param.dtype.is_floating_point
            and torch.finfo(param.dtype).eps > torch.finfo(self.accum_dtype).eps
        )

    def _wide_enough(self, param: torch.Tensor) -> bool:
        assert self.accum_dtype is not None
        mine, theirs = torch.finfo(self.accum_dtype), torch.finfo(param.dtype)
        return mine.max >= theirs.max and mine.tiny <= theirs.tiny

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Return the forward-pass context: autocast for bf16/fp16, nothing for fp32."""
        if self.precision is Precision.FP32:
            return _NO_CONTEXT
        return torch.autocast(self.device.type, dtype=_AUTOCAST_DTYPE[self.precision])

    def loss_scale(self) -> float:
        """The fp16 loss scale a window opening now uses (1.0 without fp16)."""
        return 1.0 if self.scaler is None else float(self.scaler.get_scale())

    def open_window(
        self, param_count: int, params: Sequence[torch.nn.Parameter] | None = None
    ) -> None:
        """Start a window over `param_count` parameters: no buffer yet.

        With `params` (the window's, read when it opens) and an `accum_dtype`, whether any of
        them needs a buffer is decided again: one unfrozen or added to the optimizer since.
        Without, the decision stands (FSDP2 deferring its sums to the window's last backward
        cannot feed buffers: `check_fsdp_support` refused them at construction).
        """
        if params is not None:  # cast since the last window (model.half()): refused, unchanged
            self.check_dtypes(params, built=True)
        self.buffers = [None] * param_count
        self._check_outer_autocast()
        if params is not None and self.accum_dtype is not None:
            self.uses_buffers = any(self.buffered(p) for p in params)

    def check_dtypes(self, params: Sequence[torch.nn.Parameter], *, built: bool) -> None:
        """Refuse parameters whose dtype this precision and `accum_dtype` cannot serve, or moved.

        Checked at construction and again when each window opens (and a state loads): a model
        cast after the Accumulator was built (`model.half()`, `model.to(torch.bfloat16)`) is
        refused as it would have been at construction, before anything changes. Before, an fp16
        loss scale on float16 gradients skipped window after window, and `accum_dtype` buffers
        narrower than the parameters were silently not used.
        """
        since = " (the model was cast after the Accumulator was built)" if built else ""
        if self._anchor.device != self.device:  # batches, autocast, loss scale: built's device
            raise ValueError(
                f"the model moved to {self._anchor.device} after the Accumulator was built (on "
                f"{self.device}): micro-batches would be moved to {self.device} and autocast "
                f"run there. Build the Accumulator after model.to(device) (a new "
                f"Accumulator(model, optimizer, ...) now), or move the model back. Nothing was "
                "changed."
            )
        if self.precision is Precision.FP16 and any(p.dtype == torch.float16 for p in params):
            raise ValueError(
                f"precision='fp16' needs float32 parameters{since}: a loss scale cannot be kept "
                "in float16 gradients. Keep the model in float32 (autocast runs the forward in "
                "fp16), or use precision='bf16' with accum_dtype=torch.float32 for low-precision "
                "weights."
            )
        accum_dtype = self.accum_dtype
        if accum_dtype is None:  # the usual case: no Python step per parameter
            return
        narrower = [p.dtype for p in params if self._more_precise(p) and not self._wide_enough(p)]
        if narrower:
            raise ValueError(
                f"accum_dtype={accum_dtype} cannot hold {narrower[0]} gradients{since}: its range "
                f"is narrower (largest {torch.finfo(accum_dtype).max:.0f}), so large sums "
                "overflow and small gradients flush to 0. Use accum_dtype=torch.float32."
            )

    def _check_outer_autocast(self) -> None:
        """Warn once if the caller's own fp16 autocast wraps a window that no loss scale guards.

        Under "fp32" the caller's autocast reaches the forward (bf16 and fp16 open their own,
        which takes over): in float16 without a loss scale, small gradients flush to 0, silently.
        """
        kind = self.device.type
        if self._outer_warned or self.precision is not Precision.FP32:
            return
        if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.float16:
            self._outer_warned = True
            warn_user(
                UserWarning(
                    f"an fp16 autocast of your own ({kind}) is active around the Accumulator, "
                    "built with precision='fp32': the forward runs in float16 with no loss scale, "
                    "so small gradients flush to 0 (a plain loop needs its GradScaler for this). "
                    "Pass precision='fp16' (gradaccum's autocast and loss scale) and drop your "
                    "autocast; a bf16 autocast needs no loss scale."
                )
            )

    def collect(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Move fresh low-precision `.grad` values into their buffers after one backward."""
        if not self.uses_buffers:
            return
        for index, param in enumerate(params):
            if param.grad is None or not self._keeps(index, param):
                continue
            buffer = self.buffers[index]
            if buffer is None:
                self.buffers[index] = param.grad.to(self.accum_dtype)
            else:
                buffer.add_(param.grad)
            param.grad = None

    def _keeps(self, index: int, param: torch.nn.Parameter) -> bool:
        """Whether `param`'s window gradient lives in a buffer: one of its dtype, or held.

        A buffer already held stays the holder when the model is cast mid-window (bf16 weights
        made float32 by `model.float()` between two `micro_step()` calls): the later
        micro-batches' `.grad` were kept apart from it and overwritten by it at the boundary
        (the earlier micro-batches alone were stepped, 0.36 off, silently).
        """
        return self.buffered(param) or (
            index < len(self.buffers) and self.buffers[index] is not None
        )

    def gradient(self, index: int, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The tensor holding `param`'s accumulated gradient: its buffer, else its `.grad`."""
        if self.uses_buffers and self.buffers[index] is not None:
            return self.buffers[index]
        return param.grad

    def widened(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """`grad` in the accumulation dtype where buffers are kept for its dtype, else as is."""
        if grad is None or self.accum_dtype is None or not self.buffered(grad):
            return grad
        return grad.to(self.accum_dtype)

    def hold(self, index: int, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Make `grad` (in the accumulation dtype where buffered) `param`'s gradient holder."""
        if self._keeps(index, param):
            self.buffers[index] = grad
        else:
            param.grad = grad

    def zeros_for(self, index: int, param: torch.nn.Parameter) -> torch.Tensor:
        """Make (and hold) a zero gradient for `param`, where another rank has one."""
        if self.buffered(param):
            zeros = torch.zeros_like(param, dtype=self.accum_dtype)
            self.buffers[index] = zeros
            return zeros
        param.grad = torch.zeros_like(param)
        return param.grad

    def publish(
        self,
        params: Sequence[torch.nn.Parameter],
        norm: float = 0.0,
        max_norm: float | None = None,
        held: int | None = None,
    ) -> bool:
        """Write buffered gradients back to `.grad` in each parameter's dtype, for the step.

        A buffer's finite sum can exceed a float16 parameter's range (65504) and become inf in
        its `.grad`. A window total `norm` (after clipping to `max_norm`) below half the
        narrowest such range rules that out without looking; otherwise the written gradients
        of the first `held` parameters (the optimizer's; default all) are checked.

        Returns:
            False if a written gradient is not finite (the window must be skipped).
        """
        if not self.uses_buffers:
            return True
        written: list[torch.Tensor] = []
        narrowest = math.inf
        for index, param in enumerate(params):
            buffer = self.buffers[index]
            if buffer is not None:
                param.grad = buffer.to(param.dtype)
                if held is None or index < held:
                    written.append(param.grad)
                    narrowest = min(narrowest, torch.finfo(param.dtype).max)
                self.buffers[index] = None
        bound = norm if max_norm is None else min(norm, max_norm)
        if bound < narrowest / 2:
            return True
        return all(bool(torch.isfinite(grad).all()) for grad in written)

    def clear_buffers(self) -> None:
        """Drop every buffer (the window closed, or was forgotten)."""
        self.buffers = [None] * len(self.buffers)

    def update_scale(self, *, finite: bool) -> None:
        """Update the loss scale once per closed window, by GradScaler's own rule.

        torch's own kernel, on a float32 scale as GradScaler keeps it: factors that are not
        powers of two round as they do there, and a growth that would overflow float32 is not
        taken (in Python floats the scale grew to 2**128, which overflows every loss it scales).
        """
        if self.scaler is None:
            return
        state = self.scaler.state_dict()
        scale = torch.full((1,), state["scale"], dtype=torch.float32)
        tracker = torch.full((1,), state["_growth_tracker"], dtype=torch.int32)
        torch._amp_update_scale_(
            scale,
            tracker,
            torch.full((1,), 0.0 if finite else 1.0, dtype=torch.float32),
            state["growth_factor"],
            state["backoff_factor"],
            state["growth_interval"],
        )
        state["scale"], state["_growth_tracker"] = scale.item(), int(tracker.item())
        self.scaler.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """The scaler state and copies of the buffers (plain data for weights-only loading).

        No buffer held (a closed window) saves an empty list, whatever windows came before.
        """
        held = any(b is not None for b in self.buffers)
        return {
            "accum_dtype": None if self.accum_dtype is None else str(self.accum_dtype),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "buffers": [None if b is None else b.detach().clone() for b in self.buffers]
            if held
            else [],
        }

    def check_state(self, state: dict[str, Any], params: Sequence[torch.nn.Parameter]) -> None:
        """Raise ValueError if `state` does not fit this runtime and `params`; change nothing."""
        self.check_dtypes(params, built=True)
        mine = None if self.accum_dtype is None else str(self.accum_dtype)
        if state.get("accum_dtype") != mine:
            raise ValueError(
                f"the saved Accumulator has accum_dtype={state.get('accum_dtype')!r} but this "
                f"one has accum_dtype={mine!r}; build the Accumulator with the saved settings."
            )
        buffers = state.get("buffers")
        if not isinstance(buffers, list):
            raise ValueError("the saved accumulation buffers do not match this model's parameters.")
        if buffers:  # none held: a closed window, or no accum_dtype
            check_tensors_fit(buffers, params, "accumulation buffers")
            # A buffer for a parameter that needs none here (its dtype changed since the save)
            # would never be read: the window's earlier micro-batches would be lost, silently.
            stray = [
                i for i, b in enumerate(buffers) if b is not None and not self.buffered(params[i])
            ]
            if stray:
                raise ValueError(
                    f"the saved Accumulator holds {mine} accumulation buffers for parameter "
                    f"{stray[0]} ({len(stray)} in all), which is {params[stray[0]].dtype} here and "
                    "needs none: the model's dtype changed since this window was saved, and its "
                    "earlier micro-batches would be lost. Load the state into the model in its "
                    "saved dtype (e.g. model.to(torch.bfloat16)), or save between windows."
                )

    def load_state_dict(
        self, state: dict[str, Any], params: Sequence[torch.nn.Parameter] = ()
    ) -> None:
        """Restore `state_dict()` output (call `check_state` first); buffers shaped as `params`."""
        buffers = state["buffers"]
        owners = list(params) if len(params) == len(buffers) else [None] * len(buffers)
        self.buffers = [
            None
            if b is None
            else (
                like_param(b, owner, self.accum_dtype)
                if owner is not None
                else b.to(self.device, self.accum_dtype)
            ).clone()
            for b, owner in zip(buffers, owners, strict=True)
        ]
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
