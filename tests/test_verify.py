"""Tests for gradaccum.verify: `check_equivalence` and the non-additive module finder."""

from __future__ import annotations

import copy
import pickle
import random
import warnings
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest
import torch

from gradaccum import LossSum, check_equivalence
from gradaccum._buffer_watch import ForwardStateWarning
from gradaccum.verify import EquivalenceReport, find_non_additive


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


def _manual_gap(
    model: torch.nn.Module, batch, loss, micro_batch_size: int, *, cast: bool = True
) -> float:
    """Largest |accumulated - full| over all gradients, computed without the library.

    With `cast=False` the model and batch are used as they are (complex models: `.double()`
    would drop their imaginary parts); |.| of a complex difference is its modulus.
    """
    batch = tuple(t.double() for t in batch) if cast else tuple(batch)
    full = copy.deepcopy(model).double() if cast else copy.deepcopy(model)
    full_grads = torch.autograd.grad(loss(full, batch), list(full.parameters()))
    acc = copy.deepcopy(model).double() if cast else copy.deepcopy(model)
    acc_grads = [torch.zeros_like(p) for p in acc.parameters()]
    items = len(batch[0])
    for start in range(0, items, micro_batch_size):
        mb = tuple(t[start : start + micro_batch_size] for t in batch)
        weight = len(mb[0]) / items
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
    assert report.internal_dtype is None
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
    # It has no running statistics to update: the reason says what it does instead.
    reason = report.non_additive[0].reason
    assert "track_running_stats=False" in reason
    assert "running statistics once per" not in reason
    # NEGATIVE CONTROL: with running statistics, eval mode is additive and not listed.
    tracked = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).eval()
    fine = check_equivalence(
        tracked, (torch.randn(8, 3),), lambda m, b: m(b[0]).pow(3).mean(), micro_batch_size=4
    )
    assert fine.ok
    assert fine.non_additive == ()


# --- complex parameters ------------------------------------------------------------------------


class _ComplexModel(torch.nn.Module):
    """A real input, a complex weight and a real loss: |x @ w|^2."""

    def __init__(self, dtype: torch.dtype = torch.complex128) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.w = torch.nn.Parameter(torch.randn(3, dtype=dtype, generator=generator))
        self.scale = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).to(self.w.dtype) @ self.w


def _complex_batch() -> tuple[torch.Tensor]:
    return (torch.randn(10, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6)),)


def _power(model: torch.nn.Module, batch) -> torch.Tensor:
    return model(batch[0]).abs().pow(2).mean()


def _power_of_mean(model: torch.nn.Module, batch) -> torch.Tensor:
    """Not a per-item mean: |mean of x @ w|^2 depends on how the batch is split."""
    return model(batch[0]).mean().abs().pow(2)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64])
def test_complex_parameter_is_compared_as_complex(dtype: torch.dtype) -> None:
    model, batch = _ComplexModel(dtype), _complex_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Casting complex values to real discards ..."
        report = check_equivalence(model, batch, _power, 3)
    assert report.ok, str(report)
    assert [gap.name for gap in report.parameters] == ["w", "scale"]
    assert report.max_rel_diff <= 1e-12
    assert report.internal_dtype is None  # complex64 became complex128, not float32
    assert model.w.dtype == dtype
    assert model.w.grad is None

    # NEGATIVE CONTROL: a loss that is not additive over items is flagged, and the gap is the
    # complex one a plain complex128 computation finds (a real view would find another number).
    wrong = check_equivalence(model, batch, _power_of_mean, 3)
    assert not wrong.ok
    exact = _ComplexModel(torch.complex128)
    with torch.no_grad():
        exact.w.copy_(model.w)
    expected = _manual_gap(exact, batch, _power_of_mean, 3, cast=False)
    assert wrong.max_abs_diff == pytest.approx(expected, rel=1e-9)
    assert wrong.parameters[0].max_rel_diff > 1e-3


# --- stateful parametrizations and hooks ---------------------------------------------------------


class _CallCounter(torch.nn.Module):
    """A stateful parametrization: the weight is scaled by how often it was computed."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls += 1
        return weight * (1 + 0.1 * self.calls)


class _FixedMask(torch.nn.Module):
    """A stateless parametrization holding a buffer it only reads (like orthogonal's `base`)."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.register_buffer("mask", (torch.arange(shape.numel()) % 2).reshape(shape).float())

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask


def _spectral_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 6)),
        torch.nn.Tanh(),
        torch.nn.utils.spectral_norm(torch.nn.Linear(6, 1)),  # the legacy hook form
    )


def test_spectral_norm_is_named_in_both_forms() -> None:
    model = _spectral_model()
    found = find_non_additive(model)
    assert [(m.name, m.kind) for m in found] == [
        ("0.parametrizations.weight.0", "_SpectralNorm"),
        ("2", "SpectralNorm"),
    ]
    assert all("spectral_norm" in m.reason and "power iteration" in m.reason for m in found)
    assert "_u, _v" in found[0].reason
    assert "weight_u, weight_v" in found[1].reason
    before = copy.deepcopy(model.state_dict())
    report = check_equivalence(model, _batch(), _mse, 3)
    assert not report.ok  # each micro-batch runs one more power iteration
    assert [m.name for m in report.non_additive] == [m.name for m in found]
    assert "spectral_norm" in str(report)
    for name, value in model.state_dict().items():  # the probes ran on copies
        assert torch.equal(value, before[name])

    # NEGATIVE CONTROL: in eval mode no power iteration runs: exact, nothing listed.
    model.eval()
    assert find_non_additive(model) == []
    assert check_equivalence(model, _batch(), _mse, 3).ok


def test_stateless_parametrizations_are_not_flagged() -> None:
    torch.manual_seed(0)
    parametrizations = torch.nn.utils.parametrizations
    masked = torch.nn.Linear(6, 6)
    torch.nn.utils.parametrize.register_parametrization(
        masked, "weight", _FixedMask(masked.weight.shape)
    )
    model = torch.nn.Sequential(
        parametrizations.orthogonal(torch.nn.Linear(4, 4)),  # holds a `base` buffer
        parametrizations.weight_norm(torch.nn.Linear(4, 6)),
        torch.nn.Tanh(),
        masked,
        torch.nn.Linear(6, 1),
    )
    assert find_non_additive(model) == []
    report = check_equivalence(model, _batch(), _mse, 3)
    assert report.ok, str(report)
    assert report.non_additive == ()

    # NEGATIVE CONTROL: a parametrization that updates a buffer when it computes the weight.
    counted = torch.nn.Linear(4, 1)
    torch.nn.utils.parametrize.register_parametrization(counted, "weight", _CallCounter())
    calls = float(counted.parametrizations.weight[0].calls)
    found = find_non_additive(torch.nn.Sequential(counted))
    assert [(m.name, m.kind) for m in found] == [("0.parametrizations.weight.0", "_CallCounter")]
    assert "calls" in found[0].reason
    assert float(counted.parametrizations.weight[0].calls) == calls  # probed on a copy
    assert not check_equivalence(torch.nn.Sequential(counted), _batch(), _mse, 3).ok


