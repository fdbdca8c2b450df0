"""Tests for gradaccum.window: the micro-batch engine and `accumulate_grad`."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import gradaccum
from gradaccum import LossSum, accumulate_grad
from gradaccum._parameters import trainable_parameters, window_parameters
from gradaccum.window import Window


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    return model.double()


def _data(items: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(items, 5, generator=generator, dtype=torch.float64)
    y = torch.randn(items, 2, generator=generator, dtype=torch.float64) * 2
    return x, y


def _mse(model: torch.nn.Module, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _sse(model: torch.nn.Module, batch) -> LossSum:
    value = torch.nn.functional.mse_loss(model(batch[0]), batch[1], reduction="sum")
    return LossSum(value, len(batch[0]))


def _reference_grads(model: torch.nn.Module, batch, loss) -> list[torch.Tensor]:
    """Plain full-batch float64 gradient, written without the library."""
    twin = copy.deepcopy(model)
    return list(torch.autograd.grad(loss(twin, batch), list(twin.parameters())))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _rel_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    flat_a = torch.cat([t.flatten() for t in a])
    flat_b = torch.cat([t.flatten() for t in b])
    return float((flat_a - flat_b).norm() / flat_b.norm())


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4, 5, 11, 16])
def test_accumulate_grad_is_the_full_batch_gradient(micro_batch_size: int) -> None:
    model = _mlp()
    batch = _data()
    expected = _reference_grads(model, batch, _mse)
    before = [p.detach().clone() for p in model.parameters()]

    result = accumulate_grad(model, batch, _mse, micro_batch_size)

    for got, want in zip(_grads(model), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    # No optimizer step: parameters are untouched.
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    assert isinstance(result, LossSum)
    assert result.count == 11
    assert not result.value.requires_grad
    assert (result.value / result.count).item() == pytest.approx(
        _mse(model, batch).item(), rel=1e-12
    )


def test_negative_control_mean_of_micro_means_is_far_from_the_reference() -> None:
    model = _mlp()
    x, y = _data()
    expected = _reference_grads(model, (x, y), _mse)
    accumulate_grad(model, (x, y), _mse, 4)  # micro-batches of 4, 4, 3
    assert _rel_gap(_grads(model), expected) < 1e-12

    twin = copy.deepcopy(model)
    means = [_mse(twin, (x[s : s + 4], y[s : s + 4])) for s in (0, 4, 8)]
    naive = torch.autograd.grad(sum(means) / 3, list(twin.parameters()))
    assert _rel_gap(list(naive), expected) > 1e-2


def test_accumulate_grad_normalize_sum() -> None:
    model = _mlp()
    batch = _data()
    expected = _reference_grads(model, batch, lambda m, b: _sse(m, b).value)
    result = accumulate_grad(model, batch, _sse, 3, normalize="sum")
    for got, want in zip(_grads(model), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert result.value.item() == pytest.approx(_sse(model, batch).value.item(), rel=1e-12)


def test_accumulate_grad_replaces_existing_gradients() -> None:
    model = _mlp()
    batch = _data()
    expected = _reference_grads(model, batch, _mse)
    for p in model.parameters():
        p.grad = torch.full_like(p, 123.0)
    accumulate_grad(model, batch, _mse, 3)
    for got, want in zip(_grads(model), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_accumulate_grad_restores_gradients_when_a_micro_batch_fails() -> None:
    model = _mlp()
    batch = _data()
    old = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), old, strict=True):
        p.grad = g
    snapshot = [g.clone() for g in old]
    calls = []

    def flaky(m, b):
        calls.append(len(b[0]))
        if len(calls) == 3:
            return m(b[0]).sum(dim=1)  # not a scalar: rejected before its backward
        return _mse(m, b)

    with pytest.raises(ValueError, match="it must be a scalar"):
        accumulate_grad(model, batch, flaky, 2)
    assert len(calls) == 3
    for p, g, s in zip(model.parameters(), old, snapshot, strict=True):
        assert p.grad is g
        assert torch.equal(p.grad, s)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["loss", "backward"])
def test_a_failing_accumulate_grad_puts_the_batchnorm_statistics_back(where: str, error) -> None:
    """Before, only the gradients came back: the statistics kept the earlier micro-batches'
    updates, while the note said they were as before the window."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Tanh(), torch.nn.Linear(7, 2)
    ).double()
    held = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), held, strict=True):
        p.grad = g
    before = copy.deepcopy(model.state_dict())
    calls = []

    def flaky(m, b):
        calls.append(1)
        out = m(b[0])
        if len(calls) == 3 and where == "backward":
            out.register_hook(_raise(error))  # raises inside the third backward
        elif len(calls) == 3:
            raise error()
        return torch.nn.functional.mse_loss(out, b[1])

    with pytest.raises(error) as info:
        accumulate_grad(model, _data(12), flaky, 2)
    assert len(calls) == 3  # two micro-batches updated the statistics before the failure
    if hasattr(info.value, "__notes__"):
        assert any("BatchNorm statistics" in note for note in info.value.__notes__)
    after = model.state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert all(p.grad is g for p, g in zip(model.parameters(), held, strict=True))
    # NEGATIVE CONTROL: the same micro-batches without the failure do move the statistics.
    accumulate_grad(model, _data(12), _mse, 2)
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    assert model[1].num_batches_tracked.item() == 6


