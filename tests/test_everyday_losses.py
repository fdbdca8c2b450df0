"""Everyday losses step exactly and quietly: a guard against false alarms of the loss checks.

The library reads a `loss_fn` for copied-loop divisions, token means, in-batch terms, nonlinear
functions of batch reductions, soft targets and class weights drawn per micro-batch. Each warns
on a real mismatch. This file runs common losses that ARE per-item means, under warnings as
errors, through a ragged split (5 + 5 + 2), against one plain full-batch SGD step in float64.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradaccum import Accumulator

B, MICRO = 12, 5
LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _data() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(B, 6, generator=generator, dtype=torch.float64),
        "classes": torch.randint(0, 3, (B,), generator=generator),
        "targets": torch.randn(B, 4, generator=generator, dtype=torch.float64),
        "labels": (torch.rand(B, 3, generator=generator) > 0.5).double(),
        "signs": torch.randint(0, 2, (B,), generator=generator) * 2 - 1,
    }


def _net(outputs: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, outputs)).double()


def _smoothed(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    target = F.one_hot(b["classes"], 3).double() * 0.9 + 0.1 / 3  # label smoothing by hand
    return -(target * torch.log_softmax(m(b["x"]), 1)).sum(1).mean()


def _margin(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    scores = m(b["x"])
    own = scores.gather(1, b["classes"][:, None]).squeeze(1)
    return F.relu(1 + scores.max(dim=1).values - own).mean()  # a max over classes, per row


WEIGHTS = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
LOSSES: dict[str, tuple[int, LossFn]] = {
    "cross_entropy, label smoothing": (
        3,
        lambda m, b: F.cross_entropy(m(b["x"]), b["classes"], label_smoothing=0.1),
    ),
    "fixed class weights, sum over rows": (
        3,
        lambda m, b: (
            F.cross_entropy(m(b["x"]), b["classes"], weight=WEIGHTS, reduction="sum")
            / len(b["classes"])
        ),
    ),
    "label smoothing by hand": (3, _smoothed),
    "mse": (4, lambda m, b: F.mse_loss(m(b["x"]), b["targets"])),
    "huber": (4, lambda m, b: F.huber_loss(m(b["x"]), b["targets"], delta=0.5)),
    "smooth l1": (4, lambda m, b: F.smooth_l1_loss(m(b["x"]), b["targets"])),
    "bce with pos_weight": (
        3,
        lambda m, b: F.binary_cross_entropy_with_logits(
            m(b["x"]), b["labels"], pos_weight=torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        ),
    ),
    "kl_div batchmean": (
        3,
        lambda m, b: F.kl_div(
            F.log_softmax(m(b["x"]), -1), F.softmax(b["targets"][:, :3], -1), reduction="batchmean"
        ),
    ),
    "cosine embedding": (
        4,
        lambda m, b: F.cosine_embedding_loss(m(b["x"]), b["targets"], b["signs"]),
    ),
    "poisson nll": (4, lambda m, b: F.poisson_nll_loss(m(b["x"]), b["targets"].abs())),
    "multi margin": (3, lambda m, b: F.multi_margin_loss(m(b["x"]), b["classes"])),
    "max over classes per row": (3, _margin),
    "std over features per row": (4, lambda m, b: m(b["x"]).std(dim=1).mean()),
    "stable softmax, global max": (
        3,
        lambda m, b: F.nll_loss(
            F.log_softmax(m(b["x"]) - m(b["x"]).max().detach(), -1), b["classes"]
        ),
    ),
    "mean plus a parameter penalty": (
        3,
        lambda m, b: (
            F.cross_entropy(m(b["x"]), b["classes"])
            + 1e-4 * sum(p.pow(2).sum() for p in m.parameters())
        ),
    ),
}


def _step_both(outputs: int, loss_fn: LossFn) -> tuple[nn.Module, nn.Module]:
    model = _net(outputs)
    reference = copy.deepcopy(model)
    batch = _data()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=MICRO)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        assert acc.step(batch, loss_fn).micro_batches == 3
        plain.zero_grad()
        loss_fn(reference, batch).backward()
        plain.step()
    return model, reference


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_an_everyday_per_item_loss_steps_as_the_full_batch_without_a_warning(name: str) -> None:
    outputs, loss_fn = LOSSES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a false alarm fails the test
        model, reference = _step_both(outputs, loss_fn)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_negative_control_a_mean_of_micro_batch_means_is_not_the_full_batch_step() -> None:
    """The blog posts' loop (each micro-batch's mean divided by the number of micro-batches)
    differs on this ragged split, so the comparison above can fail."""
    outputs, loss_fn = LOSSES["mse"]
    model, reference = _net(outputs), _net(outputs)
    batch = _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, B, MICRO):
        part = {key: value[start : start + MICRO] for key, value in batch.items()}
        (loss_fn(model, part) / 3).backward()
    optimizer.step()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_fn(reference, batch).backward()
    plain.step()
    with torch.no_grad():
        gap = max(
            float((a - b).abs().max() / b.abs().max())
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
    assert gap > 1e-4
