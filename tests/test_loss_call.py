"""A newcomer's `loss_fn` mistakes: each names the fix and changes nothing.

A `loss_fn(batch)` with one argument, a `(batch, model)` swapped, and a batch the model cannot
take (numpy arrays, a list of batches) fail inside the user's own code with an error that says
nothing about gradaccum's `loss_fn(model, micro_batch)` contract; `gradaccum._loss_call` adds it.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

from gradaccum import Accumulator, accumulate_grad, check_equivalence
from tests.reference import param_tensors, relative_gap


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = (torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,)))
    return model, optimizer, batch


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    return [params, grads, copy.deepcopy(optimizer.state_dict())]


def _assert_same(before: list[Any], after: list[Any]) -> None:
    for old, new in zip(before[0] + before[1], after[0] + after[1], strict=True):
        assert (old is None and new is None) or torch.equal(old, new)
    assert before[2]["param_groups"] == after[2]["param_groups"]
    assert set(before[2]["state"]) == set(after[2]["state"])
    for key, state in before[2]["state"].items():
        assert all(torch.equal(v, after[2]["state"][key][k]) for k, v in state.items())


def _warm(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> Accumulator:
    """An Accumulator that stepped once, with gradients held: an error must keep them all."""
    acc = Accumulator(model, optimizer, micro_batch_size=4)
    acc.step(batch, _loss)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    return acc


def test_one_argument_loss_fn_is_refused_naming_the_signature_and_nothing_changes() -> None:
    model, optimizer, batch = _setup()
    acc = _warm(model, optimizer, batch)
    before = _state(model, optimizer)

    def loss_fn(batch: Any) -> torch.Tensor:
        return _loss(model, batch)

    with pytest.raises(TypeError, match=r"def loss_fn\(model, batch\)") as caught:
        acc.step(batch, loss_fn)
    # Negative control: the cause alone says nothing of gradaccum's contract.
    assert "(model, micro_batch)" not in str(caught.value.__cause__)
    _assert_same(before, _state(model, optimizer))
    with pytest.raises(TypeError, match=r"cannot be called as loss_fn\(model, micro_batch\)"):
        Accumulator(model, optimizer, accumulation_steps=2).micro_step(batch, loss_fn)
    _assert_same(before, _state(model, optimizer))


def test_swapped_batch_model_loss_fn_is_refused_naming_the_swap() -> None:
    model, optimizer, batch = _setup()
    acc = _warm(model, optimizer, batch)
    before = _state(model, optimizer)

    def loss_fn(batch: Any, model: nn.Module) -> torch.Tensor:
        return _loss(model, batch)

    with pytest.raises(TypeError, match=r"swap its parameters to \(model, batch\)"):
        acc.step(batch, loss_fn)
    _assert_same(before, _state(model, optimizer))


def test_numpy_and_list_batches_raise_with_a_note_naming_the_conversion() -> None:
    model, optimizer, batch = _setup()
    acc = _warm(model, optimizer, batch)
    before = _state(model, optimizer)
    with pytest.raises(TypeError) as caught:
        acc.step((batch[0].numpy(), batch[1].numpy()), _loss)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "numpy.ndarray(4, 4) float64" in notes
    assert "torch.as_tensor(array)" in notes
    _assert_same(before, _state(model, optimizer))
    with pytest.raises(TypeError) as caught:
        acc.step({"x": batch[0].tolist(), "y": batch[1].tolist()}, lambda m, b: m(b["x"]).sum())
    assert "torch.tensor(values)" in "\n".join(getattr(caught.value, "__notes__", []))
    _assert_same(before, _state(model, optimizer))


def test_a_list_of_batches_raises_with_a_note_naming_micro_step() -> None:
    model, optimizer, batch = _setup()
    acc = _warm(model, optimizer, batch)
    before = _state(model, optimizer)
    batches = [(batch[0][i : i + 4], batch[1][i : i + 4]) for i in range(0, 16, 4)]
    with pytest.raises(ValueError, match="too many values to unpack") as caught:
        acc.step(batches, _loss)
    assert "acc.micro_step(batch, loss_fn)" in "\n".join(getattr(caught.value, "__notes__", []))
    _assert_same(before, _state(model, optimizer))


def test_accumulate_grad_and_check_equivalence_name_the_signature_too() -> None:
    model, _, batch = _setup()

    def loss_fn(batch: Any) -> torch.Tensor:
        return _loss(model, batch)

    with pytest.raises(TypeError, match=r"def loss_fn\(model, batch\)"):
        accumulate_grad(model, batch, loss_fn, micro_batch_size=4)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match=r"def loss_fn\(model, batch\)"):
        check_equivalence(model, batch, loss_fn, micro_batch_size=4)


def test_partial_and_varargs_loss_fns_still_run_exactly() -> None:
    model, optimizer, batch = _setup()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _loss(reference, batch).backward()
    ref_opt.step()

    def weighted(model: nn.Module, batch: Any, *, scale: float) -> torch.Tensor:
        return scale * _loss(model, batch)

    acc = Accumulator(model, optimizer, micro_batch_size=5)
    acc.step(batch, functools.partial(weighted, scale=1.0))
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


@pytest.mark.parametrize(
    ("make_loss_fn", "expected"),
    [
        (
            lambda model: model,
            r"loss_fn is the model itself; .* wrap it: `def loss_fn\(model, batch\)",
        ),
        (lambda model: nn.CrossEntropyLoss(), r"loss_fn is a CrossEntropyLoss, which takes"),
        (lambda model: "cross_entropy", r"loss_fn='cross_entropy' is not callable"),
    ],
)
def test_a_model_a_criterion_or_a_name_as_loss_fn_is_refused_naming_the_wrapper(
    make_loss_fn: Any, expected: str
) -> None:
    model, optimizer, batch = _setup()
    acc = _warm(model, optimizer, batch)
    before = _state(model, optimizer)
    with pytest.raises(TypeError, match=expected):
        acc.step(batch, make_loss_fn(model))
    _assert_same(before, _state(model, optimizer))


_NO_GRAD_BLOCKS = {
    "no_grad": (torch.no_grad, r"inside torch\.no_grad\(\)"),
    "inference_mode": (torch.inference_mode, r"inside torch\.inference_mode\(\)"),
    "set_grad_enabled": (
        functools.partial(torch.set_grad_enabled, False),
        r"torch\.set_grad_enabled\(False\)",
    ),
}


@pytest.mark.parametrize("block", sorted(_NO_GRAD_BLOCKS))
def test_a_step_called_with_gradients_disabled_is_refused_before_loss_fn_runs(block: str) -> None:
    """acc.step()/micro_step() inside a validation loop's no_grad: refused naming the block,
    before loss_fn runs (before: "the loss does not require grad", which points at loss_fn),
    an open streaming window kept, so the window then ends as the full-batch step."""
    disabled, where = _NO_GRAD_BLOCKS[block]
    calls: list[int] = []

    def counted(model: nn.Module, batch: Any) -> torch.Tensor:
        calls.append(len(batch[0]))
        return _loss(model, batch)

    model, optimizer, batch = _setup()
    reference = copy.deepcopy((model, optimizer))
    stepper = Accumulator(model, optimizer, micro_batch_size=4)
    streamer = Accumulator(model, optimizer, accumulation_steps=2)
    auto = Accumulator(model, optimizer, micro_batch_size="auto", memory_budget="64MiB")
    streamer.micro_step((batch[0][:8], batch[1][:8]), counted)
    before = _state(model, optimizer)
    attempts = [
        lambda: stepper.step(batch, counted),
        lambda: stepper.step(batch, counted, max_tokens=8),
        lambda: streamer.micro_step((batch[0][8:], batch[1][8:]), counted),
        lambda: auto.step(batch, counted),
        lambda: accumulate_grad(model, batch, counted, 4),
    ]
    if block == "inference_mode":  # check_equivalence enables grad itself, which lifts the rest
        attempts.append(lambda: check_equivalence(model, batch, counted, 4))
    for call in attempts:
        with disabled(), pytest.raises(ValueError, match=where) as raised:
            call()
        assert "Call it outside that block" in str(raised.value)
    assert calls == [8]  # the streamed window's first micro-batch only: no loss_fn ran since
    _assert_same(before, _state(model, optimizer))
    assert streamer.micro_step((batch[0][8:], batch[1][8:]), counted).stepped
    ref_model, ref_optimizer = reference
    ref_optimizer.zero_grad()
    _loss(ref_model, batch).backward()
    ref_optimizer.step()
    assert relative_gap(param_tensors(model), param_tensors(ref_model)) < 1e-10

    # Control: the window's second half alone is another step, so the comparison can fail.
    alone_model, alone_optimizer = copy.deepcopy(reference)
    alone_optimizer.zero_grad()
    _loss(alone_model, (batch[0][8:], batch[1][8:])).backward()
    alone_optimizer.step()
    assert relative_gap(param_tensors(alone_model), param_tensors(ref_model)) > 1e-3


def test_enable_grad_does_not_lift_inference_mode_and_runs_a_step_under_no_grad() -> None:
    model, optimizer, batch = _setup()
    reference = copy.deepcopy((model, optimizer))
    acc = Accumulator(model, optimizer, micro_batch_size=4)
    before = _state(model, optimizer)
    lifted = pytest.raises(ValueError, match=r"inference_mode\(False\)")
    with torch.inference_mode(), torch.enable_grad(), lifted:  # grad mode on, yet no graph
        acc.step(batch, _loss)
    _assert_same(before, _state(model, optimizer))
    with torch.no_grad(), torch.enable_grad():
        assert acc.step(batch, _loss).stepped
    ref_model, ref_optimizer = reference
    _loss(ref_model, batch).backward()
    ref_optimizer.step()
    assert relative_gap(param_tensors(model), param_tensors(ref_model)) < 1e-10