def _raise(error):
    def hook(grad: torch.Tensor) -> None:
        raise error()

    return hook


def test_accumulate_grad_refuses_an_optimizer_stepped_in_the_backward() -> None:
    """PyTorch's optimizer-in-backward recipe stepped each parameter once per micro-batch of
    `accumulate_grad`, silently; refused before any step, weights and gradients as before."""
    model, batch = _mlp(), _data()
    weights = [p.detach().clone() for p in model.parameters()]
    inner = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: inner[p].step())
    with pytest.raises(RuntimeError, match="optimizer-in-backward"):
        accumulate_grad(model, batch, _mse, 4)
    for param, weight in zip(model.parameters(), weights, strict=True):
        assert torch.equal(param, weight)
        assert param.grad is None


def test_accumulate_grad_rejects_bad_arguments_before_any_work() -> None:
    model = _mlp()
    batch = _data()
    calls = []

    def counting(m, b):
        calls.append(1)
        return _mse(m, b)

    with pytest.raises(ValueError, match="micro_batch_size=0 must be a positive int"):
        accumulate_grad(model, batch, counting, 0)
    with pytest.raises(ValueError, match="normalize='avg' is not a valid choice"):
        accumulate_grad(model, batch, counting, 2, normalize="avg")
    assert calls == []
    assert all(p.grad is None for p in model.parameters())


def test_loss_without_graph_is_rejected_and_changes_no_gradient() -> None:
    model = _mlp()
    batch = _data()

    def detached(m, b):
        return _mse(m, b).detach()

    with pytest.raises(ValueError, match="does not require grad"):
        accumulate_grad(model, batch, detached, 4)
    assert all(p.grad is None for p in model.parameters())


def _backward_inside(retain: bool, from_micro_batch: int = 0):
    calls = {"n": 0}

    def loss_fn(m, b):  # the classic blog bug: loss.backward() inside the loss function
        loss = _mse(m, b)
        calls["n"] += 1
        if calls["n"] > from_micro_batch:
            (loss * len(b[0]) / 11).backward(retain_graph=retain)
        return loss

    return loss_fn


