"""Tests for gradaccum.sync on one process (distributed runs are tested in tests/distributed).

On one process the strategy is `LocalSync`, the identity; what matters here is that the engine
asks its strategy for every micro-batch's context with the right `last` flag, and for exactly
one exchange per window.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import gradaccum
from gradaccum import sync


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _mse(model: torch.nn.Module, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def test_single_process_strategy_is_the_identity() -> None:
    model = _model()
    strategy = sync.grad_sync_for(model)
    assert isinstance(strategy, sync.LocalSync)
    assert (strategy.world, strategy.averaged_over, sync.world_size(model)) == (1, 1, 1)
    mine = sync.RankSummary(5, 2.5, 3, 16.0, has_grad=(True, False))
    agreed = strategy.exchange(mine)
    assert (agreed.count, agreed.loss_sum, agreed.failed_ranks) == (5, 2.5, ())
    assert agreed.has_grad == (True, False)
    grad = torch.ones(3)
    strategy.reduce([grad])
    assert torch.equal(grad, torch.ones(3))
    assert sync.any_rank(model, True)
    assert not sync.any_rank(model, False)
    assert sync.all_ranks_min(model, 7) == 7


@pytest.mark.parametrize("flag", [True, False])
def test_sync_context_is_a_no_op_on_a_plain_model(flag: bool) -> None:
    model = _model()
    x = torch.randn(4, 3)
    with sync.sync_context(model, sync=flag):
        model(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, x.sum(dim=0, keepdim=True))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every micro-batch context (with its `last` flag) and every exchange."""
    seen: list[str] = []
    real_exchange = sync.LocalSync.exchange

    def micro_context(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        seen.append("last" if last else "micro")
        return contextlib.nullcontext()

    def exchange(self, mine):
        seen.append("exchange")
        return real_exchange(self, mine)

    monkeypatch.setattr(sync.LocalSync, "micro_context", micro_context)
    monkeypatch.setattr(sync.LocalSync, "exchange", exchange)
    return seen


def test_step_marks_only_the_last_micro_batch_and_exchanges_once(calls: list[str]) -> None:
    model = _model()
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2
    )
    batch = (torch.randn(7, 3), torch.randn(7, 1))
    acc.step(batch, _mse)
    assert calls == ["micro", "micro", "micro", "last", "exchange"]


def test_micro_step_marks_each_windows_last_micro_batch(calls: list[str]) -> None:
    model = _model()
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3
    )
    results = [acc.micro_step((torch.randn(2, 3), torch.randn(2, 1)), _mse) for _ in range(6)]
    assert calls == ["micro", "micro", "last", "exchange"] * 2
    assert [r.stepped for r in results] == [False, False, True] * 2


def test_a_script_launched_as_several_processes_without_a_group_is_warned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A single-process script run by `torchrun --nproc_per_node 2` (no init_process_group, no
    DDP) trained one model per process on its own data, and nothing said so."""
    import warnings

    model = torch.nn.Linear(2, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(UserWarning, match=r"this process is one of 2 \(WORLD_SIZE=2") as caught:
        gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "dist.init_process_group" in str(caught[0].message)
    assert "DistributedDataParallel(model)" in str(caught[0].message)
    # Negative control: one process (WORLD_SIZE=1, or no launcher) is not warned.
    for world in ("1", None):
        if world is None:
            monkeypatch.delenv("WORLD_SIZE")
        else:
            monkeypatch.setenv("WORLD_SIZE", world)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