def test_random_parametrization_is_flagged() -> None:
    class DropConnect(torch.nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.dropout(weight, 0.5, self.training)

    layer = torch.nn.Linear(4, 1)
    torch.nn.utils.parametrize.register_parametrization(layer, "weight", DropConnect())
    state = torch.get_rng_state()
    found = find_non_additive(layer)
    assert torch.equal(torch.get_rng_state(), state)
    assert [(m.name, m.kind) for m in found] == [("parametrizations.weight", "ParametrizationList")]
    assert "different weight on every call" in found[0].reason
    # NEGATIVE CONTROL: in eval mode it is a plain function of the weight.
    assert find_non_additive(layer.eval()) == []


def test_hook_that_changes_buffers_is_found_by_the_run() -> None:
    def advance(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad():
            module.gain.mul_(0.9)  # type: ignore[operator]

    def scaled(module: torch.nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
        return output * module.gain

    model = _mlp()
    model[2].register_buffer("gain", torch.ones(()))
    model[2].register_forward_pre_hook(advance)
    model[2].register_forward_hook(scaled)
    assert find_non_additive(model) == []  # only a run shows it
    report = check_equivalence(model, _batch(), _mse, 3)
    assert not report.ok
    assert [(m.name, m.kind) for m in report.non_additive] == [("2", "Linear")]
    assert "gain" in report.non_additive[0].reason
    assert float(model[2].gain) == 1.0

    # NEGATIVE CONTROL: a pre-hook that only reads its module's buffers is not listed.
    quiet = _mlp()
    quiet[2].register_buffer("gain", torch.ones(()))
    quiet[2].register_forward_pre_hook(lambda module, inputs: None)
    quiet[2].register_forward_hook(scaled)
    fine = check_equivalence(quiet, _batch(), _mse, 3)
    assert fine.ok
    assert fine.non_additive == ()


# --- models without values -----------------------------------------------------------------------


def test_meta_model_is_refused_naming_the_fix() -> None:
    calls = []

    def counting(m, b):
        calls.append(1)
        return _mse(m, b)

    with pytest.raises(ValueError, match=r"0\.weight is on the meta device.*to_empty"):
        check_equivalence(
            torch.nn.Sequential(torch.nn.Linear(4, 1, device="meta")), _batch(), counting, 3
        )
    model = _mlp()
    model[2].bias = torch.nn.Parameter(torch.empty(1, device="meta"))  # one parameter on meta
    with pytest.raises(ValueError, match=r"2\.bias is on the meta device.*initialize"):
        check_equivalence(model, _batch(), counting, 3)
    with pytest.raises(ValueError, match=r"uninitialized.*run one forward pass"):
        check_equivalence(torch.nn.LazyLinear(1), _batch(), counting, 3)
    with pytest.raises(ValueError, match="meta tensor"):
        check_equivalence(_mlp(), tuple(t.to("meta") for t in _batch()), counting, 3)
    assert calls == []
    # NEGATIVE CONTROL: the same model materialized as the message says is checked.
    materialized = torch.nn.Sequential(torch.nn.Linear(4, 1, device="meta")).to_empty(device="cpu")
    materialized[0].reset_parameters()
    assert check_equivalence(materialized, _batch(), counting, 3).ok


# --- global RNG ----------------------------------------------------------------------------------


def _dropout_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def _noisy_mse(model: torch.nn.Module, batch) -> torch.Tensor:
    """Draws one random number per call: once for the full batch, once per micro-batch."""
    return _mse(model, batch) * (1 + torch.rand(()))


def test_global_rng_state_is_left_as_found() -> None:
    model = _dropout_mlp()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    whole = check_equivalence(model, _batch(), _noisy_mse, 10)
    assert torch.equal(torch.get_rng_state(), before)
    split = check_equivalence(model, _batch(), _noisy_mse, 3)
    assert torch.equal(torch.get_rng_state(), before)
    # Both runs start from the caller's state: one micro-batch draws the full batch's numbers.
    assert whole.ok
    assert whole.max_abs_diff == 0.0
    # The dropout, and the loss's own draw outside the model (named since it is told apart).
    assert [m.kind for m in whole.non_additive] == ["Dropout", "random draws"]
    # NEGATIVE CONTROL: split, the draws differ; the same state gives the same report again.
    assert not split.ok
    assert check_equivalence(model, _batch(), _noisy_mse, 3).max_abs_diff == split.max_abs_diff
    torch.manual_seed(123)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_global_cuda_rng_state_is_left_as_found() -> None:
    model = _dropout_mlp().cuda()
    batch = tuple(t.cuda() for t in _batch())
    before = torch.cuda.get_rng_state()
    assert check_equivalence(model, batch, _mse, 10).ok
    assert torch.equal(torch.cuda.get_rng_state(), before)


# --- float32 inside a float64 check ------------------------------------------------------------


class _RMSNorm(torch.nn.Module):
    """Llama/T5-style: normalizes in float32 whatever the model's dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


def _rms_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), _RMSNorm(16), torch.nn.SiLU(), torch.nn.Linear(16, 5)
    )


def _tokens(items: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return torch.randn(items, 8, generator=generator), torch.randint(
        0, 5, (items,), generator=generator
    )


def _upcast_ce(model: torch.nn.Module, batch) -> torch.Tensor:
    """Casts the logits with `.float()`: a float64 model's logits go DOWN to float32."""
    return torch.nn.functional.cross_entropy(model(batch[0]).float(), batch[1])


def _upcast_ce_sum(model: torch.nn.Module, batch) -> LossSum:
    logits = model(batch[0]).float()
    return LossSum(
        torch.nn.functional.cross_entropy(logits, batch[1], reduction="sum"), len(logits)
    )


def _ce_sum(model: torch.nn.Module, batch) -> LossSum:
    """A float64 loss: only the RMSNorm computes in float32."""
    logits = model(batch[0])
    return LossSum(
        torch.nn.functional.cross_entropy(logits, batch[1], reduction="sum"), len(logits)
    )


def _ce_of_mean_logits(model: torch.nn.Module, batch) -> torch.Tensor:
    """Not additive: one cross-entropy of the micro-batch's mean logits."""
    logits = model(batch[0]).float().mean(0, keepdim=True)
    return torch.nn.functional.cross_entropy(logits, batch[1][:1])


def _sum_then_divide_gap(model: torch.nn.Module, batch, loss, micro_batch_size: int) -> float:
    """Relative gap of a plain hand loop (backward the sums, divide by the count at the end)."""
    x, y = batch[0].double(), batch[1]
    full = copy.deepcopy(model).double()
    loss(full, (x, y)).backward()
    hand = copy.deepcopy(model).double()
    for start in range(0, len(x), micro_batch_size):
        mb = (x[start : start + micro_batch_size], y[start : start + micro_batch_size])
        (loss(hand, mb) * len(mb[0])).backward()
    return max(
        float((h.grad / len(x) - f.grad).abs().max() / f.grad.abs().max())
        for h, f in zip(hand.parameters(), full.parameters(), strict=True)
    )


@pytest.mark.parametrize("loss", [_upcast_ce, _upcast_ce_sum, _ce_sum])
def test_float32_inside_a_float64_model_is_judged_at_float32(loss) -> None:
    model, batch = _rms_model(), _tokens()
    report = check_equivalence(model, batch, loss, 5)
    assert report.internal_dtype == torch.float32
    assert report.tolerance == 1e-5
    assert report.ok, str(report)
    # A plain hand loop that divides at the end is as far from the float64 reference.
    hand = _sum_then_divide_gap(model, batch, _upcast_ce, 5)
    assert 1e-9 < hand < 1e-6
    assert report.max_rel_diff < 1e-6
    assert "computes in torch.float32 inside" in str(report)

    # NEGATIVE CONTROL: a truly wrong accumulation is far beyond float32 rounding.
    wrong = check_equivalence(model, batch, _ce_of_mean_logits, 5)
    assert wrong.internal_dtype == torch.float32
    assert not wrong.ok
    assert wrong.max_rel_diff > 1e-3


def test_float32_constants_without_gradient_keep_the_float64_tolerance() -> None:
    def loss(model: torch.nn.Module, batch) -> torch.Tensor:
        weight = torch.tensor(2.0)  # float32, but no gradient flows through float32
        return _mse(model, batch) * weight

    report = check_equivalence(_mlp(), _batch(), loss, 3)
    assert report.internal_dtype is None
    assert report.tolerance == 1e-10
    assert report.ok
    # NEGATIVE CONTROL: the same check on a non-additive loss still fails at 1e-10.
    assert not check_equivalence(_mlp(), _batch(), _squared_mean_residual, 3).ok


def _upcast_square(model: torch.nn.Module, batch) -> torch.Tensor:
    return model(batch[0]).float().pow(2).mean()


def test_reference_is_the_plain_full_batch_backward() -> None:
    """A float32 loss over 41 items: `loss * 41 / 41` would seed backward with 1 - 2**-24."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 5))
    batch = _tokens(41)
    report = check_equivalence(model, batch, _upcast_square, 41)
    assert report.max_abs_diff == 0.0  # one micro-batch: the very same computation
    # NEGATIVE CONTROL: a reference rescaled by 41 / 41 is another gradient.
    x = (batch[0].double(),)
    plain, rescaled = copy.deepcopy(model).double(), copy.deepcopy(model).double()
    _upcast_square(plain, x).backward()
    (_upcast_square(rescaled, x) * 41 / 41).backward()
    assert not torch.equal(plain[0].weight.grad, rescaled[0].weight.grad)


def test_uncopyable_model_is_refused_naming_the_fix() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the legacy weight_norm is deprecated
        legacy = torch.nn.Sequential(torch.nn.utils.weight_norm(torch.nn.Linear(4, 1)))
    with pytest.raises(ValueError, match=r"deepcopy failed.*parametrizations\.weight_norm"):
        check_equivalence(legacy, _batch(), _mse, 3)
    # NEGATIVE CONTROL: the parametrization form is copyable and exact.
    modern = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 1))
    assert check_equivalence(torch.nn.Sequential(modern), _batch(), _mse, 3).ok


def test_check_runs_under_no_grad() -> None:
    with torch.no_grad():
        report = check_equivalence(_mlp(), _batch(), _mse, 3)
        wrong = check_equivalence(_mlp(), _batch(), _squared_mean_residual, 3)
    assert report.ok
    assert not wrong.ok  # NEGATIVE CONTROL


def test_a_loss_running_its_own_backward_or_without_graph_is_refused_naming_the_fix() -> None:
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]

    def runs_backward(m: torch.nn.Module, batch) -> torch.Tensor:
        loss = _mse(m, batch)
        loss.backward(retain_graph=True)  # counted twice: refused, not reported as a gap
        return loss

    def without_graph(m: torch.nn.Module, batch) -> torch.Tensor:
        with torch.no_grad():
            return _mse(m, batch)

    with pytest.raises(ValueError, match=r"loss_fn ran a backward itself.*Remove the \.backward"):
        check_equivalence(model, _batch(), runs_backward, micro_batch_size=3)
    with pytest.raises(ValueError, match=r"does not require grad.*torch\.no_grad"):
        check_equivalence(model, _batch(), without_graph, micro_batch_size=3)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_numpy_batches_are_cast_to_the_check_dtype_like_tensors() -> None:
    """A float32 numpy batch (a pandas/numpy pipeline) is checked in float64, not refused."""
    model = _mlp().float()
    x, y = (t.float().numpy() for t in _batch())

    def numpy_mse(m: torch.nn.Module, batch) -> torch.Tensor:
        inputs, targets = (torch.as_tensor(a) for a in batch)
        return torch.nn.functional.mse_loss(m(inputs), targets)

    report = check_equivalence(model, (x, y), numpy_mse, micro_batch_size=3)
    assert report.ok, report
    assert report.max_rel_diff < 1e-10  # judged in float64: the arrays were cast too
    assert x.dtype == np.float32  # the caller's arrays are untouched
    # Negative control: left in float32, the arrays meet a float64 copy of the model.
    with pytest.raises(RuntimeError, match="dtype"):
        numpy_mse(copy.deepcopy(model).double(), (x, y))


class _RunningCenter(torch.nn.Module):
    """Subtracts a running mean it updates in every train-mode forward (a custom statistic)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - self.running_mean


class _ItemCounter(torch.nn.Module):
    """Counts the items it saw: state, but the same after the micro-batches as after the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += len(x)
        return x


def test_a_module_updating_a_buffer_in_forward_is_named_as_the_cause() -> None:
    torch.manual_seed(0)
    stateful = torch.nn.Sequential(
        torch.nn.Linear(4, 6), _RunningCenter(6), _ItemCounter(), torch.nn.Linear(6, 1)
    )
    report = check_equivalence(stateful, _batch(), _mse, micro_batch_size=3)
    assert not report.ok
    assert [(m.name, m.kind) for m in report.non_additive] == [("1", "_RunningCenter")]
    assert "running_mean" in report.non_additive[0].reason
    explained = report.explain()
    assert "_RunningCenter at 1" in explained
    assert "eval mode" in explained
    assert "the loss is not additive" not in explained  # the wrong cause is no longer given
    # Negative control: in eval mode the same model is exact and nothing is listed.
    report = check_equivalence(stateful.eval(), _batch(), _mse, micro_batch_size=3)
    assert report.ok
    assert report.non_additive == ()


def _in_batch_negatives(model: torch.nn.Module, batch) -> torch.Tensor:
    """InfoNCE: each row's positive against every other row of its batch as negatives."""
    anchors = torch.nn.functional.normalize(model(batch[0]), dim=-1)
    positives = torch.nn.functional.normalize(model(batch[0] + 0.1), dim=-1)
    logits = anchors @ positives.T / 0.1
    return torch.nn.functional.cross_entropy(logits, torch.arange(len(logits)))


def _class_weighted(model: torch.nn.Module, batch) -> torch.Tensor:
    weight = torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1], weight=weight)


@pytest.mark.parametrize("loss_fn", [_in_batch_negatives, _class_weighted])
def test_a_loss_not_additive_over_items_is_explained_with_both_causes(loss_fn) -> None:
    """No module is at fault: the explanation names the loss, both ways it can fail (a count of
    the micro-batch, such as summed class weights; in-batch negatives, exact only with gradient
    caching) and each fix. It named a count of the micro-batch only, and the table nothing; then
    it said no accumulation is exact for in-batch negatives, with no fix but a larger split."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    batch = (torch.randn(10, 4), torch.randint(0, 3, (10,)))
    warned = loss_fn is _in_batch_negatives  # its accumulated pass warns as step() does
    with pytest.warns(UserWarning, match="compares the rows") if warned else nullcontext():
        report = check_equivalence(model, batch, loss_fn, micro_batch_size=3)
    assert not report.ok
    assert ".explain()" in str(report)
    explained = report.explain()
    assert "summed class weights" in explained
    assert "LossSum.terms(loss=" in explained
    assert "in-batch negatives" in explained
    assert "gradient caching" in explained
    assert "'In-batch negatives'" in explained  # the recipe (docs/losses.md; proved exact in
    # tests/test_everyday_models.py::test_in_batch_negatives_with_cached_gradients_equal_...)
    # Control: an additive loss on the same model is exact and its table points nowhere.
    exact = check_equivalence(model, batch, _mse_3, micro_batch_size=3)
    assert exact.ok
    assert ".explain()" not in str(exact)


def _mse_3(model: torch.nn.Module, batch) -> torch.Tensor:
    return model(batch[0]).pow(2).mean()


def _wide_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def _wide_batch(seed: int, items: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(items, 16, generator=generator), torch.randn(items, 4, generator=generator)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_check_allows_for_summing_micro_batches_in_that_dtype(dtype) -> None:
    """`dtype=torch.bfloat16` sums the micro-batches' gradients in bfloat16 `.grad`, each sum
    rounding once more: a correct split must not be called inexact (it was at 1e-2 flat: 1.1e-2
    to 1.8e-2 over 16 to 32 bf16 micro-batches, and the explanation then blamed the loss)."""
    for seed, items, micro_batch_size in [(0, 256, 8), (1, 64, 4), (1, 10, 3), (2, 256, 8)]:
        x, y = _wide_batch(seed, items)
        model = _wide_mlp(seed).to(dtype)
        report = check_equivalence(
            model, (x.to(dtype), y.to(dtype)), _mse, micro_batch_size, dtype=dtype
        )
        assert report.ok, (seed, items, micro_batch_size, str(report))
        # The float64 check (the default) of the same model stays at float64 rounding.
        assert check_equivalence(model, (x, y), _mse, micro_batch_size).tolerance == 1e-10
        # NEGATIVE CONTROL: a loss that is not additive is still reported at this dtype.
        wrong = check_equivalence(
            model, (x.to(dtype), y.to(dtype)), _squared_mean_residual, micro_batch_size, dtype=dtype
        )
        assert not wrong.ok, (seed, items, micro_batch_size, str(wrong))
        assert "the loss is not additive" in wrong.explain()
        assert "accum_dtype=torch.float32" in wrong.explain()  # and says rounding may add to it


def test_a_model_computing_in_bfloat16_inside_is_judged_with_its_micro_batches() -> None:
    """bf16 autocast inside the loss of a float32 check: each micro-batch's gradient is rounded
    to bf16 in its own backward. 1.02e-2 over 20 micro-batches was called NOT EXACT at 1e-2."""
    torch.manual_seed(9)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 10),
    )
    generator = torch.Generator().manual_seed(9)
    batch = (
        torch.randn(20, 16, generator=generator),
        torch.randint(0, 10, (20,), generator=generator),
    )

    def autocast_ce(m, b) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(b[0])
        return torch.nn.functional.cross_entropy(logits.float(), b[1])

    report = check_equivalence(model, batch, autocast_ce, 1, dtype=torch.float32)
    assert report.internal_dtype == torch.bfloat16
    assert report.max_rel_diff > 1e-2  # the flat tolerance's false alarm
    assert report.ok, str(report)
    # The float64 check runs no op in bf16 (autocast leaves float64 alone): float32 rounding.
    assert check_equivalence(model, batch, autocast_ce, 1).tolerance == 1e-5

    # NEGATIVE CONTROL: a loss that is not additive is still reported under bf16 autocast.
    def mean_logits_ce(m, b) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(b[0]).float().mean(0, keepdim=True)
        return torch.nn.functional.cross_entropy(logits, b[1][:1])

    wrong = check_equivalence(model, batch, mean_logits_ce, 1, dtype=torch.float32)
    assert wrong.internal_dtype == torch.bfloat16
    assert not wrong.ok, str(wrong)


class _RowDrop(torch.nn.Module):
    """Stochastic depth as torchvision's `StochasticDepth(p, "row")`: whole rows dropped."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = torch.empty(len(x), 1, dtype=x.dtype).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class _Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.drop = torch.nn.Linear(6, 6), _RowDrop(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.nn.functional.dropout(self.body(x), 0.0) + 0 * x)


class _NoisyTanh(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + 0.1 * torch.randn_like(x) if self.training else x)


def test_modules_drawing_random_numbers_in_forward_are_named_as_the_cause() -> None:
    """Stochastic depth (torchvision's EfficientNet and ConvNeXt) and noise drawn in a custom
    forward are no `Dropout`: they were not listed, and the check blamed the loss ("the loss is
    not additive"). The run now notes every module whose forward advances the generator; the
    innermost is named, with the fix (check with the randomness off)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6),
        _Residual(),
        _NoisyTanh(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(6, 1),
    )
    assert [m.name for m in find_non_additive(model)] == ["3"]  # by class: the Dropout alone
    report = check_equivalence(model, _batch(), _mse, micro_batch_size=3)
    assert not report.ok
    assert [(m.name, m.kind) for m in report.non_additive] == [
        ("3", "Dropout"),  # listed once, by its class
        ("1.drop", "_RowDrop"),  # the innermost: not its block "1"
        ("2", "_NoisyTanh"),
    ]
    assert "random numbers" in report.non_additive[1].reason
    explained = report.explain()
    assert "_RowDrop at 1.drop" in explained
    assert "stochastic depth probability of 0" in explained
    assert "the loss is not additive" not in explained
    # Negative control: in eval mode nothing draws, the same model is exact and nothing is listed.
    report = check_equivalence(model.eval(), _batch(), _mse, micro_batch_size=3)
    assert report.ok
    assert report.non_additive == ()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


class _TiedMaxNormLM(torch.nn.Module):
    """An embedding with max_norm whose weight is also the LM head (tied)."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6, max_norm=1.0)
        self.mix = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def _lm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 11, (10, 5), generator=generator)
    return ids, torch.randint(0, 11, (10, 5), generator=generator)