@pytest.mark.parametrize("retain", [True, False])
@pytest.mark.parametrize("from_micro_batch", [0, 1])
def test_a_loss_that_runs_its_own_backward_is_refused_and_changes_no_gradient(
    retain: bool, from_micro_batch: int
) -> None:
    model = _mlp()
    batch = _data()
    held = [torch.full_like(p, 3.0) for p in model.parameters()]
    for param, grad in zip(model.parameters(), held, strict=True):
        param.grad = grad
    with pytest.raises(ValueError, match=r"loss_fn ran a backward itself.*Remove the \.backward"):
        accumulate_grad(model, batch, _backward_inside(retain, from_micro_batch), 4)
    assert all(p.grad is g for p, g in zip(model.parameters(), held, strict=True))
    assert all(torch.equal(g, torch.full_like(g, 3.0)) for g in held)
    # Negative control: a hand loop running that loss_fn and its own backward of the returned
    # loss counts every micro-batch twice (retain_graph=True: no error to stop it).
    naive, reference = _mlp(), _mlp()
    loss_fn = _backward_inside(retain=True)
    for start in range(0, 11, 4):
        micro = (batch[0][start : start + 4], batch[1][start : start + 4])
        (loss_fn(naive, micro) * len(micro[0]) / 11).backward()
    _mse(reference, batch).backward()
    for got, want in zip(naive.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, 2 * want.grad, rtol=1e-10, atol=1e-12)


def test_zero_count_micro_batch_in_accumulate_grad() -> None:
    model = _mlp()
    x, y = _data()
    weights = torch.ones(11, dtype=torch.float64)
    weights[4:8] = 0.0  # micro-batch 1 of size 4 counts nothing

    def masked(m, b):
        bx, by, bw = b
        per_item = ((m(bx) - by) ** 2).mean(dim=1)
        return LossSum((per_item * bw).sum(), int(bw.sum().item()))

    keep = weights.bool()
    expected = _reference_grads(model, (x[keep], y[keep]), _mse)
    result = accumulate_grad(model, (x, y, weights), masked, 4)
    assert result.count == 7
    for got, want in zip(_grads(model), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_frozen_parameters_are_left_alone() -> None:
    model = _mlp()
    model[0].weight.requires_grad_(False)
    batch = _data()
    accumulate_grad(model, batch, _mse, 3)
    assert model[0].weight.grad is None
    assert trainable_parameters(model) == [model[0].bias, model[2].weight, model[2].bias]


def test_fully_frozen_model_is_rejected() -> None:
    model = _mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="Unfreeze at least one parameter"):
        trainable_parameters(model)
    with pytest.raises(ValueError, match="Unfreeze at least one parameter"):
        gradaccum.Accumulator(model, torch.optim.SGD([torch.zeros(1, requires_grad=True)]))


def test_window_totals_track_items_counts_and_loss() -> None:
    model = _mlp()
    params = list(model.parameters())
    stale = [torch.ones_like(p) for p in params]
    for param, grad in zip(params, stale, strict=True):
        param.grad = grad
    window = Window()
    window.open(params, held=len(params), loss_scale=1.0)
    assert all(p.grad is None for p in params)  # set aside when the window opens
    x, y = _data()
    for start, stop in ((0, 4), (4, 5), (5, 11)):
        loss = _sse(model, (x[start:stop], y[start:stop]))
        loss.value.backward()
        window.add(loss.value, 1, loss.count, stop - start)
    assert (window.count, window.micro_batches, window.largest_micro_batch) == (11, 3, 6)
    assert window.loss_total() == pytest.approx(_sse(model, (x, y)).value.item(), rel=1e-12)
    assert window.loss_sum is None  # a CPU loss is read, not kept: no tensor, no graph
    window.restore()  # a failed window: the set-aside gradients come back, totals cleared
    assert all(p.grad is g for p, g in zip(params, stale, strict=True))
    assert (window.count, window.micro_batches, window.is_open) == (0, 0, False)


def test_window_notices_a_zero_grad_between_micro_batches() -> None:
    model = _mlp()
    params = list(model.parameters())
    window = Window()
    window.open(params, held=len(params), loss_scale=1.0)
    _mse(model, _data()).backward()
    window.mark_gradients()
    assert window.touched_gradients() == []
    params[2].grad.zero_()  # in place: zero_grad(set_to_none=False)
    params[3].grad = None  # zero_grad(set_to_none=True)
    assert window.touched_gradients() == [2, 3]


