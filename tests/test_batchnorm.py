"""Tests for gradaccum.batchnorm: pooled and frozen BatchNorm, detection, GroupNorm, recalibrate.

Every reference here is plain PyTorch: a deep copy of the model runs ONE full-batch forward in
train mode, and its running statistics are what "pooled" must reproduce after one window. The
micro-batches are driven by hand, as the Accumulator drives them: each one's forward and backward
inside `control.micro_context()`, then `control.end_window()` at the optimizer step.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradaccum import Accumulator, LossSum, check_equivalence
from gradaccum.batchnorm import (
    BatchNormAccumulationWarning,
    BatchNormControl,
    batchnorm_modules,
    convert_to_groupnorm,
    recalibrate,
    warn_if_inexact,
)

RTOL, ATOL = 1e-10, 1e-12


def _bn_model(kind: str, momentum: float | None = 0.1) -> tuple[nn.Module, tuple[int, ...]]:
    """A layer feeding one BatchNorm, in float64, with non-default running statistics."""
    layers = {
        "1d-NC": (nn.Linear(5, 6), nn.BatchNorm1d(6, momentum=momentum), (5,)),
        "1d-NCL": (nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4, momentum=momentum), (3, 9)),
        "2d": (nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4, momentum=momentum), (2, 6, 6)),
        "3d": (nn.Conv3d(2, 3, 2), nn.BatchNorm3d(3, momentum=momentum), (2, 4, 4, 4)),
        "sync": (nn.Conv2d(2, 4, 3), nn.SyncBatchNorm(4, momentum=momentum), (2, 5, 5)),
    }
    layer, bn, shape = layers[kind]
    model = nn.Sequential(layer, bn, nn.Tanh()).double()
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(bn.num_features))
        bn.running_var.copy_(torch.rand(bn.num_features) + 0.5)
        bn.num_batches_tracked.fill_(3)
    return model, shape


def _data(items: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Items whose mean drifts along the batch: micro-batch statistics differ from the batch's."""
    generator = torch.Generator().manual_seed(seed)
    drift = torch.linspace(-2, 2, items, dtype=torch.float64).view(-1, *[1] * len(shape))
    scale = torch.linspace(0.5, 2, shape[0], dtype=torch.float64).view(
        1, -1, *[1] * (len(shape) - 1)
    )
    return torch.randn(items, *shape, generator=generator, dtype=torch.float64) * scale + drift


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()  # a row mean: a plain `.sum()` is read as one and warns


def _summed(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum()  # for hand-written loops that divide by the batch themselves


def _loss_fn(model: nn.Module, x: torch.Tensor) -> LossSum:
    """`_summed` as a loss_fn: a sum over the rows, with their count (a plain sum warns)."""
    return LossSum(_summed(model, x), len(x))


def _run_window(model, x, micro: int, control: BatchNormControl | None, end: bool = True):
    """One window by hand: each micro-batch's forward + backward in the control's context."""
    for chunk in x.split(micro):
        context = control.micro_context() if control else torch.enable_grad()
        with context:
            _loss(model, chunk).backward()
    if control and end:
        control.end_window()


def _stats(model: nn.Module) -> list[torch.Tensor]:
    return [
        t.clone()
        for _, bn in batchnorm_modules(model)
        for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)
    ]


def _assert_stats_close(actual: nn.Module, expected: nn.Module) -> None:
    for a, e in zip(_stats(actual), _stats(expected), strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)
        else:
            assert torch.equal(a, e)


def _max_rel_gap(actual: nn.Module, expected: nn.Module) -> float:
    pairs = zip(_stats(actual), _stats(expected), strict=True)
    return max(float(((a - e).abs() / e.abs().clamp_min(1e-3)).max()) for a, e in pairs)


# --- pooled: exact running statistics -------------------------------------------------------


