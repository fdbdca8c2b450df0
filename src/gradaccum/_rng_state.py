"""The RNG states a checkpoint holds: capturing, checking and restoring them.

`capture_rng` reads the states of Python (`random`), NumPy (`np.random`) and torch (CPU, and CUDA
when available) into plain data that `torch.load(weights_only=True)` accepts. `checked_rng` tries
each saved state on a fresh generator, leaving the global ones untouched, and returns `RngStates`,
whose `restore()` sets the global generators. `gradaccum.checkpoint` turns a failed check into a
`CheckpointError`. `held_generators` finds the generators a model holds itself, which no
checkpoint holds and which check_equivalence, planning and out-of-memory reruns fork.

Example:
    >>> import random
    >>> states = checked_rng(capture_rng())
    >>> first = random.random()
    >>> states.restore()
    >>> random.random() == first
    True
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RngStates", "capture_rng", "checked_rng", "held_generators"]


def capture_rng() -> dict[str, Any]:
    """The current Python, NumPy, torch CPU and (when available) CUDA RNG states, as plain data."""
    numpy_state = np.random.get_state(legacy=True)
    if not isinstance(numpy_state, tuple):  # never with legacy=True; narrows the type
        raise TypeError("np.random.get_state(legacy=True) returned no tuple")
    kind, keys, position, has_gauss, gauss = numpy_state
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@dataclass(frozen=True)
class RngStates:
    """Saved RNG states, already checked: `restore()` sets the global generators to them."""

    python_state: tuple[Any, ...]
    numpy_state: tuple[Any, ...]
    cpu_state: torch.Tensor
    cuda_states: list[torch.Tensor]

    def restore(self) -> None:
        """Set the global Python, NumPy, torch CPU and CUDA generators to these states."""
        random.setstate(self.python_state)
        np.random.set_state(self.numpy_state)
        torch.set_rng_state(self.cpu_state)
        if self.cuda_states and torch.cuda.is_available():
            for device, state in enumerate(self.cuda_states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, device)


def checked_rng(state: dict[str, Any]) -> RngStates:
    """The saved RNG states, each tried on a fresh generator (the global ones stay untouched).

    Raises:
        Exception: Whatever a damaged state makes the generators (or the unpacking) raise; a
            CUDA state that is not a uint8 tensor raises `TypeError`.
    """
    version, internal, gauss = state["python"]
    python = (version, tuple(internal), gauss)
    random.Random().setstate(python)
    saved = state["numpy"]
    numpy = (
        saved["kind"],
        saved["keys"].cpu().numpy().astype(np.uint32),  # cpu(): a load may map it elsewhere
        saved["position"],
        saved["has_gauss"],
        saved["gauss"],
    )
    np.random.RandomState().set_state(numpy)
    cpu = state["torch"].cpu()
    torch.Generator().set_state(cpu)
    cuda = list(state.get("cuda") or [])
    for device_state in cuda:
        if not isinstance(device_state, torch.Tensor) or device_state.dtype != torch.uint8:
            raise TypeError("a CUDA RNG state is not a uint8 tensor")
    cuda = [device_state.cpu() for device_state in cuda]  # set_rng_state takes CPU tensors
    return RngStates(python, numpy, cpu, cuda)


def held_generators(model: torch.nn.Module) -> list[torch.Generator]:
    """The `torch.Generator`s the model's modules hold as attributes (`self.generator`).

    A diffusion model drawing its noise from its own generator leaves the global ones alone.
    """
    return [
        value
        for module in model.modules()
        for value in vars(module).values()
        if isinstance(value, torch.Generator)
    ]
