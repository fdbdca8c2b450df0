"""Snapshots of training state and bitwise comparison, for "nothing changed" assertions."""

from __future__ import annotations

import copy
from typing import Any

import torch


def clone_state(value: Any) -> Any:
    """A deep copy of nested dicts/lists/tuples of tensors, tensors detached and cloned."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_state(v) for v in value)
    return copy.deepcopy(value)


def assert_bitwise(a: Any, b: Any) -> None:
    """Assert two nested states are equal to the bit: same dtypes, `torch.equal` tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bitwise(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bitwise(x, y)
    else:
        assert a == b