@pytest.mark.parametrize("kind", ["1d-NC", "1d-NCL", "2d", "3d", "sync"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_pooled_running_stats_equal_full_batch_over_windows(kind, momentum):
    model, shape = _bn_model(kind, momentum)
    pooled, reference, plain = (copy.deepcopy(model) for _ in range(3))
    control = BatchNormControl(pooled, "pooled")
    for window, (items, micro) in enumerate([(11, 3), (8, 4), (10, 4)]):  # 11, 10: ragged
        x = _data(items, shape, seed=window)
        _run_window(pooled, x, micro, control)
        reference(x)  # the full batch, once: plain PyTorch updates its running stats once
        _run_window(plain, x, micro, None)
        _assert_stats_close(pooled, reference)
    # Negative control: plain PyTorch micro-batches ("micro") are far from the full batch.
    assert _max_rel_gap(plain, reference) > 1e-2


def test_pooled_first_window_single_call_and_ragged_last():
    model, shape = _bn_model("2d")
    pooled, reference = copy.deepcopy(model), copy.deepcopy(model)
    x = _data(10, shape, seed=7)
    _run_window(pooled, x, 4, BatchNormControl(pooled, "pooled"))  # 4 + 4 + 2
    reference(x)
    _assert_stats_close(pooled, reference)
    assert int(pooled[1].num_batches_tracked) == 4  # 3 before, one update for the window


def test_pooled_leaves_forward_and_gradients_as_micro():
    model, shape = _bn_model("2d")
    pooled, plain = copy.deepcopy(model), copy.deepcopy(model)
    x = _data(9, shape, seed=1)
    _run_window(pooled, x, 3, BatchNormControl(pooled, "pooled"))
    _run_window(plain, x, 3, None)
    for p, q in zip(pooled.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_pooled_deeper_batchnorm_sees_micro_normalized_inputs():
    """What "pooled" guarantees for a BatchNorm behind another one: the exact pooled statistics
    of the inputs it saw, which were normalized per micro-batch upstream (not the full batch's)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 5), nn.BatchNorm1d(5)
    ).double()
    pooled, reference, plain = (copy.deepcopy(model) for _ in range(3))
    x = _data(12, (4,), seed=2)
    seen = []
    plain[4].register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    _run_window(plain, x, 3, None)
    _run_window(pooled, x, 3, BatchNormControl(pooled, "pooled"))
    reference(x)
    first = [t for t in _stats(pooled)[:3]], [t for t in _stats(reference)[:3]]
    for a, e in zip(*first, strict=True):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)
    inputs = torch.cat(seen)
    expected_mean = 0.9 * 0.0 + 0.1 * inputs.mean(0)
    expected_var = 0.9 * 1.0 + 0.1 * inputs.var(0, correction=1)
    torch.testing.assert_close(pooled[4].running_mean, expected_mean, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(pooled[4].running_var, expected_var, rtol=RTOL, atol=ATOL)
    gap = (pooled[4].running_var - reference[4].running_var).abs().max()
    assert gap > 1e-3  # the documented limit: the second layer's inputs differ from the batch's


class _Siamese(nn.Module):
    """One BatchNorm applied to two views per forward: two running-stat updates per forward."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(3, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x)) * self.bn(self.lin(x.flip(1) * 3 + 1))


def test_pooled_module_called_twice_gets_two_updates():
    model = _Siamese().double()
    pooled, reference, plain = (copy.deepcopy(model) for _ in range(3))
    x = _data(10, (3,), seed=4)
    _run_window(pooled, x, 4, BatchNormControl(pooled, "pooled"))
    reference(x)
    _run_window(plain, x, 4, None)
    _assert_stats_close(pooled, reference)
    assert int(pooled.bn.num_batches_tracked) == 2
    assert _max_rel_gap(plain, reference) > 1e-2


@pytest.mark.parametrize("reentrant", [False, True])
def test_pooled_ignores_activation_checkpoint_recompute(reentrant):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).double()

    def forward(model, x):
        return checkpoint(model, x.requires_grad_(), use_reentrant=reentrant).pow(2).sum()

    pooled, reference, plain = (copy.deepcopy(block) for _ in range(3))
    x = _data(10, (4,), seed=5)
    control = BatchNormControl(pooled, "pooled")
    for chunk in x.split(4):
        with control.micro_context():
            forward(pooled, chunk.clone()).backward()
        forward(plain, chunk.clone()).backward()
    control.end_window()
    reference(x)
    _assert_stats_close(pooled, reference)
    # The recompute does run BatchNorm again: plain PyTorch counts each micro-batch twice.
    assert int(plain[1].num_batches_tracked) == 2 * 3


def test_pooled_zero_item_micro_batch_adds_nothing():
    model, shape = _bn_model("1d-NC")
    pooled, reference = copy.deepcopy(model), copy.deepcopy(model)
    x = _data(7, shape, seed=6)
    control = BatchNormControl(pooled, "pooled")
    for chunk in (x[:4], x[4:4], x[4:]):
        with control.micro_context():
            _loss(pooled, chunk).backward()
    control.end_window()
    reference(x)
    _assert_stats_close(pooled, reference)


def test_pooled_bf16_autocast_inputs_are_upcast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6))
    seen = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    control = BatchNormControl(model, "pooled")
    x = _data(12, (5,), seed=8).float()
    for chunk in x.split(5):
        with control.micro_context(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(chunk).float().pow(2).sum().backward()
    control.end_window()
    assert seen[0].dtype == torch.bfloat16  # the case under test
    inputs = torch.cat(seen).double()
    expected_var = 0.9 + 0.1 * inputs.var(0, correction=1)
    assert model[1].running_var.dtype == torch.float32
    torch.testing.assert_close(
        model[1].running_mean.double(), 0.1 * inputs.mean(0), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(model[1].running_var.double(), expected_var, rtol=1e-5, atol=1e-6)


def test_pooled_lazy_batchnorm():
    # Uninitialized lazy modules cannot be deep-copied: build two identical ones.
    pooled, reference = (
        nn.Sequential(nn.Linear(5, 6), nn.LazyBatchNorm1d()).double() for _ in range(2)
    )
    reference.load_state_dict(pooled.state_dict(), strict=False)
    x = _data(10, (5,), seed=9)
    _run_window(pooled, x, 4, BatchNormControl(pooled, "pooled"))
    reference(x)
    _assert_stats_close(pooled, reference)


def test_pooled_failed_micro_batch_and_discarded_window_add_nothing():
    model, shape = _bn_model("2d")
    pooled, reference = copy.deepcopy(model), copy.deepcopy(model)
    control = BatchNormControl(pooled, "pooled")
    before = _stats(pooled)
    _run_window(pooled, _data(6, shape, seed=10), 3, control, end=False)
    control.discard_window()
    control.end_window()  # nothing pending: no update
    assert all(torch.equal(a, b) for a, b in zip(_stats(pooled), before, strict=True))
    x = _data(8, shape, seed=11)

    def failing_micro_batch():
        with control.micro_context():
            pooled(x[:5])  # the BatchNorm forward runs, then the micro-batch fails
            raise RuntimeError("CUDA out of memory (simulated)")

    with pytest.raises(RuntimeError, match="out of memory"):
        failing_micro_batch()
    assert pooled[1].track_running_stats
    assert not pooled[1]._forward_pre_hooks
    _run_window(pooled, x, 3, control)
    reference(x)
    _assert_stats_close(pooled, reference)


def test_pooled_state_dict_resumes_mid_window_exactly(tmp_path):
    model, shape = _bn_model("2d", momentum=None)
    straight, resumed, reference = (copy.deepcopy(model) for _ in range(3))
    x = _data(12, shape, seed=12)
    control = BatchNormControl(straight, "pooled")
    _run_window(straight, x[:6], 3, control, end=False)
    torch.save(control.state_dict(), tmp_path / "bn.pt")
    _run_window(straight, x[6:], 3, control)

    fresh = BatchNormControl(resumed, "pooled")
    fresh.load_state_dict(torch.load(tmp_path / "bn.pt", weights_only=True))
    _run_window(resumed, x[6:], 3, fresh)
    reference(x)
    assert all(torch.equal(a, b) for a, b in zip(_stats(resumed), _stats(straight), strict=True))
    _assert_stats_close(resumed, reference)


def test_pooled_load_state_dict_rejects_mismatch_and_changes_nothing():
    model, shape = _bn_model("2d")
    control = BatchNormControl(model, "pooled")
    _run_window(model, _data(6, shape, seed=13), 3, control, end=False)
    good = control.state_dict()
    entry = good["pending"]["1"][0]
    bad_states = {
        "no tracked BatchNorm": {**good, "pending": {"0": good["pending"]["1"]}},
        "of shape": {**good, "pending": {"1": [{**entry, "mean": torch.zeros(5)}]}},
        "count": {**good, "pending": {"1": [{**entry, "count": 0}]}},
        "version": {**good, "version": 99},
    }
    for message, bad in bad_states.items():
        with pytest.raises(ValueError, match=message):
            control.load_state_dict(bad)
        kept = control.state_dict()["pending"]["1"][0]
        assert kept["count"] == entry["count"]
        assert torch.equal(kept["mean"], entry["mean"])
    with pytest.raises(ValueError, match="resume with 'pooled'"):
        BatchNormControl(copy.deepcopy(model), "micro").load_state_dict(good)
    BatchNormControl(copy.deepcopy(model), "micro").load_state_dict(
        BatchNormControl(model, "micro").state_dict()
    )


# --- frozen --------------------------------------------------------------------------------


def test_frozen_keeps_running_stats_bitwise_and_is_exact():
    model, shape = _bn_model("2d")
    frozen, reference, plain, plain_reference = (copy.deepcopy(model) for _ in range(4))
    x = _data(10, shape, seed=14)
    before = _stats(frozen)
    control = BatchNormControl(frozen, "frozen")
    modes = []
    for chunk in x.split(4):
        with control.micro_context():
            modes.append(frozen[1].training)
            (_summed(frozen, chunk) / len(x)).backward()
    control.end_window()
    assert modes == [False] * 3
    assert frozen[1].training
    assert frozen.training
    assert all(torch.equal(a, b) for a, b in zip(_stats(frozen), before, strict=True))
    reference[1].eval()  # the full batch with eval-mode BatchNorm
    (_summed(reference, x) / len(x)).backward()
    for p, q in zip(frozen.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    # Negative control: train-mode micro-batches do not give the train-mode full-batch gradient.
    for chunk in x.split(4):
        (_summed(plain, chunk) / len(x)).backward()
    (_summed(plain_reference, x) / len(x)).backward()
    gap = (plain[0].weight.grad - plain_reference[0].weight.grad).abs().max()
    assert gap > 1e-2 * plain_reference[0].weight.grad.abs().max()


def test_frozen_refuses_batchnorm_without_running_statistics_and_changes_nothing():
    # A BatchNorm built with track_running_stats=False normalizes with batch statistics even in
    # eval mode, so "frozen" cannot make it an affine map: silently it would be inexact.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4, track_running_stats=False),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).double()
    x, y = torch.randn(12, 3, 5, 5, dtype=torch.float64), torch.randint(0, 3, (12,))

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"'4'.*track_running_stats=False.*convert_to_groupnorm"):
        Accumulator(model, optimizer, micro_batch_size=4, batchnorm="frozen")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # Negative control: what "frozen" would do (eval-mode layers) is not the full-batch gradient.
    reference, micro = copy.deepcopy(model).eval(), copy.deepcopy(model).eval()
    loss(reference, (x, y)).backward()
    for start in range(0, 12, 4):
        (loss(micro, (x[start : start + 4], y[start : start + 4])) * 4 / 12).backward()
    gap = (micro[0].weight.grad - reference[0].weight.grad).abs().max()
    assert gap > 1e-3 * reference[0].weight.grad.abs().max()
    # Layers that do track running statistics are frozen exactly (the positive side).
    tracked = copy.deepcopy(model)
    tracked[4] = nn.BatchNorm2d(4).double()
    Accumulator(tracked, torch.optim.SGD(tracked.parameters(), lr=0.1), batchnorm="frozen")


def test_frozen_restores_training_flag_after_an_error():
    model, _shape = _bn_model("2d")
    control = BatchNormControl(model, "frozen")
    with pytest.raises(RuntimeError), control.micro_context():
        raise RuntimeError("boom")
    assert model[1].training


def test_micro_mode_is_plain_pytorch():
    model, shape = _bn_model("2d")
    ours, plain = copy.deepcopy(model), copy.deepcopy(model)
    x = _data(9, shape, seed=15)
    _run_window(ours, x, 3, BatchNormControl(ours, "micro"))
    _run_window(plain, x, 3, None)
    assert all(torch.equal(a, b) for a, b in zip(_stats(ours), _stats(plain), strict=True))


def test_control_rejects_unknown_mode():
    with pytest.raises(ValueError, match="batchnorm='ghost'"):
        BatchNormControl(nn.BatchNorm1d(2), "ghost")


# --- detection -----------------------------------------------------------------------------


def test_warn_if_inexact_counts_eval_batchnorm_without_running_stats():
    # In eval mode, a BatchNorm without running statistics still normalizes with the batch's.
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3, track_running_stats=False)).eval()
    with pytest.warns(BatchNormAccumulationWarning, match=r"\(1\)"):
        assert warn_if_inexact(model, micro_items=2, window_items=8)


