"""The model inside `torch.compile`, DDP and DataParallel wrappers, and names relative to it.

A wrapper prefixes every module name (`_orig_mod.` for `torch.compile`, `module.` for DDP and
DataParallel). Whatever names a module in a saved state (a checkpoint's weights, an Accumulator's
BatchNorm statistics and watched buffers) is taken from the module inside, so a state saved with
the model wrapped loads into it unwrapped, and the other way round.

Example:
    >>> net = torch.nn.Sequential(torch.nn.BatchNorm1d(3))
    >>> unwrapped(torch.nn.DataParallel(net)) is net
    True
    >>> known_name("module._orig_mod.0", {"0": net[0]})
    '0'
"""

from __future__ import annotations

from collections.abc import Container

import torch

__all__ = ["WRAPPER_PREFIXES", "known_name", "unwrapped"]

WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside `torch.compile`, DDP and DataParallel wrappers (any nesting of them)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), torch.nn.Module):
            model = inner  # torch.compile's OptimizedModule
        else:
            return model


def known_name(name: str, known: Container[str]) -> str:
    """`name` as `known` has it: wrapper prefixes taken off while it is not found.

    States saved before names were taken inside the wrappers carry their prefixes; a name
    found nowhere comes back as it was, for the caller's error to quote.
    """
    found = name
    while found not in known:
        prefix = next((p for p in WRAPPER_PREFIXES if found.startswith(p)), None)
        if prefix is None:
            return name
        found = found[len(prefix) :]
    return found
