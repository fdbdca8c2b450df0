"""Gradient norms and clipping on plain gradient tensors.

`torch.nn.utils.clip_grad_norm_` works on parameters; the accumulator also clips its
higher-precision buffers, which belong to no parameter, so both operations take tensors here. The
arithmetic is `clip_grad_norm_`'s: the same total norm, the same `max_norm / (norm + 1e-6)`
coefficient clamped at 1, so a clipped step equals a plain full-batch step with `clip_grad_norm_`.
One exception: float16 gradients, each finite, whose norm passes float16's largest value (65504;
a pure `model.half()` run, 200 per item over 4096 weights) get their norm in float32, where
`clip_grad_norm_` returns inf and scales every gradient by 0 (the window was skipped as
non-finite, its message blaming the loss, which was finite).

Example:
    >>> import torch
    >>> grads = [torch.full((3,), 10.0)]
    >>> norm = total_norm(grads)
    >>> clip_(grads, 1.0, norm)
    >>> round(float(total_norm(grads)), 4)
    1.0
"""

from __future__ import annotations

import operator

import torch

from gradaccum import _compat

__all__ = ["clip_", "split_kinds", "total_norm"]

_DEVICE_AND_DTYPE = operator.attrgetter("device", "dtype")


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together, as `clip_grad_norm_` computes it.

    One fused per-tensor norm and one norm of those; tensors of several devices or dtypes take
    torch's general (grouping) path; FSDP2 shards and plain tensors, one norm per kind.
    """
    if not grads:
        return torch.zeros(())
    kinds = split_kinds(grads)
    if len(kinds) > 1:  # FSDP2 shards and plain (replicated) gradients: one norm of both norms
        norms = [total_norm(kind) for kind in kinds]
        whole = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
        both: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(whole[0]) for n in whole]))
        return both
    kinds_of = set(map(_DEVICE_AND_DTYPE, grads))  # no Python frame per gradient
    if len(kinds_of) > 1:
        norm = _compat.total_norm(grads)
    else:  # torch.linalg has no stubs (its functions are Any): name the result's type.
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if type(norm) is torch.Tensor and any(dtype == torch.float16 for _, dtype in kinds_of):
        return _float32_if_overflowed(grads, norm)  # plain tensors: FSDP2 shards' norms wait
    return norm


def _float32_if_overflowed(grads: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
    """`norm`, or, where it overflowed float16's range, the float32 norm of the same gradients.

    A device sync (float16 gradients only: the boundary reads the norm right after anyway). A
    gradient holding an inf or NaN keeps the float32 norm non-finite: a skipped window still.
    """
    if bool(torch.isfinite(norm)):
        return norm
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    wide: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(norms[0]) for n in norms]))
    return wide


def clip_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients to `max_norm` as `clip_grad_norm_` does, on tensors, not parameters.

    It works on the fp32 accumulation buffers too, which are not any parameter's `.grad`.
    """
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for kind in split_kinds(grads):
        torch._foreach_mul_(kind, coefficient.to(kind[0].device))


def split_kinds(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` as one list per type: DTensors (FSDP2 shards) and plain tensors.

    A foreach op refuses a list that mixes them (an optimizer holding FSDP2 parameters and one
    outside the sharded model, a learnable loss weight); each kind takes its own op.
    """
    if len(set(map(type, tensors))) <= 1:  # the usual case, without a Python frame per tensor
        return [tensors] if tensors else []
    kinds: dict[type, list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault(type(tensor), []).append(tensor)
    return list(kinds.values())
