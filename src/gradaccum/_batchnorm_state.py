"""Checking and copying a saved BatchNorm state before `BatchNormControl` loads it.

Everything here reads a saved entry and returns fresh tensors on the model's device, or raises
ValueError naming the entry: the control changes nothing until every entry has passed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._pooled_stats import Stats, stat_dtype, tracked
from gradaccum._wrappers import known_name

__all__ = ["RUNNING", "load_calls", "load_start"]

RUNNING = ("running_mean", "running_var", "num_batches_tracked")  # what a "micro" window moves


def load_start(
    start: object, by_name: Mapping[str, _BatchNorm]
) -> list[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """Check and copy a saved window start: `[module name, buffer name, tensor]` entries."""
    resumed = []
    for entry in start if isinstance(start, list) else [start]:
        name, key, tensor = entry if isinstance(entry, list) and len(entry) == 3 else [""] * 3
        name = known_name(name, by_name) if isinstance(name, str) else name  # older: prefixed
        module = by_name.get(name) if isinstance(name, str) else None
        buffer = getattr(module, key, None) if key in RUNNING else None
        if buffer is None or not isinstance(tensor, torch.Tensor) or tensor.shape != buffer.shape:
            raise ValueError(
                f"batchnorm state: the window's start {str(entry)[:80]} is no running "
                "statistic of this model; load the state into the same model."
            )
        resumed.append((name, key, buffer, tensor.to(buffer.device, buffer.dtype).clone()))
    return resumed


def load_calls(name: str, module: _BatchNorm | None, calls: Any) -> list[Stats | None]:
    """Check and copy one module's saved statistics (a list with one entry per call)."""
    if module is None or not tracked(module) or not isinstance(calls, list):
        raise ValueError(f"batchnorm state: {name!r} is no tracked BatchNorm of this model.")
    running_mean = module.running_mean
    assert running_mean is not None  # tracked(module)
    shape = (module.num_features,)
    loaded: list[Stats | None] = []
    for entry in calls:
        if entry is None:
            loaded.append(None)
            continue
        if not isinstance(entry, Mapping):
            raise ValueError(f"batchnorm state: {name!r} holds {type(entry).__name__}, not a dict.")
        mean: Any  # tensors once the shape check below has passed
        m2: Any
        count, mean, m2 = (entry.get(k) for k in ("count", "mean", "m2"))
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in (mean, m2)]
        if not isinstance(count, int) or count < 1 or shapes != [shape, shape]:
            raise ValueError(
                f"batchnorm state: {name!r} needs a count >= 1 and mean, m2 of shape {shape}; "
                f"got count {count!r} and shapes {shapes}."
            )
        device, dtype = running_mean.device, stat_dtype(running_mean.device)
        loaded.append((count, mean.to(device, dtype).clone(), m2.to(device, dtype).clone()))
    return loaded