def test_warn_if_inexact_names_the_problem_and_the_strategies():
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3))
    with pytest.warns(BatchNormAccumulationWarning) as record:
        assert warn_if_inexact(model, micro_items=4, window_items=16)
    message = str(record[0].message)
    for text in ("1", "micro-batch statistics", "running statistics", "pooled", "frozen"):
        assert text in message
    assert "convert_to_groupnorm" in message
    assert "recalibrate" in message


@pytest.mark.parametrize(
    ("model", "micro", "window"),
    [
        (nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), 8, 8),  # micro-batch == window
        (nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)).eval(), 2, 8),  # eval mode
        (nn.Sequential(nn.Linear(2, 3), nn.GroupNorm(1, 3)), 2, 8),  # no BatchNorm
    ],
)
def test_warn_if_inexact_silent_when_exact(model, micro, window):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_inexact(model, micro, window)


def test_warn_once_per_control_and_only_in_micro_mode():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    control = BatchNormControl(model, "micro")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [control.warn_once(2, 8) for _ in range(3)]
        for mode in ("pooled", "frozen"):
            assert not BatchNormControl(model, mode).warn_once(2, 8)
    assert results == [True, False, False]
    assert [type(w.message) for w in caught] == [BatchNormAccumulationWarning]


def test_batchnorm_modules_finds_every_kind():
    model = nn.Sequential(
        nn.BatchNorm1d(2), nn.Sequential(nn.BatchNorm2d(2), nn.SyncBatchNorm(2)), nn.Linear(2, 2)
    )
    assert [name for name, _ in batchnorm_modules(model)] == ["0", "1.0", "1.1"]