def test_window_parameters_follow_the_optimizer_then_the_model() -> None:
    model = _mlp()
    log_var = torch.nn.Parameter(torch.zeros(()))  # a learnable loss weight outside the model
    optimizer = torch.optim.SGD([model[2].weight, log_var], lr=0.1)
    params, held = window_parameters(model.parameters(), optimizer)
    assert held == 2
    assert params[:2] == [model[2].weight, log_var]
    assert params[2:] == [model[0].weight, model[0].bias, model[2].bias]


@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_accumulate_grad_warns_on_a_token_mean_weighted_by_rows(micro_batch_size: int) -> None:
    """`accumulate_grad` reads a plain scalar as a row mean, as `Accumulator.step` does: on
    -100 labels that is a token mean, not the batch's, and it says so (it used to stay silent)."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    model = torch.nn.Linear(4, 3).double()
    labels = torch.tensor([[0, 1, -100], [2, -100, -100], [1, 2, 0]])
    batch = {"x": torch.randn(3, 3, 4, dtype=torch.float64), "labels": labels}

    def token_mean(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = m(b["x"]).flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, b["labels"].flatten())

    def token_sum(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> LossSum:
        logits = m(b["x"]).flatten(0, 1)
        value = torch.nn.functional.cross_entropy(logits, b["labels"].flatten(), reduction="sum")
        return LossSum(value, (b["labels"] != -100).sum())

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        accumulate_grad(model, batch, token_mean, micro_batch_size=micro_batch_size)
    assert [w.category for w in record].count(TokenMeanWarning) == 1
    assert record[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():  # negative control: the sum and count never warn
        warnings.simplefilter("error", TokenMeanWarning)
        accumulate_grad(model, batch, token_sum, micro_batch_size=micro_batch_size)


# --- batch_dim: sequence-first (S, B, ...) batches -------------------------------------------


class _SequenceFirstTagger(torch.nn.Module):
    """A sequence-first GRU tagger: `x` is (S, B, F), the loss a mean over the B items."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = torch.nn.GRU(3, 5)  # batch_first=False
        self.head = torch.nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[-1]).squeeze(-1)  # (B,)


def _seq_first_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 10, 3, generator=g, dtype=torch.float64)  # 6 steps, 10 sequences
    return {"x": x, "y": torch.randn(1, 10, generator=g, dtype=torch.float64)}  # (1, B)


def _seq_mse(model: torch.nn.Module, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"][0])


def test_accumulate_grad_splits_sequence_first_batches_along_batch_dim_1() -> None:
    model, batch = _SequenceFirstTagger().double(), _seq_first_batch()
    expected = _reference_grads(model, batch, _seq_mse)
    result = accumulate_grad(model, batch, _seq_mse, micro_batch_size=3, batch_dim=1)
    assert result.count == 10  # the B items along dim 1, not the 6 time steps
    for param, ref in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, ref, rtol=1e-10, atol=1e-12)
    # Control: split along dim 0 (before, the only split), the steps are cut: warned and off.
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="batch_dim=1"):
        accumulate_grad(model, {"x": batch["x"], "y": batch["y"].expand(6, 10)}, _seq_mse, 3)
    pairs = zip(model.parameters(), expected, strict=True)
    gap = max(float((p.grad - r).abs().max()) for p, r in pairs)
    assert gap > 1e-3


@pytest.mark.parametrize("bad", [-1, 1.0, True, "1"])
def test_accumulate_grad_refuses_a_bad_batch_dim_as_the_accumulator_does(bad: object) -> None:
    model, batch = _mlp(), _data()
    accumulate_grad(model, batch, _mse, micro_batch_size=4)
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="must be a non-negative int") as refused:
        accumulate_grad(model, batch, _mse, 4, batch_dim=bad)  # type: ignore[arg-type]
    sgd = torch.optim.SGD(model.parameters())
    with pytest.raises(ValueError, match="must be a non-negative int") as by_accumulator:
        gradaccum.Accumulator(model, sgd, batch_dim=bad)  # type: ignore[arg-type]
    assert str(refused.value) == str(by_accumulator.value)
    assert "batch_dim=1 for sequence-first" in str(refused.value)
    for param, grad in zip(model.parameters(), before, strict=True):
        assert torch.equal(param.grad, grad)  # nothing changed