def _lm_loss(model: torch.nn.Module, batch) -> LossSum:
    logits = model(batch[0])
    ce = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch[1].flatten(), reduction="sum"
    )
    return LossSum(ce, batch[1].numel())


def test_a_forward_writing_its_parameters_in_place_is_named_as_the_cause() -> None:
    # nn.Embedding(max_norm=...) renormalizes the rows it looks up, in place, in every forward:
    # a tied head then reads other weights per micro-batch. The gap used to be blamed on the loss.
    torch.manual_seed(0)
    report = check_equivalence(_TiedMaxNormLM(), _lm_batch(), _lm_loss, micro_batch_size=3)
    assert not report.ok
    assert [(m.name, m.kind) for m in report.non_additive] == [("emb", "Embedding")]
    explained = report.explain()
    assert "wrote its parameter weight in place" in explained
    assert "embedding_renorm_" in explained  # the fix
    assert "the loss is not additive" not in explained
    # Untied, the lookup alone reads the rows it renormalized: exact, and still named as a note.
    torch.manual_seed(0)
    untied = check_equivalence(_TiedMaxNormLM(tied=False), _lm_batch(), _lm_loss, 3)
    assert untied.ok
    assert [m.name for m in untied.non_additive] == ["emb"]
    # Negative control: without max_norm nothing is written, nothing is listed, it is exact.
    torch.manual_seed(0)
    plain = _TiedMaxNormLM()
    plain.emb.max_norm = None
    report = check_equivalence(plain, _lm_batch(), _lm_loss, micro_batch_size=3)
    assert report.ok
    assert report.non_additive == ()