# --- GroupNorm conversion ------------------------------------------------------------------


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(2, 48, 3, padding=1), nn.BatchNorm2d(48)
        self.conv2, self.bn2 = nn.Conv2d(48, 12, 3), nn.BatchNorm2d(12, affine=False)
        self.seq = nn.Sequential(nn.Conv1d(12, 64, 1), nn.SyncBatchNorm(64))
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        h = torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))
        return self.head(self.seq(h.flatten(2)).mean(2))


def test_convert_to_groupnorm_replaces_every_batchnorm():
    torch.manual_seed(0)
    model = _ConvNet().double()
    with torch.no_grad():
        model.bn1.weight.uniform_(0.5, 2)
        model.bn1.bias.uniform_(-1, 1)
    model.bn1.bias.requires_grad_(False)
    x = torch.randn(6, 2, 7, 7, dtype=torch.float64)
    batch = (x, torch.randn(6, 3, dtype=torch.float64))
    mse = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    before_report = check_equivalence(model, batch, mse, micro_batch_size=2)
    shape_before = model(x).shape
    weight, bias = model.bn1.weight.detach().clone(), model.bn1.bias.detach().clone()

    converted = convert_to_groupnorm(model)
    assert converted is model
    assert not batchnorm_modules(model)
    assert (model.bn1.num_groups, model.bn2.num_groups, model.seq[1].num_groups) == (24, 12, 32)
    assert torch.equal(model.bn1.weight, weight)
    assert torch.equal(model.bn1.bias, bias)
    assert not model.bn1.bias.requires_grad
    assert model.bn2.weight is None
    assert model.bn1.weight.dtype == torch.float64
    assert model.bn1.eps == 1e-5
    assert model(x).shape == shape_before
    after = check_equivalence(model, batch, mse, micro_batch_size=2)
    assert after.ok
    assert not after.non_additive
    # Negative control: the BatchNorm model is not exact and names its BatchNorm layers.
    assert not before_report.ok
    assert [m.name for m in before_report.non_additive] == ["bn1", "bn2", "seq.1"]


def test_convert_to_groupnorm_single_module_and_bad_groups():
    bn = nn.BatchNorm1d(10).eval()
    gn = convert_to_groupnorm(bn, num_groups=4)
    assert isinstance(gn, nn.GroupNorm)
    assert gn.num_groups == 2
    assert not gn.training
    with pytest.raises(ValueError, match="num_groups"):
        convert_to_groupnorm(nn.BatchNorm1d(3), num_groups=0)


# --- recalibrate ---------------------------------------------------------------------------