def _learnable_weight_case() -> tuple[torch.nn.Module, torch.nn.Parameter, tuple, Any]:
    """A model and a learnable loss weight outside it (uncertainty weighting's log-variance)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = model.double()
    log_var = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))
    x, y = torch.randn(11, 5, dtype=torch.float64), torch.randint(0, 3, (11,))

    def loss_fn(m: torch.nn.Module, batch: tuple) -> LossSum:
        ce = torch.nn.functional.cross_entropy(m(batch[0]), batch[1], reduction="sum")
        return LossSum(torch.exp(-log_var) * ce + log_var * len(batch[1]), len(batch[1]))

    return model, log_var, (x, y), loss_fn


@pytest.mark.parametrize("normalize", ["mean", "sum"])
def test_accumulate_grad_divides_a_learnable_loss_weight_outside_the_model(normalize: str) -> None:
    # It was seeded at 1/16 for 11 items and never divided: 0.69 of its full-batch gradient.
    model, log_var, batch, loss_fn = _learnable_weight_case()
    reference, ref_var = copy.deepcopy(model), torch.nn.Parameter(log_var.detach().clone())
    log_var.grad = torch.full_like(log_var, 7.0)  # held before: replaced, as the model's are
    accumulate_grad(model, batch, loss_fn, micro_batch_size=4, normalize=normalize)
    ce = torch.nn.functional.cross_entropy(reference(batch[0]), batch[1], reduction="sum")
    objective = torch.exp(-ref_var) * ce + ref_var * 11
    (objective / 11 if normalize == "mean" else objective).backward()
    torch.testing.assert_close(log_var.grad, ref_var.grad, rtol=1e-10, atol=0)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-15)


def test_negative_control_a_loss_weight_left_as_seeded_is_off() -> None:
    # What accumulate_grad left before: the backwards as seeded (1/16), never divided by 11/16.
    model, log_var, batch, loss_fn = _learnable_weight_case()
    exact = copy.deepcopy(log_var)
    for rows in torch.arange(11).split(4):
        loss = loss_fn(model, (batch[0][rows], batch[1][rows]))
        (loss.value / 16).backward()
    exact_model, _, _, _ = _learnable_weight_case()
    ce = torch.nn.functional.cross_entropy(exact_model(batch[0]), batch[1], reduction="sum")
    ((torch.exp(-exact) * ce + exact * 11) / 11).backward()
    assert abs(float(log_var.grad / exact.grad) - 11 / 16) < 1e-12


def test_a_failing_accumulate_grad_puts_a_learnable_loss_weights_gradient_back() -> None:
    model, log_var, batch, loss_fn = _learnable_weight_case()
    held = torch.full_like(log_var, 7.0)
    log_var.grad = held
    calls = []

    def failing(m: torch.nn.Module, b: tuple) -> LossSum:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return loss_fn(m, b)

    with pytest.raises(RuntimeError, match="boom"):
        accumulate_grad(model, batch, failing, micro_batch_size=4)
    assert log_var.grad is held
    assert float(held) == 7.0


def test_check_equivalence_leaves_a_learnable_loss_weights_gradient_as_it_was() -> None:
    # Both of its runs' backwards were left in the weight's .grad (0.31 on a None).
    model, log_var, batch, loss_fn = _learnable_weight_case()
    assert gradaccum.check_equivalence(model, batch, loss_fn, micro_batch_size=4).ok
    assert log_var.grad is None
    log_var.grad = held = torch.full_like(log_var, 7.0)
    gradaccum.check_equivalence(model, batch, loss_fn, micro_batch_size=4)
    assert log_var.grad is held
    assert float(held) == 7.0