def test_the_max_norm_fix_renormalizing_the_batch_first_makes_the_step_exact() -> None:
    from gradaccum import Accumulator

    torch.manual_seed(0)
    full = _TiedMaxNormLM().double()
    naive, fixed = copy.deepcopy(full), copy.deepcopy(full)
    batch = _lm_batch()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (full, naive, fixed)]
    loss = _lm_loss(full, batch)
    (loss.value / loss.count).backward()
    optimizers[0].step()
    with pytest.warns(ForwardStateWarning, match="embedding_renorm_"):  # the Accumulator says so
        Accumulator(naive, optimizers[1], micro_batch_size=3).step(batch, _lm_loss)
    with torch.no_grad():  # the recipe of the explanation
        torch.embedding_renorm_(fixed.emb.weight, batch[0].unique(), 1.0, 2.0)
    with pytest.warns(ForwardStateWarning):  # told of the tie once, whatever is done before it
        Accumulator(fixed, optimizers[2], micro_batch_size=3).step(batch, _lm_loss)
    torch.testing.assert_close(fixed.emb.weight, full.emb.weight, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fixed.mix.weight, full.mix.weight, rtol=1e-10, atol=1e-12)
    # Negative control: without it, the tied weight ends elsewhere.
    assert (naive.emb.weight - full.emb.weight).abs().max() > 1e-4