def _recal_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 5), nn.BatchNorm1d(5)
    ).double()


def test_recalibrate_gives_exact_population_statistics():
    model = _recal_model()
    model[1].eval()  # mixed flags must come back as they were
    batches = [_data(n, (4,), seed=20 + i) * (i + 1) for i, n in enumerate([5, 9, 3, 7])]
    loader = [(b, torch.zeros(len(b))) for b in batches]  # tuples: model(batch[0])
    params = [p.clone() for p in model.parameters()]
    nbt = [bn.num_batches_tracked.clone() for _, bn in batchnorm_modules(model)]

    # Plain reference: BatchNorm in train mode, dropout off, inputs of each BatchNorm collected.
    plain = copy.deepcopy(model).eval()
    plain[1].train()
    plain[4].train()
    seen = {1: [], 4: []}
    for index in seen:
        plain[index].register_forward_pre_hook(lambda m, a, i=index: seen[i].append(a[0]))
    with torch.no_grad():
        for b in batches[:3]:
            plain(b)

    recalibrate(model, loader, num_batches=3)
    for index, inputs in seen.items():
        inputs = torch.cat(inputs)
        assert len(inputs) == 17  # the fourth batch is not used
        bn = model[index]
        torch.testing.assert_close(bn.running_mean, inputs.mean(0), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(bn.running_var, inputs.var(0), rtol=RTOL, atol=ATOL)
        # Negative control: the average of per-batch variances (equal weight per batch).
        per_batch = torch.stack([t.var(0) for t in seen[index]]).mean(0)
        assert (per_batch - bn.running_var).abs().max() > 1e-2 * bn.running_var.abs().max()
    assert [m.training for m in model.modules()] == [True, True, False, True, True, True]
    assert all(bn.track_running_stats for _, bn in batchnorm_modules(model))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert [bn.num_batches_tracked for _, bn in batchnorm_modules(model)] == nbt
    assert not model[1]._forward_pre_hooks


def test_recalibrate_custom_forward_and_dict_batches():
    model = _recal_model()
    batches = [{"x": _data(6, (4,), seed=30 + i)} for i in range(2)]
    reference = copy.deepcopy(model)
    recalibrate(model, batches, num_batches=5, forward=lambda m, b: m(b["x"]))
    plain = nn.Sequential(reference[0])  # the first BatchNorm's inputs need no BatchNorm
    with torch.no_grad():
        inputs = plain(torch.cat([b["x"] for b in batches]))
    torch.testing.assert_close(model[1].running_var, inputs.var(0), rtol=RTOL, atol=ATOL)
    with pytest.raises(TypeError):
        recalibrate(_recal_model(), batches, num_batches=1)  # model(**batch): no 'x' argument


def test_recalibrate_rejects_nothing_to_do_and_changes_nothing():
    model = _recal_model()
    before = _stats(model)
    with pytest.raises(ValueError, match="num_batches"):
        recalibrate(model, [torch.randn(3, 4)], num_batches=0)
    with pytest.raises(ValueError, match="no item"):
        recalibrate(model, [], num_batches=2)
    assert all(torch.equal(a, b) for a, b in zip(_stats(model), before, strict=True))
    assert model.training


# ---------------------------------------------------------------------------------------------
# Through the Accumulator: the same guarantees with the library driving the micro-batches
# ---------------------------------------------------------------------------------------------


def _accumulator(model: nn.Module, batchnorm: str, **kwargs) -> Accumulator:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return Accumulator(model, optimizer, batchnorm=batchnorm, **kwargs)


@pytest.mark.parametrize("kind", ["1d-NC", "2d", "3d"])
def test_accumulator_pooled_step_gives_full_batch_running_stats(kind: str) -> None:
    model, shape = _bn_model(kind)
    x = _data(14, shape, seed=4)
    full = copy.deepcopy(model)
    with torch.no_grad():
        full(x)  # one full-batch forward: the running statistics "pooled" must reproduce
    acc = _accumulator(model, "pooled", micro_batch_size=4)  # 4 + 4 + 4 + 2 items
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit strategy does not warn
        acc.step(x, _loss_fn)
    _assert_stats_close(model, full)
    # NEGATIVE CONTROL: "micro" updates four times from micro-batch statistics.
    micro_model, _ = _bn_model(kind)
    with pytest.warns(BatchNormAccumulationWarning):
        _accumulator(micro_model, "micro", micro_batch_size=4).step(x, _loss_fn)
    assert _max_rel_gap(micro_model, full) > 1e-2


def test_accumulator_pooled_streaming_resume_mid_window_is_bitwise() -> None:
    model, shape = _bn_model("2d")
    x = _data(12, shape, seed=5)
    straight = copy.deepcopy(model)
    acc = _accumulator(straight, "pooled", accumulation_steps=3)
    for part in x.split(4):
        acc.micro_step(part, _loss_fn)
    resumed = copy.deepcopy(model)
    first = _accumulator(resumed, "pooled", accumulation_steps=3)
    first.micro_step(x[:4], _loss_fn)
    state = copy.deepcopy(first.state_dict())
    second = _accumulator(resumed, "pooled", accumulation_steps=3)  # a fresh process, say
    second.optimizer.load_state_dict(first.optimizer.state_dict())
    second.load_state_dict(state)
    second.micro_step(x[4:8], _loss_fn)
    assert second.micro_step(x[8:], _loss_fn).stepped
    for a, b in zip(_stats(resumed), _stats(straight), strict=True):
        assert torch.equal(a, b)


def test_accumulator_state_refuses_another_batchnorm_mode() -> None:
    model, _ = _bn_model("1d-NC")
    state = _accumulator(model, "pooled", accumulation_steps=2).state_dict()
    other = _accumulator(model, "micro", accumulation_steps=2)
    with pytest.raises(ValueError, match="batchnorm='pooled'"):
        other.load_state_dict(state)


def test_accumulator_frozen_keeps_running_stats_bitwise() -> None:
    model, shape = _bn_model("2d")
    before = [t.clone() for t in _stats(model)]
    acc = _accumulator(model, "frozen", micro_batch_size=3)
    for seed in range(3):
        assert acc.step(_data(9, shape, seed), _loss_fn).stepped
    assert all(torch.equal(a, b) for a, b in zip(_stats(model), before, strict=True))
    assert model[1].training  # put back in train mode after each micro-batch


def test_accumulator_pooled_skipped_window_changes_no_statistic() -> None:
    model, shape = _bn_model("1d-NC")
    before = [t.clone() for t in _stats(model)]
    acc = _accumulator(model, "pooled", micro_batch_size=2)

    def nan_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).sum() * float("nan")

    assert acc.step(_data(6, shape, seed=1), nan_loss).skipped
    assert all(torch.equal(a, b) for a, b in zip(_stats(model), before, strict=True))


