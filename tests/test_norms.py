"""Tests for gradaccum.norms: the total norm and clipping on plain gradient tensors.

The reference is torch's own `clip_grad_norm_` on parameters holding the same gradients: a
clipped window must equal a plain full-batch step with `clip_grad_norm_`.
"""

from __future__ import annotations

import pytest
import torch

from gradaccum.norms import clip_, total_norm


def _grads(dtype: torch.dtype, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (3,), (2, 2, 5), (1,)]
    return [torch.randn(s, generator=generator, dtype=dtype) * scale for s in shapes]


def _params_holding(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_total_norm_is_clip_grad_norms_total_norm(dtype: torch.dtype) -> None:
    grads = _grads(dtype)
    expected = torch.nn.utils.clip_grad_norm_(_params_holding(grads), max_norm=float("inf"))
    assert torch.equal(total_norm(grads), expected)
    # Negative control: the sum of the per-tensor norms is not the total norm.
    per_tensor = sum(float(g.norm()) for g in grads)
    assert abs(per_tensor - float(expected)) > 1e-3 * float(expected)


def test_total_norm_of_mixed_dtypes_takes_torchs_grouping_path() -> None:
    grads = _grads(torch.float64)
    grads[1] = grads[1].float()
    expected = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))
    torch.testing.assert_close(total_norm(grads).double(), expected, rtol=1e-6, atol=0)


def test_total_norm_of_nothing_is_zero() -> None:
    assert float(total_norm([])) == 0.0


@pytest.mark.parametrize("scale", [0.01, 100.0])
def test_clip_scales_exactly_as_clip_grad_norm(scale: float) -> None:
    """Below the threshold the coefficient clamps at 1; above, it is max_norm / (norm + 1e-6)."""
    grads = _grads(torch.float64, scale)
    params = _params_holding(grads)
    torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    clip_(grads, 1.0, total_norm(grads))
    for grad, param in zip(grads, params, strict=True):
        assert param.grad is not None
        assert torch.equal(grad, param.grad)


def test_clipping_each_tensor_alone_is_not_clipping_the_total() -> None:
    """Negative control for the test above: per-tensor clipping gives other gradients."""
    grads = _grads(torch.float64, 100.0)
    alone = [g.clone() for g in grads]
    clip_(grads, 1.0, total_norm(grads))
    for tensor in alone:
        clip_([tensor], 1.0, total_norm([tensor]))
    assert not all(torch.allclose(a, b) for a, b in zip(alone, grads, strict=True))
