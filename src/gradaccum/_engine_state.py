"""The engine's saved state (`Engine.state_dict()`), and restoring it: check all, then load.

Every check runs before anything changes, so a refused state leaves the window, the precision
runtime (fp32 buffers, loss scale) and the BatchNorm control as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradaccum._buffer_watch import BufferWatch
from gradaccum._spoiled_save import refuse_spoiled_save
from gradaccum._sync_base import GradSync
from gradaccum.batchnorm import BatchNormControl
from gradaccum.precision import PrecisionRuntime
from gradaccum.window import Window

__all__ = ["component_states", "restore_components"]


def component_states(
    names: dict[int, str],
    window: Window,
    runtime: PrecisionRuntime,
    batchnorm: BatchNormControl,
    sync: GradSync,
    buffers: BufferWatch,
) -> dict[str, Any]:
    """What `Engine.state_dict()` returns: each component's own state, and whose window it is.

    An open window spoiled since its last micro-batch (weights written, gradients zeroed) is
    refused first, nothing saved (`_spoiled_save`).
    """
    refuse_spoiled_save(window, names)  # named by `names` (parameter id -> name)
    return {
        "buffers": buffers.state_dict(),  # the open window's start of the forward's buffers
        "window": window.state_dict(),
        "precision": runtime.state_dict(),
        "batchnorm_mode": batchnorm.mode.value,
        "batchnorm": batchnorm.state_dict(),
        "origin": [sync.rank, sync.world],  # whose open window this is
    }


def restore_components(
    state: dict[str, Any],
    window: Window,
    runtime: PrecisionRuntime,
    batchnorm: BatchNormControl,
    sync: GradSync,
    buffers: BufferWatch,
    *,
    params: list[torch.nn.Parameter],
    held: int,
    end: Callable[[], None],
) -> None:
    """Check `state` against every component, then load it; raise ValueError changing nothing.

    Args:
        state: What `Engine.state_dict()` returned.
        window: Receives the saved window (its partial gradients go to `params`).
        runtime: Receives the loss scale and fp32 buffers.
        batchnorm: Receives the BatchNorm state; its mode must match.
        sync: Refuses a window that cannot continue here (another rank's, a static graph's).
        buffers: Checks the saved start of the forward-updated buffers.
        params: The window's parameters; the first `held` are the optimizer's.
        held: How many of `params` the optimizer holds.
        end: Ends the engine's own window (dropping the buffers' copies of it), once loaded.
    """
    batchnorm.check_mode(state.get("batchnorm_mode"))
    sync.check_resume(bool(state["window"].get("micro_batches")), state.get("origin"))
    window.check_state(state["window"], params)
    runtime.check_state(state["precision"], params)
    start = buffers.check_state(state.get("buffers"))  # absent from older states
    batchnorm.load_state_dict(state["batchnorm"])  # checks, then loads
    window.load_state_dict(state["window"], params, held)
    runtime.open_window(len(params), params)
    runtime.load_state_dict(state["precision"], params)
    if len(runtime.buffers) != len(params):
        runtime.open_window(len(params), params)
    batchnorm.resume_window(window.is_open)
    end()
    buffers.resume(start, window.is_open)  # after `end()`: the loaded window's start