class _Vae(torch.nn.Module):
    """A VAE's reparameterization: noise drawn in forward, or passed in the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = torch.nn.Linear(4, 6)
        self.decode = torch.nn.Linear(3, 4)

    def forward(self, x: torch.Tensor, eps: torch.Tensor | None = None) -> torch.Tensor:
        mu, log_var = self.encode(x).chunk(2, -1)
        eps = torch.randn_like(mu) if eps is None else eps
        return self.decode(mu + eps * (0.5 * log_var).exp())


def test_random_draws_in_the_forward_are_named_as_the_cause() -> None:
    # A VAE's torch.randn_like (likewise stochastic depth, F.dropout): no Dropout module, so the
    # gap used to be blamed on the loss.
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(2))

    def drawn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch), batch)

    torch.manual_seed(0)
    report = check_equivalence(_Vae(), x, drawn, micro_batch_size=8)
    assert not report.ok
    # The module whose forward drew is named (the innermost one that drew).
    assert [(m.name, m.kind) for m in report.non_additive] == [("<model>", "_Vae")]
    explained = report.explain()
    assert "the loss is not additive" not in explained
    assert "passed in it" in explained  # the fix: the noise drawn for the batch, in the batch

    def drawn_in_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        noisy = batch + 0.1 * torch.randn_like(batch)  # outside any module: loss_fn's own draw
        return torch.nn.functional.mse_loss(model(noisy, torch.zeros(len(batch), 3)), batch)

    torch.manual_seed(0)
    report = check_equivalence(_Vae(), x, drawn_in_loss, micro_batch_size=8)
    assert [(m.name, m.kind) for m in report.non_additive] == [("<forward>", "random draws")]
    assert "the loss is not additive" not in report.explain()

    # Negative control: the same noise drawn for the whole batch and passed in it is exact.
    def passed(model: torch.nn.Module, batch) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0], batch[1]), batch[0])

    torch.manual_seed(0)
    eps = torch.randn(40, 3, generator=torch.Generator().manual_seed(5))
    report = check_equivalence(_Vae(), (x, eps), passed, micro_batch_size=8)
    assert report.ok
    assert report.non_additive == ()


class _NumpyJitter(torch.nn.Module):
    """Jitters its input's scale with NumPy's global generator: one draw per forward call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * (1 + float(np.random.uniform(-0.5, 0.5))))