def test_accumulator_warns_once_and_not_when_the_micro_batch_is_the_window() -> None:
    model, shape = _bn_model("1d-NC")
    acc = _accumulator(model, "micro", micro_batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.step(_data(8, shape, seed=1), _loss_fn)  # one micro-batch: exact, silent
        acc.step(_data(16, shape, seed=2), _loss_fn)  # two: warns
        acc.step(_data(16, shape, seed=3), _loss_fn)  # again: already warned
    found = [w for w in caught if issubclass(w.category, BatchNormAccumulationWarning)]
    assert len(found) == 1
    assert "pooled" in str(found[0].message)
    assert found[0].filename.endswith("test_batchnorm.py")  # points at the caller's line


def test_convert_to_groupnorm_refuses_an_uninitialized_lazy_batchnorm_naming_it() -> None:
    """A LazyBatchNorm before its first forward has no channel count: say so, change nothing."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match=r"'2'.*LazyBatchNorm2d.*forward"):
        convert_to_groupnorm(model)
    assert isinstance(model[1], nn.BatchNorm2d)  # nothing was replaced
    assert isinstance(model[2], nn.LazyBatchNorm2d)
    # After one forward it has its channels and converts (the positive side).
    model(torch.randn(2, 3, 6, 6))
    converted = convert_to_groupnorm(model, num_groups=4)
    assert [type(m).__name__ for m in converted] == ["Conv2d", "GroupNorm", "GroupNorm"]
    assert converted[2].num_channels == 8


@pytest.mark.parametrize("mode", ["micro", "pooled"])
def test_a_last_micro_batch_of_one_row_says_why_it_fails_and_changes_nothing(mode: str) -> None:
    """10 rows by 3 leave a last micro-batch of 1 row, which a train-mode BatchNorm1d refuses
    ("Expected more than 1 value per channel") though the full batch of 10 passes. Before, the
    error said nothing of the micro-batch; now a note names it and the fixes."""
    model, shape = _bn_model("1d-NC")
    acc = _accumulator(model, mode, micro_batch_size=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchNormAccumulationWarning)
        assert acc.step(_data(9, shape, seed=1), _loss_fn).stepped
    before = [p.detach().clone() for p in model.parameters()] + _stats(model)
    with pytest.raises(ValueError, match="more than 1 value per channel") as error:
        acc.step(_data(10, shape, seed=2), _loss_fn)
    notes = " ".join(getattr(error.value, "__notes__", []))
    assert "micro-batch of 1 row" in notes
    assert "batchnorm='frozen'" in notes
    after = [p.detach().clone() for p in model.parameters()] + _stats(model)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # Control: the full batch of 10 rows runs, and "frozen" runs the 1-row micro-batch too.
    model(_data(10, shape, seed=2))
    frozen = _accumulator(copy.deepcopy(model), "frozen", micro_batch_size=3)
    assert frozen.step(_data(10, shape, seed=2), _loss_fn).stepped


def test_frozen_holds_when_loss_fn_calls_model_train() -> None:
    """`model.train()` inside loss_fn (a defensive habit) switched a frozen BatchNorm back to
    batch statistics mid-window: running statistics moved and the step was ghost BN, silently."""
    model, shape = _bn_model("2d")
    x = _data(10, shape, seed=3)

    def mean_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()  # a mean over items, as a plain scalar is read

    def habit(model: nn.Module, x: torch.Tensor) -> LossSum:
        model.train()
        return mean_loss(model, x)

    def reference(bn_training: bool) -> list[torch.Tensor]:
        full = copy.deepcopy(model)
        optimizer = torch.optim.SGD(full.parameters(), lr=0.05, momentum=0.9)
        full[1].train(bn_training)
        mean_loss(full, x).backward()
        optimizer.step()
        return [p.detach().clone() for p in full.parameters()]

    frozen = copy.deepcopy(model)
    stats = _stats(frozen)
    assert _accumulator(frozen, "frozen", micro_batch_size=3).step(x, habit).stepped
    assert all(torch.equal(a, b) for a, b in zip(_stats(frozen), stats, strict=True))
    assert frozen[1].training
    ours = [p.detach() for p in frozen.parameters()]
    expected = reference(bn_training=False)
    for a, e in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)
    # Negative control: BatchNorm on batch statistics gives another step.
    control = reference(bn_training=True)
    assert max(float((a - c).abs().max()) for a, c in zip(ours, control, strict=True)) > 1e-3


@pytest.mark.parametrize("mode", ["micro", "pooled", "frozen"])
def test_a_failed_window_restores_statistics_a_loss_fn_put_in_train_mode(mode: str) -> None:
    """A model in eval mode whose loss_fn calls model.train(): its BatchNorm updates running
    statistics from the first micro-batch on. Before, only the layers in train mode when the
    window opened were saved, so a failure later left those updates behind."""
    model, shape = _bn_model("1d-NC")
    model.eval()
    acc = _accumulator(model, mode, micro_batch_size=3)
    calls: list[int] = []

    def habit(model: nn.Module, x: torch.Tensor) -> LossSum:
        model.train()
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("loss_fn failed at the third micro-batch")
        return _loss_fn(model, x)

    before = _stats(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchNormAccumulationWarning)
        with pytest.raises(RuntimeError, match="third micro-batch"):
            acc.step(_data(9, shape, seed=5), habit)
    assert len(calls) == 3  # two micro-batches ran in train mode before the failure
    assert all(torch.equal(a, b) for a, b in zip(_stats(model), before, strict=True))


def test_pooled_pools_a_batchnorm_a_loss_fn_put_in_train_mode() -> None:
    """A model in eval mode whose loss_fn calls model.train(): before, the first micro-batch's
    BatchNorm was not pooled (it was in eval mode as the micro-batch began) and updated its
    running statistics itself, one update more than the full batch makes."""
    model, shape = _bn_model("1d-NC")
    model.eval()
    x = _data(9, shape, seed=6)
    full = copy.deepcopy(model).train()
    with torch.no_grad():
        full(x)  # the one full-batch update "pooled" must reproduce

    def habit(model: nn.Module, x: torch.Tensor) -> LossSum:
        model.train()
        return _loss_fn(model, x)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # statistics only
    Accumulator(model, optimizer, micro_batch_size=3, batchnorm="pooled").step(x, habit)
    _assert_stats_close(model, full)
    assert model[1].track_running_stats


def _micro_run(resume: str | None, fail: bool = True) -> dict:
    """A `batchnorm="micro"` stream of 9 micro-batches, windows of 3; micro-batch 4 (in the
    second window) raises, so that window is forgotten. `resume`: after micro-batch 3 (an open
    window), a checkpoint is loaded into fresh objects built from another seed, by
    `load_checkpoint` (which loads the Accumulator before the model) or by hand in either order.
    """
    import tempfile
    from pathlib import Path

    from gradaccum import LossSum, load_checkpoint, save_checkpoint

    def build(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        model = model.double()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, Accumulator(model, optimizer, accumulation_steps=3)

    def loss(model: nn.Module, batch) -> LossSum:
        return LossSum(((model(batch[0]) - batch[1]) ** 2).sum(), batch[0].shape[0] * 3)

    def failing(model: nn.Module, batch) -> LossSum:
        model(batch[0])  # moves the running statistics, then fails
        raise RuntimeError("boom")

    generator = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(4, 5, generator=generator, dtype=torch.float64) + 2,
         torch.randn(4, 3, generator=generator, dtype=torch.float64))
        for _ in range(9)
    ]  # fmt: skip
    model, optimizer, acc = build(1)
    for index, batch in enumerate(data):
        if index == 4 and resume is not None:
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "ckpt.pt"
                save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
                model, optimizer, acc = build(5)
                if resume == "load_checkpoint":
                    load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
                else:
                    saved = torch.load(path, weights_only=True)
                    first, second = (acc, model) if resume == "accumulator first" else (model, acc)
                    first.load_state_dict(saved["accumulator" if first is acc else "model"])
                    second.load_state_dict(saved["accumulator" if second is acc else "model"])
                    optimizer.load_state_dict(saved["optimizer"])
        if index == 4 and fail:
            with pytest.raises(RuntimeError, match="boom"):
                acc.micro_step(batch, failing)
            continue
        acc.micro_step(batch, loss)
    return copy.deepcopy(model.state_dict())


@pytest.mark.parametrize("resume", ["load_checkpoint", "accumulator first", "model first"])
def test_micro_window_failing_after_a_mid_window_resume_restores_its_start(resume: str) -> None:
    """A window resumed mid-window then failing puts the running statistics back where the
    window began, as the uninterrupted run does. The start used to be taken when the state was
    loaded: `load_checkpoint` loads the Accumulator before the model, so a failure reset the
    statistics to the fresh model's (zeros and ones); loaded after the model, to the
    mid-window ones."""
    expected = _micro_run(None)
    resumed = _micro_run(resume)
    for name, tensor in expected.items():
        assert torch.equal(resumed[name], tensor), name


def test_negative_control_the_failure_moves_the_statistics() -> None:
    """Control: without the failure the run ends elsewhere, so the test above can fail."""
    with_failure, without = _micro_run(None), _micro_run(None, fail=False)
    assert not torch.equal(with_failure["1.running_mean"], without["1.running_mean"])


def test_a_window_start_is_saved_only_while_a_window_is_open() -> None:
    """`start` is the open window's; a closed window's state holds none, loaded or not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    loss = lambda m, x: m(x).pow(2).mean()  # noqa: E731
    x = torch.randn(4, 3, dtype=torch.float64)
    acc.micro_step(x, loss)
    assert len(acc.state_dict()["engine"]["batchnorm"]["start"]) == 3  # mean, var, count
    closed = Accumulator(model, optimizer, accumulation_steps=2).state_dict()
    acc.load_state_dict(closed)  # the open window is replaced by a closed one
    assert acc.state_dict()["engine"]["batchnorm"]["start"] == []


class _ConvBlock(nn.Module):
    """A residual block of its own `forward` (Dynamo skips frames of torch's own modules)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class _ResidualConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.blocks = nn.Sequential(*[_ConvBlock(4) for _ in range(10)])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.bn(self.stem(x)))).mean((2, 3)))


def test_pooled_under_torch_compile_traces_its_hooks_and_equals_eager() -> None:
    """`batchnorm="pooled"` on a `torch.compile`d model: its statistics hook broke the graph at
    every BatchNorm (it asked autograd whether a backward runs, which Dynamo cannot trace), and
    each break's resume frame was specialized per layer name: 15 frames here against 2 for
    "micro" (ResNet-18: 34, past Dynamo's recompile limit of 8, which then runs them eagerly).
    Compiled, the recorded statistics are traced with the forward: one frame, and the weights and
    running statistics bitwise those of the eager pooled run."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    eager_model = _ResidualConvNet()
    compiled_model = copy.deepcopy(eager_model)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(10, 2, 6, 6, generator=generator) * (i + 1), None) for i in range(2)]
    targets = torch.randn(10, 1, generator=generator)
    batches = [(x, targets) for x, _ in batches]

    def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    def frames_and_state(model: nn.Module, mode: str, compiled: bool) -> tuple[int, dict]:
        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped = torch.compile(model, backend=counter, dynamic=True) if compiled else model
        acc = Accumulator(wrapped, optimizer, micro_batch_size=4, batchnorm=mode)
        for batch in batches:
            acc.step(batch, mse)
        torch._dynamo.reset()
        return counter.frame_count, model.state_dict()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchNormAccumulationWarning)  # micro, knowingly
        micro_frames, _ = frames_and_state(copy.deepcopy(eager_model), "micro", compiled=True)
    _, eager = frames_and_state(eager_model, "pooled", compiled=False)
    frames, compiled_state = frames_and_state(compiled_model, "pooled", compiled=True)
    assert frames == micro_frames <= 2  # what the model compiles to without the hooks
    for key, value in eager.items():
        assert torch.equal(compiled_state[key], value), key
    # The statistics were pooled, not left to the BatchNorm: one update per window.
    assert int(compiled_state["bn.num_batches_tracked"]) == 2


