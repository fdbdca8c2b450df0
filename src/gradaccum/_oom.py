"""Telling an out-of-memory error from other errors, and giving memory back after one.

`rng_states`/`set_rng_states` rewind the random number generators for a window rerun smaller
(and for `gradaccum.sizing`'s probes).

Example:
    >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    True
    >>> is_out_of_memory(RuntimeError("shape mismatch"))
    False
"""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from gradaccum.result import PartialStepError

__all__ = [
    "RngStates",
    "rng_states",
    "set_rng_states",
    "MemoryBudgetError",
    "OptimizerStepMemoryError",
    "StepTakenMemoryError",
    "after_step_guard",
    "is_out_of_memory",
    "optimizer_step_guard",
    "release_cached_memory",
]


class RngStates(NamedTuple):
    """The generators' states: Python's, NumPy's, torch's (CPU, the CUDA device), the model's."""

    python: tuple[Any, ...]
    numpy: Any
    devices: list[torch.Tensor]
    held: list[tuple[torch.Generator, torch.Tensor]]


# Older PyTorch raised plain RuntimeErrors; these phrases mark the allocators' messages, and
# cuDNN's and cuBLAS's own word for a failed allocation (CUDNN_/CUBLAS_STATUS_ALLOC_FAILED).
_OOM_PHRASES = (
    "out of memory",
    "can't allocate memory",
    "failed to allocate memory",
    "status_alloc_failed",
)


class MemoryBudgetError(RuntimeError):
    """Even the smallest micro-batch does not fit: automatic sizing gives up instead of looping."""


class OptimizerStepMemoryError(torch.OutOfMemoryError):
    """`optimizer.step()` ran out of memory: its window is not rerun (`optimizer_step_guard`)."""


class StepTakenMemoryError(torch.OutOfMemoryError):
    """Out of memory after the window's step was taken (`after_step_guard`): not rerun either."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocator running out of memory (CUDA, CPU, MPS and older forms).

    False for `OptimizerStepMemoryError`, `StepTakenMemoryError` and `PartialStepError` (which
    may quote one): a window whose step failed, or was taken, is not rerun smaller.
    """
    if isinstance(error, (OptimizerStepMemoryError, StepTakenMemoryError, PartialStepError)):
        return False
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, (RuntimeError, MemoryError)):
        message = str(error).lower()
        return isinstance(error, MemoryError) or any(p in message for p in _OOM_PHRASES)
    return False


@contextlib.contextmanager
def optimizer_step_guard() -> Iterator[None]:
    """Around `optimizer.step()`: out of memory there becomes `OptimizerStepMemoryError`.

    A step that fails may already have updated some parameters or optimizer state (a foreach
    step updates them op by op), and the micro-batch size does not change what it needs, so a
    rerun of the window at a smaller size would step twice for nothing. The error says so.

    Raises:
        OptimizerStepMemoryError: From the allocator's error, which stays its `__cause__`.
    """
    try:
        yield
    except BaseException as error:
        if not is_out_of_memory(error):
            raise
        raise OptimizerStepMemoryError(
            f"optimizer.step() ran out of memory ({error}). The window is not rerun at a smaller "
            "micro-batch size: the step's memory does not depend on it, and the step may already "
            "have updated some parameters or optimizer state. Leave room for the optimizer: a "
            "smaller memory_budget, an optimizer with less state (SGD, bf16 state) or "
            "foreach=False (fewer temporaries); then reload a checkpoint to resume exactly."
        ) from error


@contextlib.contextmanager
def after_step_guard() -> Iterator[None]:
    """Around the work after a window's `optimizer.step()`: out of memory is not rerun there.

    The scheduler's step, the loss scale's update and pooled BatchNorm statistics run once the
    step is committed; automatic sizing rerunning the window smaller would step it twice.

    Raises:
        StepTakenMemoryError: From the allocator's error, which stays its `__cause__`.
    """
    try:
        yield
    except BaseException as error:
        if not is_out_of_memory(error):
            raise
        raise StepTakenMemoryError(
            f"ran out of memory after the optimizer step was taken ({error}). The step is kept "
            "and the window closed, so it is not rerun at a smaller micro-batch size, which would "
            "step twice; the next window runs as usual. Leave more room (a smaller memory_budget)."
        ) from error


def release_cached_memory(device: torch.device) -> None:
    """Free what the failed attempt left: unreachable graphs, then the device's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def rng_states(device: torch.device, held: Sequence[torch.Generator] = ()) -> RngStates:
    """The RNG states a window or a probe may draw from, to rewind them.

    Python's `random` and NumPy's global generator too, and the generators the model holds
    itself (`held`: `gradaccum._rng_state.held_generators`): a `loss_fn` that augments with
    `np.random`, or a diffusion model drawing noise from its own generator, must see the same
    numbers in a rerun (or after a planning probe) as a run at a fixed size would.
    """
    torch_states = [torch.get_rng_state()]
    if device.type == "cuda":
        torch_states.append(torch.cuda.get_rng_state(device))
    own = [(generator, generator.get_state()) for generator in held]
    return RngStates(random.getstate(), np.random.get_state(), torch_states, own)


def set_rng_states(device: torch.device, states: RngStates) -> None:
    """Put back `rng_states(device)`, so a rerun window draws the same dropout masks."""
    random.setstate(states.python)
    np.random.set_state(states.numpy)
    torch.set_rng_state(states.devices[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states.devices[1], device)
    for generator, state in states.held:
        generator.set_state(state)