def _host_rng() -> tuple[object, list[object]]:
    kind, keys, *rest = np.random.get_state()
    return random.getstate(), [kind, keys.tolist(), *rest]


@pytest.mark.parametrize("source", ["numpy", "python"])
def test_numpy_and_python_draws_are_named_and_their_generators_left_as_found(source: str) -> None:
    """A diffusion loss drawing timesteps per item with NumPy (or Python's `random`), then
    a noise scale: the draws are named as the cause, the caller's generators are left as found.

    Before, check_equivalence forked torch's generators only: the accumulated run started from
    other NumPy/Python draws than the full batch, the gap was blamed on the loss ("not additive
    over items"), and the caller's generators were left advanced.
    """
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(2))

    def diffusion(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        items = len(batch)
        if source == "numpy":
            t = torch.from_numpy(np.random.randint(0, 1000, items)).to(batch.dtype)
            scale = float(np.random.uniform())  # one draw per call, after the per-item ones
        else:
            t = torch.tensor([random.randrange(1000) for _ in range(items)], dtype=batch.dtype)
            scale = random.random()
        noisy = batch * (1 - t[:, None] / 1000) * scale
        return torch.nn.functional.mse_loss(model(noisy), batch[:, :1])

    np.random.seed(0)
    random.seed(0)
    host = _host_rng()
    report = check_equivalence(_mlp(), x, diffusion, micro_batch_size=4)
    assert _host_rng() == host
    assert not report.ok
    assert [(m.name, m.kind) for m in report.non_additive] == [("<forward>", "random draws")]
    assert "the loss is not additive" not in report.explain()
    # Both runs start from the same draws: one micro-batch draws the full batch's numbers.
    whole = check_equivalence(_mlp(), x, diffusion, micro_batch_size=12)
    assert whole.ok
    assert whole.max_abs_diff == 0.0
    # A module that draws from NumPy in its forward is named itself.
    jitter = check_equivalence(_NumpyJitter(), _batch(), _mse, micro_batch_size=4)
    assert [(m.name, m.kind) for m in jitter.non_additive] == [("<model>", "_NumpyJitter")]
    assert _host_rng() == host
    # NEGATIVE CONTROL: with the draws made for the whole batch and passed in it, exact.
    t = torch.from_numpy(np.random.randint(0, 1000, 12)).to(x.dtype)

    def passed(model: torch.nn.Module, batch) -> torch.Tensor:
        noisy = batch[0] * (1 - batch[1][:, None] / 1000) * 0.5
        return torch.nn.functional.mse_loss(model(noisy), batch[0][:, :1])

    exact = check_equivalence(_mlp(), (x, t), passed, micro_batch_size=4)
    assert exact.ok
    assert exact.non_additive == ()


class _QatNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torch.ao import quantization

        self.quant, self.dequant = quantization.QuantStub(), quantization.DeQuantStub()
        self.hidden, self.out = torch.nn.Linear(4, 6), torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.out(torch.relu(self.hidden(self.quant(x)))))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_quantization_observers_get_the_fix_that_stops_them() -> None:
    """Quantization-aware training: FakeQuantize's observers update their ranges in every
    forward, in eval mode too. The fix named is disable_observer, which makes the check exact.

    Before, the fix said to check in eval mode, which still observes: the eval-mode check
    was as inexact as the train-mode one and repeated the same advice.
    """
    from torch.ao import quantization

    torch.manual_seed(0)
    model = _QatNet()
    model.qconfig = quantization.get_default_qat_qconfig("x86")
    model = quantization.prepare_qat(model.train())
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(1))
    batch = (x, x[:, :1].clone())
    model(x)  # calibrated once, as after a first step
    # The default float64 check fails in the fused fake-quantize kernels: the note names the fix
    # (before, torch's "expected scalar type Float but found Double" alone).
    with pytest.raises(RuntimeError) as caught:
        check_equivalence(model, batch, _mse, 6)
    assert "dtype=torch.float32" in "\n".join(caught.value.__notes__)
    for mode in ("train", "eval"):
        report = check_equivalence(
            model.train(mode == "train"), batch, _mse, 6, dtype=torch.float32
        )  # fused fake quantization runs in float32 only
        assert not report.ok, mode
        explained = report.explain()
        assert "disable_observer" in explained, mode
        assert "check in eval mode" not in explained, mode
        assert all("observer" in m.reason for m in report.non_additive), mode
    # NEGATIVE CONTROL: with the observers frozen (the fix), the check is exact.
    model.apply(quantization.disable_observer)
    frozen = check_equivalence(model.train(), batch, _mse, 6, dtype=torch.float32)
    assert frozen.ok
    assert frozen.non_additive == ()


class _AlwaysEma(torch.nn.Module):
    """Updates a running mean in every forward, whatever the mode (no `self.training` check)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("average", torch.zeros(4))
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.average.mul_(0.5).add_(0.5 * x.mean(0))
        return self.linear(x - self.average)


def test_state_updated_in_eval_mode_too_is_not_told_to_check_in_eval_mode() -> None:
    report = check_equivalence(_AlwaysEma().eval(), _batch(), _mse, 4)
    assert not report.ok
    assert "even in eval mode" in report.non_additive[0].reason
    assert "check in eval mode" not in report.explain()
    # NEGATIVE CONTROL: in train mode the advice to check in eval mode stays.
    trained = check_equivalence(_AlwaysEma().train(), _batch(), _mse, 4)
    assert "check in eval mode" in trained.explain()


class _Alternating(torch.nn.Module):
    """Counts its calls in a plain attribute and halves its output on every second call."""

    def __init__(self, reads: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.reads, self.calls = torch.nn.Linear(4, 1), reads, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) * (0.5 if self.reads and self.calls % 2 == 0 else 1.0)


class _KeptState(torch.nn.Module):
    """Keeps its LSTM's (h, c) between calls in a plain attribute, as truncated BPTT does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head = torch.nn.LSTM(4, 8, batch_first=True), torch.nn.Linear(8, 1)
        self.state: tuple[torch.Tensor, ...] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x, self.state)
        self.state = tuple(t.detach() for t in state)
        return self.head(out[:, -1])


