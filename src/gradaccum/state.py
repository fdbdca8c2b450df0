"""Saving and restoring an `Accumulator` mid-window.

The state is plain data that `torch.load(weights_only=True)` accepts: tensors, numbers, strings,
lists and dicts. It holds the partial gradients (or the higher-precision buffers), the window's
running totals, the GradScaler state and the settings that must match on resume. Loading checks
everything first and changes nothing when something does not match.

Example:
    >>> import torch
    >>> from gradaccum import Accumulator
    >>> model = torch.nn.Linear(2, 1)
    >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    >>> _ = acc.micro_step(torch.randn(3, 2), lambda m, x: m(x).pow(2).mean())
    >>> state = acc.state_dict()
    >>> state["window"]["micro_batches"], state["window"]["count"]
    (1, 3)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gradaccum.window import WindowTotals

if TYPE_CHECKING:
    from gradaccum.accumulator import Accumulator

__all__ = ["STATE_VERSION", "accumulator_state", "load_accumulator_state"]

STATE_VERSION = 1
# Settings that change what a saved partial window means; they must match on resume.
_MUST_MATCH = (
    "accumulation_steps",
    "micro_batch_size",
    "normalize",
    "precision",
    "accum_dtype",
    "batchnorm_mode",
)
_ADDED_LATER = {"batchnorm_mode": "micro"}  # what a state saved before the setting existed meant


def accumulator_state(acc: Accumulator) -> dict[str, Any]:
    """Snapshot `acc` (copies, so later training does not change the snapshot)."""
    window, runtime = acc._window, acc._runtime
    totals = window.totals
    return {
        "version": STATE_VERSION,
        "accumulation_steps": acc.accumulation_steps,
        "micro_batch_size": acc.micro_batch_size,
        "normalize": acc.normalize.value,
        "precision": acc.precision.value,
        "accum_dtype": _dtype_name(runtime.accum_dtype),
        "batchnorm_mode": acc._batchnorm.mode.value,
        "param_shapes": [list(p.shape) for p in window.params],
        "window": {
            "count": totals.count,
            "micro_batches": totals.micro_batches,
            "loss_sum": _copy(totals.loss_sum),
            "grad_divisor": totals.grad_divisor,
            "largest_micro_batch": totals.largest_micro_batch,
        },
        "grads": [_copy(p.grad) for p in window.params],
        "buffers": [_copy(b) for b in runtime.buffers],
        "scaler": None if runtime.scaler is None else runtime.scaler.state_dict(),
        "nonfinite_windows": acc.nonfinite_windows,
        "empty_windows": acc.empty_windows,
        "auto": None if acc._auto is None else acc._auto.state_dict(),
        "batchnorm": acc._batchnorm.state_dict(),
    }


def load_accumulator_state(acc: Accumulator, state: dict[str, Any]) -> None:
    """Restore `acc` from `accumulator_state` output; raise ValueError before any change."""
    _check_compatible(acc, state)
    if state.get("batchnorm") is not None:
        acc._batchnorm.load_state_dict(state["batchnorm"])  # checks first, raises changing nothing
    window, runtime = acc._window, acc._runtime
    saved = state["window"]
    # Cloned: the window adds into loss_sum in place, which must not reach the caller's state.
    loss_sum = None if saved["loss_sum"] is None else saved["loss_sum"].to(runtime.device).clone()
    window.totals = WindowTotals(
        count=int(saved["count"]),
        micro_batches=int(saved["micro_batches"]),
        loss_sum=loss_sum,
        grad_divisor=saved["grad_divisor"],
        largest_micro_batch=int(saved["largest_micro_batch"]),
    )
    for param, grad in zip(window.params, state["grads"], strict=True):
        param.grad = None if grad is None else grad.to(param.device, param.dtype).clone()
    runtime.buffers = [
        None if b is None else b.to(runtime.device, runtime.accum_dtype).clone()
        for b in state["buffers"]
    ]
    if runtime.scaler is not None and state["scaler"]:
        runtime.scaler.load_state_dict(state["scaler"])
    acc.nonfinite_windows = int(state["nonfinite_windows"])
    acc.empty_windows = int(state["empty_windows"])
    if acc._auto is not None and state.get("auto") is not None:
        acc._auto.load_state_dict(state["auto"])


def _check_compatible(acc: Accumulator, state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or "version" not in state:
        raise ValueError("not an Accumulator state: pass what Accumulator.state_dict() returned.")
    if state["version"] != STATE_VERSION:
        raise ValueError(
            f"Accumulator state version {state['version']!r} is not supported; this gradaccum "
            f"reads version {STATE_VERSION}."
        )
    current = accumulator_settings(acc)
    for name in _MUST_MATCH:
        saved = state.get(name, _ADDED_LATER.get(name))
        if saved != current[name]:
            raise ValueError(
                f"the saved Accumulator has {name}={saved!r} but this one has "
                f"{name}={current[name]!r}; build the Accumulator with the saved settings."
            )
    shapes = [list(p.shape) for p in acc._window.params]
    if state["param_shapes"] != shapes:
        raise ValueError(
            f"the saved Accumulator tracked {len(state['param_shapes'])} parameters with shapes "
            f"{state['param_shapes']}, this model has {len(shapes)} with shapes {shapes}; load it "
            "into the same model architecture."
        )
    if len(state["buffers"]) != len(acc._runtime.buffers):
        raise ValueError("the saved accumulation buffers do not match this model's parameters.")


def accumulator_settings(acc: Accumulator) -> dict[str, Any]:
    """The settings a saved state must agree with."""
    return {
        "accumulation_steps": acc.accumulation_steps,
        "micro_batch_size": acc.micro_batch_size,
        "normalize": acc.normalize.value,
        "precision": acc.precision.value,
        "accum_dtype": _dtype_name(acc._runtime.accum_dtype),
        "batchnorm_mode": acc._batchnorm.mode.value,
    }


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype)


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().clone()
