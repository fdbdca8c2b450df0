"""Tests for gradaccum.sync on one process (distributed runs are tested elsewhere).

On one process every helper is the identity; what matters here is that the engine asks for a
gradient sync exactly once per window, on its last micro-batch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import gradaccum
import gradaccum.window
from gradaccum import sync


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _mse(model: torch.nn.Module, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def test_single_process_helpers_are_identities() -> None:
    model = _model()
    assert sync.world_size(model) == 1
    assert sync.grad_average_factor(model) == 1
    totals = sync.agree_on_window(model, 5, 2.5, micro_batches=3, grad_divisor=16.0)
    assert totals == sync.GlobalTotals(count=5, loss_sum=2.5)


@pytest.mark.parametrize("flag", [True, False])
def test_sync_context_is_a_no_op_on_a_plain_model(flag: bool) -> None:
    model = _model()
    x = torch.randn(4, 3)
    with sync.sync_context(model, sync=flag):
        model(x).sum().backward()
    expected = x.sum(dim=0, keepdim=True)
    torch.testing.assert_close(model.weight.grad, expected)


@pytest.fixture
def sync_flags(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record the `sync` flag of every micro-batch while still running the real context."""
    flags: list[bool] = []
    real = gradaccum.window.sync_context

    def recording(model: torch.nn.Module, *, sync: bool) -> contextlib.AbstractContextManager:
        flags.append(sync)
        return real(model, sync=sync)

    monkeypatch.setattr(gradaccum.window, "sync_context", recording)
    return flags


def test_step_syncs_only_on_the_last_micro_batch(sync_flags: list[bool]) -> None:
    model = _model()
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2
    )
    batch = (torch.randn(7, 3), torch.randn(7, 1))
    acc.step(batch, _mse)
    assert sync_flags == [False, False, False, True]
    acc.step(batch, _mse)
    assert sync_flags == [False, False, False, True] * 2


def test_micro_step_syncs_only_on_each_windows_last_micro_batch(sync_flags: list[bool]) -> None:
    model = _model()
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3
    )
    results = [acc.micro_step((torch.randn(2, 3), torch.randn(2, 1)), _mse) for _ in range(6)]
    assert sync_flags == [False, False, True] * 2
    assert [r.stepped for r in results] == [False, False, True] * 2


def test_single_micro_batch_window_syncs(sync_flags: list[bool]) -> None:
    model = _model()
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=8
    )
    acc.step((torch.randn(5, 3), torch.randn(5, 1)), _mse)
    assert sync_flags == [True]