def test_state_kept_in_plain_attributes_is_named_as_the_cause() -> None:
    """A call counter or a hidden state held in a plain attribute (no buffer) is named; before,
    the gap was blamed on the loss ("not additive over items")."""
    report = check_equivalence(_Alternating(), _batch(12), _mse, 4)
    assert not report.ok
    assert [(m.name, m.kind) for m in report.non_additive] == [("<model>", "_Alternating")]
    assert "calls (plain Python state" in report.non_additive[0].reason
    explained = report.explain()
    assert "register_buffer" in explained
    # Named first; the loss stays a suspect only for attributes the forward does not read.
    assert explained.index("calls (plain Python state") < explained.index("are not read by")
    x = torch.randn(12, 3, 4, generator=torch.Generator().manual_seed(1))
    batch = (x, x[:, -1, :1].clone())
    kept = check_equivalence(_KeptState(), batch, _mse, 4)
    assert not kept.ok
    assert [m.kind for m in kept.non_additive] == ["_KeptState"]
    # Once the full batch has set it, the micro-batches fail on its shape: the error says why.
    model = _KeptState()
    model(x)  # float32 state: cast with the model to the check's float64
    with pytest.raises(RuntimeError, match="hidden") as caught:
        check_equivalence(model, batch, _mse, 4)
    assert "keep state between calls in plain attributes" in "\n".join(caught.value.__notes__)
    assert "<model> (_KeptState)" in "\n".join(caught.value.__notes__)
    # NEGATIVE CONTROL: a counter the forward does not read is listed, but the check is exact.
    counted = check_equivalence(_Alternating(reads=False), _batch(12), _mse, 4)
    assert counted.ok
    # An attribute that only records, next to a loss that is not additive: both are suspects.
    recorded = check_equivalence(_Alternating(reads=False), _batch(12), _squared_mean_residual, 4)
    assert not recorded.ok
    assert "the loss is not additive" in recorded.explain()