class _Distiller(nn.Module):
    """A student and its frozen teacher (with BatchNorm) in one module, as KD code holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        self.student = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        self.teacher.requires_grad_(False)
        with torch.no_grad():
            self.teacher[1].running_mean.uniform_(-1, 1)
            self.teacher[1].running_var.uniform_(0.5, 2)


def _distill(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    with torch.no_grad():
        target = model.teacher(x)
    student = model.student(x)
    soft = nn.functional.kl_div(
        nn.functional.log_softmax(student / 2, -1),
        nn.functional.log_softmax(target / 2, -1),
        reduction="batchmean",
        log_target=True,
    )
    return 4 * soft + nn.functional.cross_entropy(student, y)


def _distilled(model: nn.Module, batch, micro: int | None) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.student.parameters(), lr=0.1, momentum=0.9)
    if micro is not None:
        Accumulator(model, optimizer, micro_batch_size=micro).step(batch, _distill)
    else:
        _distill(model, batch).backward()
        optimizer.step()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_a_frozen_teachers_batchnorm_left_in_train_mode_is_named_with_eval_as_the_fix():
    """model.train() puts a frozen teacher's BatchNorm in train mode: the warning named only
    the student-wide fixes (batchnorm='frozen', GroupNorm); it now names the teacher's layer and
    eval mode, which makes the distillation step the full-batch one."""
    torch.manual_seed(0)
    model = _Distiller().double().train()
    batch = (torch.randn(12, 4, dtype=torch.float64), torch.randint(0, 3, (12,)))
    with pytest.warns(BatchNormAccumulationWarning, match=r"Of these, teacher\.1 train no param"):
        in_train = _distilled(model, batch, micro=5)
    model.teacher.eval()  # the fix the warning names
    reference = _distilled(model, batch, micro=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = _distilled(model, batch, micro=5)
    assert all(torch.allclose(fixed[k], reference[k], rtol=1e-10, atol=1e-12) for k in reference)
    # Control: left in train mode, the teacher's targets come from micro-batch statistics.
    gaps = [float((in_train[k] - reference[k]).abs().max()) for k in reference]
    assert max(gaps) > 1e-3
    # A trainable BatchNorm (the student's own) is not called a teacher's.
    student = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    acc = Accumulator(student, torch.optim.SGD(student.parameters(), lr=0.1), micro_batch_size=5)
    with pytest.warns(BatchNormAccumulationWarning) as caught:
        acc.step(batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    assert "Of these" not in str(caught[0].message)
