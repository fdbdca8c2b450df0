"""Activation checkpointing (`torch.utils.checkpoint`) inside a model driven by the Accumulator.

Reentrant checkpointing whose inputs require no grad (the raw batch) returns an output without a
graph, and torch only warns: "None of the inputs have requires_grad=True. Gradients will be
None". When every trainable layer is inside it, the loss has no graph; the Accumulator refused
it listing torch.no_grad(), detach and frozen parameters, none of which the user wrote.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradaccum import Accumulator
from tests.state import assert_bitwise


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=self.reentrant)  # x: the raw batch


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(10, 5, generator=generator, dtype=torch.float64), torch.arange(10) % 3


@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_reentrant_checkpoint_of_the_raw_batch_is_refused_naming_the_fix(drive: str) -> None:
    model = _Checkpointed(reentrant=True).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=4, accumulation_steps=2)
    before = copy.deepcopy(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "None of the inputs have requires_grad"
        run = acc.step if drive == "step" else acc.micro_step
        with pytest.raises(ValueError, match=r"use_reentrant=True.*pass use_reentrant=False"):
            run(_batch(), _loss)
    assert_bitwise(model.state_dict(), before)
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state


def test_the_named_fix_trains_exactly_as_the_full_batch() -> None:
    """use_reentrant=False: the accumulated step is the plain full-batch step (float64)."""
    torch.manual_seed(0)
    model = _Checkpointed(reentrant=False).double()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=4)
    for _ in range(2):
        acc.step(_batch(), _loss)
        reference_optimizer.zero_grad()
        _loss(reference, _batch()).backward()
        reference_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
    # Negative control: the naive loop (each micro-batch's mean, summed) is far off.
    naive = copy.deepcopy(reference)
    naive.load_state_dict(model.state_dict())
    for chunk in zip(*(t.split(4) for t in _batch()), strict=True):
        _loss(naive, chunk).backward()
    expected = copy.deepcopy(model)
    _loss(expected, _batch()).backward()
    gap = (naive.body[0].weight.grad - expected.body[0].weight.grad).abs().max()
    assert float(gap) > 1e-3