class _OwnNoise(torch.nn.Module):
    """Draws its noise from a generator of its own (reproducible noise), not the global one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.generator = torch.nn.Linear(4, 1), torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        if noise is None:  # per item, then one strength per call: split, the draws interleave
            noise = torch.randn(x.shape, generator=self.generator, dtype=x.dtype)
            noise = noise * torch.rand(1, generator=self.generator, dtype=x.dtype)
        return self.linear(x + 0.5 * noise)


def test_draws_from_a_generator_the_model_holds_are_named() -> None:
    """Before, the global generators did not move, so the gap was blamed on the loss."""
    model = _OwnNoise()
    state = model.generator.get_state()
    report = check_equivalence(model, _batch(12), _mse, 4)
    assert not report.ok
    assert [(m.name, m.kind) for m in report.non_additive] == [("<model>", "_OwnNoise")]
    assert "the loss is not additive" not in report.explain()
    assert torch.equal(model.generator.get_state(), state)  # the model's own: copies drew
    # NEGATIVE CONTROL: the noise drawn for the whole batch and passed in it is exact.
    x, y = _batch(12)
    noise = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))

    def passed(model: torch.nn.Module, batch) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0], batch[2]), batch[1])

    exact = check_equivalence(_OwnNoise(), (x, y, noise), passed, 4)
    assert exact.ok
    assert exact.non_additive == ()


def test_draws_outside_the_model_are_named_next_to_dropout() -> None:
    """A diffusion loss_fn drawing timesteps and noise for a model with dropout: both causes are
    named. Before, the dropout alone was (any reason with "random" hid the loss's draws), and
    checking in eval mode as its fix said still failed, on a cause not named before."""
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(2))

    def diffusion(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        t = torch.rand(len(batch), 1)  # per item, then one scale per call: draws interleave
        noise = torch.randn_like(batch) * torch.rand(())
        return torch.nn.functional.mse_loss(model(batch * (1 - t) + noise * t), batch[:, :1])

    report = check_equivalence(_dropout_mlp(), x, diffusion, 4)
    assert [m.kind for m in report.non_additive] == ["Dropout", "random draws"]
    evaluated = check_equivalence(_dropout_mlp().eval(), x, diffusion, 4)
    assert not evaluated.ok
    assert [m.kind for m in evaluated.non_additive] == ["random draws"]
    # NEGATIVE CONTROL: the same model and a loss drawing nothing: the dropout alone, also
    # when the loss_fn calls the model's parts itself rather than the model.
    plain = check_equivalence(_dropout_mlp(), (x, x[:, :1].clone()), _mse, 4)
    assert [m.kind for m in plain.non_additive] == ["Dropout"]

    def by_parts(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        hidden = model[2](model[1](model[0](batch)))
        return torch.nn.functional.mse_loss(model[3](hidden), batch[:, :1])

    parts = check_equivalence(_dropout_mlp(), x, by_parts, 4)
    assert [m.kind for m in parts.non_additive] == ["Dropout"]


def test_mixup_drawn_in_loss_fn_is_named_with_its_fix_and_mixing_the_whole_batch_is_exact() -> None:
    """Mixup inside loss_fn mixes each micro-batch with its own permutation and lambda: named
    with the fix. The control, mixed once on the whole batch with soft targets, is exact."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(10, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=generator)
    model = torch.nn.Linear(4, 3).double()
    functional = torch.nn.functional

    def mixed_in_loss(m: torch.nn.Module, b) -> torch.Tensor:
        perm = torch.randperm(len(b[0]))
        lam = float(torch.distributions.Beta(0.4, 0.4).sample())
        out = m(lam * b[0] + (1 - lam) * b[0][perm])
        return lam * functional.cross_entropy(out, b[1]) + (1 - lam) * functional.cross_entropy(
            out, b[1][perm]
        )

    report = check_equivalence(model, (x, y), mixed_in_loss, 3)
    assert not report.ok
    assert "mixup/CutMix drawn in loss_fn mix only within each micro-batch" in report.explain()
    perm, lam = torch.randperm(10, generator=generator), 0.7
    soft = functional.one_hot(y, 3).double()
    whole = (lam * x + (1 - lam) * x[perm], lam * soft + (1 - lam) * soft[perm])
    soft_ce = lambda m, b: functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    assert check_equivalence(model, whole, soft_ce, 3).ok


_SAMPLER = np.random.default_rng(7)  # a module's negative sampler, named by loss_fn's code


class _TwoTower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users, self.items = torch.nn.Embedding(8, 3), torch.nn.Embedding(12, 3)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return (self.users(users)[:, None] * self.items(items)).sum(-1)


def _sampled_loss(model: torch.nn.Module, b: Any, negatives: torch.Tensor) -> torch.Tensor:
    scores = model(b[0], torch.cat([b[1][:, None], negatives], 1))  # positive first
    return torch.nn.functional.cross_entropy(scores, torch.zeros(len(scores), dtype=torch.long))


def test_negative_sampling_from_a_generator_the_loss_fn_holds_is_forked_and_named() -> None:
    """Negatives drawn in loss_fn from its own generator (a closure's torch.Generator, a module's
    NumPy default_rng, a partial's random.Random): check_equivalence forked the global
    generators only, so its second pass drew other negatives than its first and the gap (1.4)
    was blamed on the loss. Both passes now draw the same ones (exact), the draws are named,
    and each generator is left as found."""
    import functools

    generator = torch.Generator().manual_seed(3)

    def torch_negatives(model: torch.nn.Module, b: Any) -> torch.Tensor:
        drawn = torch.randint(0, 12, (len(b[0]), 4), generator=generator)
        return _sampled_loss(model, b, drawn)

    def numpy_negatives(model: torch.nn.Module, b: Any) -> torch.Tensor:
        return _sampled_loss(model, b, torch.from_numpy(_SAMPLER.integers(0, 12, (len(b[0]), 4))))

    def python_negatives(model: torch.nn.Module, b: Any, rng: random.Random) -> torch.Tensor:
        drawn = [[rng.randrange(12) for _ in range(4)] for _ in range(len(b[0]))]
        return _sampled_loss(model, b, torch.tensor(drawn))

    torch.manual_seed(0)
    model = _TwoTower()
    batch = (torch.randint(0, 8, (11,)), torch.randint(0, 12, (11,)))
    python = random.Random(5)
    sampler = _Sampler()
    for loss_fn, held in (
        (torch_negatives, generator),
        (numpy_negatives, _SAMPLER),
        (functools.partial(python_negatives, rng=python), python),
        (sampler.loss, sampler.rng),  # a bound method's `self.rng`
    ):
        before = _state_bytes(held)
        report = check_equivalence(model, batch, loss_fn, micro_batch_size=4)
        assert report.ok, report.explain()
        assert any(m.kind == "random draws" for m in report.non_additive)
        assert _state_bytes(held) == before  # left as found


class _Sampler:
    def __init__(self) -> None:
        self.rng = torch.Generator().manual_seed(9)

    def loss(self, model: torch.nn.Module, b: Any) -> torch.Tensor:
        return _sampled_loss(model, b, torch.randint(0, 12, (len(b[0]), 4), generator=self.rng))


def _state_bytes(generator: Any) -> bytes:
    if isinstance(generator, torch.Generator):
        return generator.get_state().numpy().tobytes()
    if isinstance(generator, np.random.Generator):
        return pickle.dumps(generator.bit_generator.state)
    return pickle.dumps(generator.getstate())


# --- batch_dim: sequence-first (S, B, ...) batches -------------------------------------------


def test_check_equivalence_takes_batch_dim_for_sequence_first_batches() -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"rnn": torch.nn.GRU(3, 4), "head": torch.nn.Linear(4, 1)})

    def loss_fn(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = m["rnn"](b["x"])  # (S, B, H)
        return torch.nn.functional.mse_loss(m["head"](out[-1]).squeeze(-1), b["y"][0])

    x, y = torch.randn(5, 9, 3), torch.randn(1, 9)
    report = check_equivalence(model, {"x": x, "y": y}, loss_fn, 4, batch_dim=1)
    assert report.ok
    assert report.max_rel_diff < 1e-10
    # Control: along dim 0 (the only split before) the sequences are cut in time.
    with pytest.warns(UserWarning, match="batch_dim=1"):
        cut = check_equivalence(model, {"x": x, "y": y.expand(5, 9)}, loss_fn, 2)
    assert not cut.ok
    with pytest.raises(ValueError, match=r"batch_dim=-1 must be a non-negative int"):
        check_equivalence(model, {"x": x, "y": y}, loss_fn, 4, batch_dim=-1)
    with pytest.raises(ValueError, match=r"needs the batch dimension \(batch_dim=1\)"):
        check_equivalence(model, {"x": x, "y": y[0]}, loss_fn, 4, batch_dim=1)


class RegionProposalNetwork(torch.nn.Module):
    """torchvision's class name: samples a share of its inputs' values at random per call."""

    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.score(x)
        keep = torch.randperm(scores.shape[1])[:2]  # the sampled anchors
        return scores[:, keep].mean(1, keepdim=True)


def test_a_detectors_sampling_heads_are_explained_without_the_eval_mode_advice() -> None:
    """A torchvision detector's `RegionProposalNetwork` and `RoIHeads` sample boxes per image;
    `explain()` told the user to "check with dropout off (eval mode, ...)", where a detector
    returns detections and no loss. They are explained as sampling, naming the sizes per image
    that keep each loss a mean per image; other modules keep the generic advice."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(RegionProposalNetwork())
    report = check_equivalence(model, _batch(), _mse, micro_batch_size=3)
    assert not report.ok
    assert [m.kind for m in report.non_additive] == ["RegionProposalNetwork"]
    explained = report.explain()
    assert "samples anchors and proposals" in explained
    assert "box_batch_size_per_image" in explained
    assert "eval mode, or p=0" not in explained


def _compiled_check() -> EquivalenceReport:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model = torch.compile(net, backend="eager")
    batch = (torch.randn(7, 4), torch.randn(7, 2))

    def loss_fn(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    return check_equivalence(model, batch, loss_fn, micro_batch_size=3)


def test_check_equivalence_on_a_compiled_model_raises_no_global_hook_warning() -> None:
    """torch warns of any global forward hook at each call of a compiled module: a false alarm.

    The hook that learns which modules ran learns nothing under compile (they all count as run),
    so it is not registered there; the report is the same.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*global hooks on modules")
        report = _compiled_check()
    assert report.ok
    assert report.max_rel_diff < 1e-10


def test_negative_control_a_global_forward_hook_makes_torch_warn_at_a_compiled_call() -> None:
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: None)
    try:
        with pytest.warns(UserWarning, match="global hooks on modules"):
            _compiled_check()
    finally:
        handle.remove()
