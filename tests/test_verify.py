"""Tests for gradaccum.verify: `check_equivalence` and the non-additive module finder."""

from __future__ import annotations

import copy

import pytest
import torch

from gradaccum import EquivalenceReport, check_equivalence
from gradaccum.verify import find_non_additive


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _batch(items: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(items, 4, generator=generator), torch.randn(items, 1, generator=generator)


def _mse(model: torch.nn.Module, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _squared_mean_residual(model: torch.nn.Module, batch) -> torch.Tensor:
    """Not a per-item mean: a function of the whole batch's mean, so it does not accumulate."""
    return (model(batch[0]) - batch[1]).mean().pow(2)


def _manual_gap(model: torch.nn.Module, batch, loss, micro_batch_size: int) -> float:
    """Largest |accumulated - full| over all gradients, computed without the library."""
    x, y = (t.double() for t in batch)
    full = copy.deepcopy(model).double()
    full_grads = torch.autograd.grad(loss(full, (x, y)), list(full.parameters()))
    acc = copy.deepcopy(model).double()
    acc_grads = [torch.zeros_like(p) for p in acc.parameters()]
    for start in range(0, len(x), micro_batch_size):
        mb = (x[start : start + micro_batch_size], y[start : start + micro_batch_size])
        weight = len(mb[0]) / len(x)
        grads = torch.autograd.grad(loss(acc, mb) * weight, list(acc.parameters()))
        acc_grads = [a + g for a, g in zip(acc_grads, grads, strict=True)]
    return max(float((a - f).abs().max()) for a, f in zip(acc_grads, full_grads, strict=True))


@pytest.mark.parametrize("micro_batch_size", [1, 3, 10])
def test_additive_model_is_reported_exact(micro_batch_size: int) -> None:
    model = _mlp()
    report = check_equivalence(model, _batch(), _mse, micro_batch_size)
    assert isinstance(report, EquivalenceReport)
    assert report.ok
    assert report.dtype == torch.float64
    assert report.tolerance == 1e-10
    assert report.micro_batch_size == micro_batch_size
    assert report.max_rel_diff <= 1e-12
    assert report.non_additive == ()
    names = [gap.name for gap in report.parameters]
    assert names == [name for name, _ in model.named_parameters()]
    assert [gap.shape for gap in report.parameters] == [tuple(p.shape) for p in model.parameters()]


def test_negative_control_non_additive_loss_is_reported_inexact() -> None:
    model = _mlp()
    batch = _batch()
    report = check_equivalence(model, batch, _squared_mean_residual, 3)
    assert not report.ok
    assert report.max_rel_diff > 1e-2
    # The reported gap is the one a plain float64 computation finds.
    assert report.max_abs_diff == pytest.approx(
        _manual_gap(model, batch, _squared_mean_residual, 3), rel=1e-6
    )
    assert "NOT EXACT" in str(report)
    assert "<-- exceeds tolerance" in str(report)


def test_batchnorm_in_train_mode_is_named_and_its_gap_measured() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(), torch.nn.Linear(6, 1)
    )
    batch = _batch(12)
    report = check_equivalence(model, batch, _mse, 4)
    assert not report.ok
    assert [m.name for m in report.non_additive] == ["1"]
    assert report.non_additive[0].kind == "BatchNorm1d"
    assert report.max_abs_diff == pytest.approx(_manual_gap(model, batch, _mse, 4), rel=1e-6)
    text = str(report)
    assert "non-additive modules" in text
    assert "1 (BatchNorm1d)" in text

    model.eval()  # running statistics: every item is normalized alike, so it is exact again
    assert find_non_additive(model) == []
    assert check_equivalence(model, batch, _mse, 4).ok


def test_dropout_is_listed_only_when_it_drops() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        torch.nn.Dropout(0.5),
        torch.nn.Dropout(0.0),
        torch.nn.MultiheadAttention(4, 1, dropout=0.1),
    )
    found = find_non_additive(model)
    assert [(m.name, m.kind) for m in found] == [
        ("1", "Dropout"),
        ("3", "MultiheadAttention"),
    ]
    assert all("random masks" in m.reason for m in found)
    model.eval()
    assert find_non_additive(model) == []


def test_the_model_itself_is_not_touched() -> None:
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    check_equivalence(model, _batch(), _mse, 3)
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value, before[name])
    assert all(p.grad is None for p in model.parameters())


def test_float32_check_uses_the_float32_tolerance() -> None:
    report = check_equivalence(_mlp(), _batch(), _mse, 3, dtype=torch.float32)
    assert report.dtype == torch.float32
    assert report.tolerance == 1e-5
    assert report.ok


def test_readable_table() -> None:
    report = check_equivalence(_mlp(), _batch(), _mse, 4)
    text = str(report)
    for name, _ in _mlp().named_parameters():
        assert name in text
    assert "max abs diff" in text
    assert "micro_batch_size=4" in text
    assert "OK: accumulation is exact" in text


def test_bad_arguments_are_rejected_before_any_work() -> None:
    calls = []

    def counting(m, b):
        calls.append(1)
        return _mse(m, b)

    with pytest.raises(ValueError, match="micro_batch_size=0 must be a positive int"):
        check_equivalence(_mlp(), _batch(), counting, 0)
    with pytest.raises(ValueError, match="the batch is empty"):
        check_equivalence(_mlp(), (torch.zeros(0, 4), torch.zeros(0, 1)), counting, 2)
    assert calls == []


def test_eval_mode_batchnorm_without_running_statistics_is_non_additive() -> None:
    """It still normalizes with batch statistics, so accumulation is inexact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, track_running_stats=False)
    ).eval()
    report = check_equivalence(
        model, (torch.randn(8, 3),), lambda m, b: m(b[0]).pow(3).mean(), micro_batch_size=4
    )
    assert not report.ok
    assert [m.name for m in report.non_additive] == ["1"]
    # NEGATIVE CONTROL: with running statistics, eval mode is additive and not listed.
    tracked = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).eval()
    fine = check_equivalence(
        tracked, (torch.randn(8, 3),), lambda m, b: m(b[0]).pow(3).mean(), micro_batch_size=4
    )
    assert fine.ok
    assert fine.non_additive == ()
