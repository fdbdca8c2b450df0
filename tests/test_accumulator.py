"""Tests for gradaccum.accumulator: StepResult, the two drives, flush, memory and bad input.

The many-split equivalence grid lives in test_equivalence.py; here each behaviour of the
`Accumulator` is pinned against a plain float64 reference written without the library.
"""

from __future__ import annotations

import copy
import gc
import math
import re
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gradaccum
from gradaccum import Accumulator, LossSum, StepResult
from tests.state import assert_bitwise, clone_state

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _mlp(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    return model.to(dtype)


def _data(items: int = 10, dtype: torch.dtype = torch.float64, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(items, 4, generator=generator).to(dtype)
    y = (torch.randn(items, 2, generator=generator) * 2).to(dtype)
    return x, y


def _mse(model: torch.nn.Module, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _reference_step(model: torch.nn.Module, batch, make_optimizer=_sgd, max_norm=None):
    """One plain full-batch step on a copy of `model`: (copy, loss, grad norm before clipping)."""
    twin = copy.deepcopy(model)
    optimizer = make_optimizer(twin)
    loss = _mse(twin, batch)
    loss.backward()
    # clip_grad_norm_ returns the norm before clipping; an infinite max_norm scales by exactly 1
    # (get_total_norm and clip_grads_with_norm_ are newer than torch 2.4, the oldest supported).
    norm = torch.nn.utils.clip_grad_norm_(
        twin.parameters(), math.inf if max_norm is None else max_norm
    )
    optimizer.step()
    return twin, loss.item(), norm.item()


def _assert_params_close(a: torch.nn.Module, b: torch.nn.Module, rtol: float = 1e-10) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=1e-13)


def _snapshot(model: torch.nn.Module, optimizer, scheduler=None) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "optimizer": clone_state(optimizer.state_dict()),
        "scheduler": None if scheduler is None else clone_state(scheduler.state_dict()),
    }


def _assert_unchanged(before: dict[str, Any], model, optimizer, scheduler=None) -> None:
    assert_bitwise(before, _snapshot(model, optimizer, scheduler))


# --------------------------------------------------------------------------------------------
# StepResult and the whole-batch drive
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("items", "micro_batch_size"), [(10, 3), (10, 10), (10, 1), (9, 4)])
def test_step_result_fields_match_a_plain_full_batch_step(
    items: int, micro_batch_size: int
) -> None:
    model = _mlp()
    batch = _data(items)
    reference, ref_loss, ref_norm = _reference_step(model, batch)

    acc = Accumulator(model, _sgd(model), micro_batch_size=micro_batch_size)
    result = acc.step(batch, _mse)

    assert isinstance(result, StepResult)
    assert result.stepped is True
    assert result.skipped is False
    assert result.count == items
    assert result.micro_batches == math.ceil(items / micro_batch_size)
    assert result.micro_batch_size == micro_batch_size
    assert result.lr == 0.1
    assert type(result.loss) is float
    assert type(result.grad_norm) is float
    assert type(result.lr) is float
    assert result.loss == pytest.approx(ref_loss, rel=1e-12)
    assert result.grad_norm == pytest.approx(ref_norm, rel=1e-10)
    _assert_params_close(model, reference)
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)


def test_consecutive_steps_track_a_reference_with_momentum_and_schedule() -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    optimizer = _sgd(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (epoch + 1))
    ref_optimizer = _sgd(reference)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_optimizer, lambda e: 1.0 / (e + 1))
    acc = Accumulator(model, optimizer, micro_batch_size=3, scheduler=scheduler)
    for index in range(3):
        batch = _data(8, seed=index)
        result = acc.step(batch, _mse)
        ref_optimizer.zero_grad()
        _mse(reference, batch).backward()
        ref_optimizer.step()
        ref_scheduler.step()
        assert result.lr == pytest.approx(0.1 / (index + 1), rel=1e-15)  # the lr used
        assert scheduler.last_epoch == index + 1  # stepped once per optimizer step
    _assert_params_close(model, reference)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 4, rel=1e-15)


def test_step_discards_gradients_present_before_the_call() -> None:
    results = []
    for stale in (False, True):
        model = _mlp()
        if stale:
            for p in model.parameters():
                p.grad = torch.full_like(p, 7.0)
        Accumulator(model, _sgd(model), micro_batch_size=4).step(_data(), _mse)
        results.append([p.detach().clone() for p in model.parameters()])
    assert_bitwise(results[0], results[1])


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_clipping_reports_the_norm_before_clipping(max_norm: float) -> None:
    model = _mlp()
    batch = _data()
    reference, _, ref_norm = _reference_step(model, batch, max_norm=max_norm)
    acc = Accumulator(model, _sgd(model), micro_batch_size=3, max_grad_norm=max_norm)
    result = acc.step(batch, _mse)
    assert result.grad_norm == pytest.approx(ref_norm, rel=1e-10)
    _assert_params_close(model, reference)
    if max_norm < ref_norm:  # negative control: the unclipped step is a different step
        unclipped, _, _ = _reference_step(model, batch)
        gap = max(
            float((p - q).detach().abs().max())
            for p, q in zip(unclipped.parameters(), reference.parameters(), strict=True)
        )
        assert gap > 1e-3


def test_optimizer_over_part_of_the_model_steps_only_that_part() -> None:
    model = _mlp()
    frozen_before = [p.detach().clone() for p in model[0].parameters()]
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"2 trainable parameters of the model \(0\.weight, 0"):
        acc = Accumulator(model, optimizer, micro_batch_size=4)
    result = acc.step(_data(), _mse)
    assert result.stepped
    for p, b in zip(model[0].parameters(), frozen_before, strict=True):
        assert torch.equal(p.detach(), b)
    assert all(p.grad is None for p in model.parameters())  # no stale gradient is left


# --------------------------------------------------------------------------------------------
# Streaming drive: micro_step and flush
# --------------------------------------------------------------------------------------------


def _micro_batches(count: int, items: int = 3, seed: int = 5):
    x, y = _data(count * items, seed=seed)
    return [(x[i * items : (i + 1) * items], y[i * items : (i + 1) * items]) for i in range(count)]


def _cat(micro_batches):
    return tuple(torch.cat(parts) for parts in zip(*micro_batches, strict=True))


def test_micro_step_progress_then_one_exact_step_at_the_boundary() -> None:
    model = _mlp()
    stream = _micro_batches(4, items=3)
    stream[2] = (stream[2][0][:1], stream[2][1][:1])  # a smaller one: counts are per item
    reference, ref_loss, ref_norm = _reference_step(model, _cat(stream))
    running_loss = _mse(copy.deepcopy(model), _cat(stream[:2])).item()  # after two micro-batches
    before = [p.detach().clone() for p in model.parameters()]

    acc = Accumulator(model, _sgd(model), accumulation_steps=4)
    results = [acc.micro_step(mb, _mse) for mb in stream[:3]]
    # Parameters move only at the boundary.
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    results.append(acc.micro_step(stream[3], _mse))

    for index, result in enumerate(results[:3]):
        assert result.stepped is False
        assert result.skipped is False
        assert result.grad_norm is None
        assert result.micro_batches == index + 1
        assert result.count == sum(len(mb[0]) for mb in stream[: index + 1])
        assert result.micro_batch_size == 3
        assert type(result.loss) is float
    assert results[1].loss == pytest.approx(running_loss, rel=1e-12)

    last = results[3]
    assert last.stepped is True
    assert last.skipped is False
    assert last.count == 10
    assert last.micro_batches == 4
    assert last.micro_batch_size == 3
    assert last.loss == pytest.approx(ref_loss, rel=1e-12)
    assert last.grad_norm == pytest.approx(ref_norm, rel=1e-10)
    _assert_params_close(model, reference)

    # The next call opens a new window.
    follow = acc.micro_step(stream[0], _mse)
    assert (follow.micro_batches, follow.stepped) == (1, False)


def test_flush_step_takes_an_exact_step_over_the_items_seen() -> None:
    model = _mlp()
    stream = _micro_batches(3)
    reference, ref_loss, _ = _reference_step(model, _cat(stream))
    acc = Accumulator(model, _sgd(model), accumulation_steps=5, partial_window="step")
    for mb in stream:
        assert not acc.micro_step(mb, _mse).stepped
    result = acc.flush()
    assert result.stepped
    assert result.count == 9
    assert result.micro_batches == 3
    assert result.loss == pytest.approx(ref_loss, rel=1e-12)
    _assert_params_close(model, reference)
    empty = acc.flush()  # nothing left
    assert (empty.stepped, empty.micro_batches, empty.count) == (False, 0, 0)


def test_flush_drop_discards_the_partial_window() -> None:
    model = _mlp()
    optimizer = _sgd(model)
    acc = Accumulator(model, optimizer, accumulation_steps=2, partial_window="drop")
    first, second = _micro_batches(2), _micro_batches(2, seed=9)
    for mb in first:
        acc.micro_step(mb, _mse)  # one full window, so the optimizer has momentum state
    before = _snapshot(model, optimizer)
    acc.micro_step(second[0], _mse)
    result = acc.flush()
    assert (result.stepped, result.micro_batches, result.count) == (False, 1, 3)
    _assert_unchanged(before, model, optimizer)  # grads are None again too

    # The dropped micro-batch leaves no trace in the next window.
    fresh = copy.deepcopy(model)
    fresh_optimizer = _sgd(fresh)
    fresh_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    twin = Accumulator(fresh, fresh_optimizer, accumulation_steps=2)
    for mb in second:
        acc.micro_step(mb, _mse)
        twin.micro_step(mb, _mse)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_flush_carry_finishes_the_window_in_the_next_epoch() -> None:
    model = _mlp()
    stream = _micro_batches(4)
    reference, ref_loss, _ = _reference_step(model, _cat(stream))
    acc = Accumulator(model, _sgd(model), accumulation_steps=4, partial_window="carry")
    for mb in stream[:3]:
        acc.micro_step(mb, _mse)
    carried = acc.flush()
    assert (carried.stepped, carried.skipped, carried.micro_batches, carried.count) == (
        False,
        False,
        3,
        9,
    )
    result = acc.micro_step(stream[3], _mse)  # "next epoch"
    assert result.stepped
    assert result.micro_batches == 4
    assert result.loss == pytest.approx(ref_loss, rel=1e-12)
    _assert_params_close(model, reference)


def test_step_while_a_streaming_window_is_open_raises_and_keeps_the_window() -> None:
    model = _mlp()
    stream = _micro_batches(2)
    reference, _, _ = _reference_step(model, _cat(stream))
    acc = Accumulator(model, _sgd(model), micro_batch_size=3, accumulation_steps=2)
    acc.micro_step(stream[0], _mse)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"call flush\('step'\) or flush\('drop'\) first"):
        acc.step(_data(), _mse)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
    assert acc.micro_step(stream[1], _mse).stepped
    _assert_params_close(model, reference)


def test_flush_settles_a_window_this_once_as_asked() -> None:
    """A loader that raises mid-window leaves the window open (the exception is outside the
    Accumulator's calls): `flush("drop")` discards it, bitwise, whatever `partial_window`
    says; a carried window, which `flush()` keeps and `step()` refuses, settles with
    `flush("step")`. A bad choice raises naming the valid ones and changes nothing."""
    model = _mlp()
    twin = copy.deepcopy(model)  # the same run without the micro-batch the loader left open
    optimizer, twin_optimizer = _sgd(model), _sgd(twin)
    stream = _micro_batches(5)
    acc = Accumulator(model, optimizer, micro_batch_size=3, accumulation_steps=2)
    twin_acc = Accumulator(twin, twin_optimizer, accumulation_steps=2)
    for micro_batch in stream[:2]:  # one full window: momentum state
        acc.micro_step(micro_batch, _mse)
        twin_acc.micro_step(micro_batch, _mse)
    before = _snapshot(model, optimizer)

    def train(loader) -> None:
        for micro_batch in loader:
            acc.micro_step(micro_batch, _mse)

    def loader():
        yield stream[2]
        raise OSError("corrupt shard")

    with pytest.raises(OSError, match="corrupt shard"):
        train(loader())
    assert all(p.grad is not None for p in model.parameters())  # the open window's sums
    with pytest.raises(ValueError, match="partial_window='nope' is not a valid choice"):
        acc.flush("nope")
    assert acc.flush("carry").micro_batches == 1  # kept, and still kept
    dropped = acc.flush("drop")
    assert (dropped.stepped, dropped.micro_batches, dropped.count) == (False, 1, 3)
    _assert_unchanged(before, model, optimizer)  # grads are None again too
    for micro_batch in stream[3:5]:  # the next window holds its own items only
        acc.micro_step(micro_batch, _mse)
        twin_acc.micro_step(micro_batch, _mse)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)

    model = _mlp()
    reference, _, _ = _reference_step(model, _cat(stream[:2]))
    acc = Accumulator(model, _sgd(model), micro_batch_size=3, accumulation_steps=4,
                      partial_window="carry")  # fmt: skip
    for micro_batch in stream[:2]:
        acc.micro_step(micro_batch, _mse)
    assert not acc.flush().stepped  # carried
    with pytest.raises(RuntimeError, match=r"flush\('step'\) or flush\('drop'\)"):
        acc.step(_cat(stream[2:4]), _mse)
    settled = acc.flush("step")
    assert (settled.stepped, settled.micro_batches, settled.count) == (True, 2, 6)
    _assert_params_close(model, reference)
    assert acc.step(_cat(stream[2:4]), _mse).stepped  # the fix the message named works


def test_failure_mid_stream_forgets_the_whole_window() -> None:
    model = _mlp()
    stream = _micro_batches(4)
    before = [p.detach().clone() for p in model.parameters()]
    reference, _, _ = _reference_step(model, _cat(stream[1:]))
    acc = Accumulator(model, _sgd(model), accumulation_steps=3)
    acc.micro_step(stream[0], _mse)
    with pytest.raises(ValueError, match="must be a scalar") as raised:
        acc.micro_step(stream[1], lambda m, b: m(b[0]).sum(dim=1))
    assert "window (1 micro-batches) was discarded" in " ".join(
        getattr(raised.value, "__notes__", [])
    )
    assert all(p.grad is None for p in model.parameters())  # as before the window
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    # A new window starts: three fresh micro-batches make one step, over exactly their items.
    assert not acc.micro_step(stream[1], _mse).stepped
    assert not acc.micro_step(stream[2], _mse).stepped
    result = acc.micro_step(stream[3], _mse)
    assert result.stepped
    assert result.micro_batches == 3
    _assert_params_close(model, reference)


# --------------------------------------------------------------------------------------------
# Zero-count windows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", ["mean", "sum"])
def test_zero_count_window_is_skipped_without_any_step(normalize: str) -> None:
    """The contract: a window whose total count is 0 takes no step, whatever `normalize`.

    (`normalize="sum"` stepped it: AdamW's weight decay and moments moved on a zero gradient.)
    """
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    acc = Accumulator(
        model, optimizer, micro_batch_size=4, scheduler=scheduler, normalize=normalize
    )
    acc.step(_data(), _mse)  # optimizer state present
    before = _snapshot(model, optimizer, scheduler)

    def nothing_counts(m, b) -> LossSum:
        return LossSum(_mse(m, b) * 0.0, 0)

    result = acc.step(_data(seed=4), nothing_counts)
    assert result.skipped is True
    assert result.stepped is False
    assert result.count == 0
    assert result.micro_batches == 3
    assert result.grad_norm is None
    assert result.loss == 0.0
    _assert_unchanged(before, model, optimizer, scheduler)
    assert scheduler.last_epoch == 1
    # NEGATIVE CONTROL: the same window counting one item steps, and the check sees it.
    acc.step(_data(seed=4), lambda m, b: LossSum(_mse(m, b) * 0.0, 1))
    with pytest.raises(AssertionError):
        _assert_unchanged(before, model, optimizer, scheduler)


# --------------------------------------------------------------------------------------------
# Memory: nothing of a micro-batch outlives its backward
# --------------------------------------------------------------------------------------------


def _live_tensors() -> int:
    # type() rather than isinstance(): some module objects warn when asked for __class__.
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def test_micro_step_keeps_no_graph_and_no_tensor_per_micro_batch() -> None:
    model = _mlp(torch.float32)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=100)
    x, y = _data(64 * 2, dtype=torch.float32)
    stream = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 128, 2)]
    refs: list[weakref.ref] = []

    def loss_fn(m, b) -> torch.Tensor:
        out = m(b[0])
        loss = torch.nn.functional.mse_loss(out, b[1])
        refs.extend([weakref.ref(out), weakref.ref(loss)])
        return loss

    live = {}
    gc.collect()
    gc.disable()  # cyclic garbage would pile up and show in the count
    try:
        for index, mb in enumerate(stream, start=1):
            result = acc.micro_step(mb, loss_fn)
            assert all(ref() is None for ref in refs), f"a graph outlived micro-step {index}"
            assert type(result.loss) is float
            if index in (1, 64):
                live[index] = _live_tensors()
    finally:
        gc.enable()
    assert result.micro_batches == 64
    assert not result.stepped
    assert live[1] == live[64], f"live tensors grew from {live[1]} to {live[64]}"


def test_step_frees_each_micro_batch_before_the_next() -> None:
    model = _mlp(torch.float32)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=1)
    batch = _data(100, dtype=torch.float32)
    refs: list[weakref.ref] = []
    alive_at_call: list[int] = []
    live: dict[int, int] = {}

    def loss_fn(m, b) -> torch.Tensor:
        call = len(alive_at_call) + 1
        alive_at_call.append(sum(ref() is not None for ref in refs))
        if call in (2, 64):
            live[call] = _live_tensors()
        out = m(b[0])
        loss = torch.nn.functional.mse_loss(out, b[1])
        refs.extend([weakref.ref(out), weakref.ref(loss)])
        return loss

    gc.collect()
    gc.disable()
    try:
        result = acc.step(batch, loss_fn)
    finally:
        gc.enable()
    assert result.stepped
    assert result.micro_batches == 100
    assert alive_at_call == [0] * 100  # each graph died before the next forward
    assert all(ref() is None for ref in refs)
    assert live[2] == live[64], f"live tensors grew from {live[2]} to {live[64]}"
    assert type(result.loss) is float


# --------------------------------------------------------------------------------------------
# Bad input: an error that names the fix, and no change of state
# --------------------------------------------------------------------------------------------


def _stateful_setup():
    """A model with gradients present, AdamW with state, and a scheduler that has stepped."""
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    Accumulator(model, optimizer, micro_batch_size=5, scheduler=scheduler).step(_data(), _mse)
    for p in model.parameters():  # gradients a user may hold from their own backward
        p.grad = torch.randn_like(p)
    return model, optimizer, scheduler


def _failing_at(index: int, bad: Callable[[torch.nn.Module, Any], Any]):
    calls = []

    def loss_fn(m, b):
        calls.append(1)
        return bad(m, b) if len(calls) == index + 1 else _mse(m, b)

    return loss_fn, calls


def _non_scalar(m, b):
    return m(b[0]).mean(dim=1)


def _negative_count(m, b):
    return LossSum(torch.nn.functional.mse_loss(m(b[0]), b[1], reduction="sum"), -2)


def _fractional_count(m, b):
    return LossSum(torch.nn.functional.mse_loss(m(b[0]), b[1], reduction="sum"), 2.5)


def _not_a_loss(m, b):
    return _mse(m, b).item()


def _user_error(m, b):
    _mse(m, b).backward()  # even a half-done backward of its own must not leak into .grad
    raise KeyError("boom in user code")


CONSTRUCTION_CASES = [
    ("mbs-zero", {"micro_batch_size": 0}, ValueError, "micro_batch_size=0 must be a positive"),
    ("mbs-negative", {"micro_batch_size": -4}, ValueError, "micro_batch_size=-4 must be"),
    ("mbs-float", {"micro_batch_size": 2.5}, (ValueError, TypeError), "positive int"),
    ("mbs-str", {"micro_batch_size": "8"}, (ValueError, TypeError), "positive int"),
    ("steps-zero", {"accumulation_steps": 0}, ValueError, "accumulation_steps=0 must be"),
    ("steps-float", {"accumulation_steps": 1.5}, (ValueError, TypeError), "accumulation_steps"),
    ("clip-negative", {"max_grad_norm": -1.0}, ValueError, "max_grad_norm=-1.0 must be"),
    ("clip-inf", {"max_grad_norm": math.inf}, ValueError, "positive finite number"),
    ("scheduler", {"scheduler": object()}, TypeError, "has no step"),
    ("precision", {"precision": "fp8"}, ValueError, "precision='fp8'"),
    ("normalize", {"normalize": "avg"}, ValueError, "normalize='avg'"),
    ("partial", {"partial_window": "keep"}, ValueError, "partial_window='keep'"),
    ("nonfinite", {"on_nonfinite": "warn"}, ValueError, "on_nonfinite='warn'"),
    ("accum-dtype", {"accum_dtype": torch.int32}, ValueError, "accum_dtype=torch.int32"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [case[1:] for case in CONSTRUCTION_CASES],
    ids=[case[0] for case in CONSTRUCTION_CASES],
)
def test_bad_settings_are_rejected_at_construction(kwargs, error, pattern) -> None:
    model, optimizer, scheduler = _stateful_setup()
    before = _snapshot(model, optimizer, scheduler)
    with pytest.raises(error, match=pattern):
        Accumulator(model, optimizer, **kwargs)
    _assert_unchanged(before, model, optimizer, scheduler)


def test_optimizer_without_the_models_parameters_is_rejected() -> None:
    model, optimizer, scheduler = _stateful_setup()
    other = torch.optim.SGD(_mlp().parameters(), lr=0.1)
    before = _snapshot(model, optimizer, scheduler)
    with pytest.raises(ValueError, match=r"optimizer holds none of the model's trainable"):
        Accumulator(model, other, micro_batch_size=2)
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer"):
        Accumulator(model, object(), micro_batch_size=2)  # type: ignore[arg-type]
    _assert_unchanged(before, model, optimizer, scheduler)


def test_a_model_with_nothing_trainable_is_refused_naming_that_not_the_optimizer() -> None:
    """A model frozen whole (PEFT's merge_and_unload() returns one) given a new optimizer
    between windows: the message said the optimizer held none of its trainable parameters and
    to build it from this model, which the user had done."""
    model, optimizer, scheduler = _stateful_setup()
    acc = Accumulator(model, optimizer, micro_batch_size=2)
    model.requires_grad_(False)
    before = _snapshot(model, optimizer, scheduler)
    replacement = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"no parameter with requires_grad=True.*requires_grad_"):
        acc.optimizer = replacement
    assert acc.optimizer is optimizer
    _assert_unchanged(before, model, optimizer, scheduler)


STEP_CASES = [
    # (id, batch maker, loss_fn maker, error, pattern, calls expected)
    (
        "leading-dims-differ",
        lambda: (torch.zeros(6, 4, dtype=torch.float64), torch.zeros(5, 2, dtype=torch.float64)),
        lambda: (_mse, []),
        ValueError,
        "disagree on the leading dimension",
    ),
    (
        "empty-batch",
        lambda: (torch.zeros(0, 4, dtype=torch.float64), torch.zeros(0, 2, dtype=torch.float64)),
        lambda: (_mse, []),
        ValueError,
        "the batch is empty",
    ),
    ("non-scalar-first", _data, lambda: _failing_at(0, _non_scalar), ValueError, "scalar"),
    ("non-scalar-middle", _data, lambda: _failing_at(2, _non_scalar), ValueError, "scalar"),
    ("negative-count", _data, lambda: _failing_at(2, _negative_count), ValueError, ">= 0"),
    ("fractional-count", _data, lambda: _failing_at(2, _fractional_count), ValueError, "whole"),
    ("not-a-loss", _data, lambda: _failing_at(2, _not_a_loss), TypeError, "LossSum"),
    ("user-error-middle", _data, lambda: _failing_at(2, _user_error), KeyError, "boom"),
]


@pytest.mark.parametrize(
    ("make_batch", "make_loss", "error", "pattern"),
    [case[1:] for case in STEP_CASES],
    ids=[case[0] for case in STEP_CASES],
)
def test_a_failed_step_changes_nothing(make_batch, make_loss, error, pattern) -> None:
    model, optimizer, scheduler = _stateful_setup()
    grads = [p.grad for p in model.parameters()]
    before = _snapshot(model, optimizer, scheduler)
    acc = Accumulator(model, optimizer, micro_batch_size=3, scheduler=scheduler)
    loss_fn, _calls = make_loss()
    with pytest.raises(error, match=pattern):
        acc.step(make_batch(), loss_fn)
    _assert_unchanged(before, model, optimizer, scheduler)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))

    # Nothing is left over either: the next step equals a fresh accumulator's from the same state.
    twin_model = copy.deepcopy(model)
    twin_optimizer = torch.optim.AdamW(twin_model.parameters(), lr=0.05)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    Accumulator(twin_model, twin_optimizer, micro_batch_size=3).step(_data(seed=8), _mse)
    acc.step(_data(seed=8), _mse)
    for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_failure_in_the_middle_of_step_ran_the_earlier_micro_batches() -> None:
    """Guard against a vacuous test: the failing call really came after two good backwards."""
    model, optimizer, _ = _stateful_setup()
    acc = Accumulator(model, optimizer, micro_batch_size=3)
    loss_fn, calls = _failing_at(2, _non_scalar)
    with pytest.raises(ValueError, match="scalar"):
        acc.step(_data(), loss_fn)
    assert len(calls) == 3


@pytest.mark.parametrize(
    ("bad", "error", "pattern"),
    [
        (_non_scalar, ValueError, "scalar"),
        (_negative_count, ValueError, ">= 0"),
        (_fractional_count, ValueError, "whole number"),
        (_user_error, KeyError, "boom"),
    ],
)
def test_a_failed_first_micro_step_changes_nothing(bad, error, pattern) -> None:
    model, optimizer, scheduler = _stateful_setup()
    before = _snapshot(model, optimizer, scheduler)
    acc = Accumulator(model, optimizer, accumulation_steps=2, scheduler=scheduler)
    with pytest.raises(error, match=pattern):
        acc.micro_step(_data(3), bad)
    _assert_unchanged(before, model, optimizer, scheduler)
    assert acc.flush().micro_batches == 0  # no window was opened


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        ({"note": "no tensor"}, "holds no tensor"),
        ((torch.zeros(3, 4, dtype=torch.float64), torch.zeros(2, 2)), "disagree"),
        ((torch.zeros(0, 4, dtype=torch.float64), torch.zeros(0, 2)), "is empty"),
    ],
    ids=["no-tensor", "sizes-disagree", "empty"],
)
def test_a_micro_batch_refused_for_its_shape_keeps_the_open_window(bad, pattern) -> None:
    """Bad input changes nothing: the window's earlier micro-batches are kept, and the step
    after the refusal is the full-batch step over every accepted micro-batch."""
    model = _mlp()
    x, y = _data(9)
    reference, _, _ = _reference_step(model, (x, y))
    optimizer = _sgd(model)
    acc = Accumulator(model, optimizer, accumulation_steps=3)
    acc.micro_step((x[:3], y[:3]), _mse)
    acc.micro_step((x[3:6], y[3:6]), _mse)
    held = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=pattern):
        acc.micro_step(bad, _mse)
    assert_bitwise(held, [p.grad for p in model.parameters()])
    result = acc.micro_step((x[6:], y[6:]), _mse)
    assert result.stepped
    assert (result.micro_batches, result.count) == (3, 9)
    _assert_params_close(model, reference)
    # Control: had the refusal discarded the window, the step would cover only the last third.
    dropped, _, _ = _reference_step(_mlp(), (x[6:], y[6:]))
    with pytest.raises(AssertionError):
        _assert_params_close(model, dropped)


def test_missing_sizes_name_the_fix() -> None:
    model, optimizer, scheduler = _stateful_setup()
    before = _snapshot(model, optimizer, scheduler)
    streaming = Accumulator(model, optimizer, accumulation_steps=2)
    with pytest.raises(ValueError, match=r"step\(\) needs micro_batch_size.*micro_batch_size=8"):
        streaming.step(_data(), _mse)
    whole = Accumulator(model, optimizer, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"micro_step\(\) needs accumulation_steps"):
        whole.micro_step(_data(2), _mse)
    _assert_unchanged(before, model, optimizer, scheduler)


def test_public_names() -> None:
    assert gradaccum.Accumulator is Accumulator
    assert issubclass(gradaccum.NonFiniteError, FloatingPointError)


def test_a_pending_result_reads_its_loss_from_the_device_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU a float() per micro-step would make the host wait for every backward.

    Simulated on the CPU: every tensor says it is not on the CPU, so the window keeps the loss
    on the "device" (a CPU loss is read at once, which costs nothing: no device to wait for).
    """
    model = _mlp()
    acc = Accumulator(model, _sgd(model), accumulation_steps=3)
    reads: list[int] = []
    real = torch.Tensor.__float__

    def counted(tensor: torch.Tensor) -> float:
        reads.append(1)
        return real(tensor)

    monkeypatch.setattr(torch.Tensor, "__float__", counted)
    monkeypatch.setattr(torch.Tensor, "is_cpu", property(lambda tensor: False))
    stream = _micro_batches(3)
    first = acc.micro_step(stream[0], _mse)
    second = acc.micro_step(stream[1], _mse)
    assert reads == []  # nothing read back between micro-batches
    expected = [_mse(model, mb).item() for mb in stream[:2]]
    assert second.loss == pytest.approx(sum(expected) / 2, rel=1e-12)  # read now, once
    assert first.loss == pytest.approx(expected[0], rel=1e-12)  # a snapshot, not a live view
    assert len(reads) == 2
    # Negative control: a finished window's result was read at the boundary, as before.
    assert acc.micro_step(stream[2], _mse).stepped


# ----- StepResult.micro_batch_size: the size actually used --------------------------------------


@pytest.mark.parametrize(
    ("setting", "items", "used", "micro_batches"),
    [(64, 16, 16, 1), (16, 16, 16, 1), (8, 20, 8, 3), ("auto", 16, 16, 1)],
)
def test_step_reports_the_micro_batch_size_it_used(
    setting: int | str, items: int, used: int, micro_batches: int
) -> None:
    model = _mlp()
    budget = {"memory_budget": "1GiB"} if setting == "auto" else {}
    acc = Accumulator(model, _sgd(model), micro_batch_size=setting, telemetry=True, **budget)
    result = acc.step(_data(items), _mse)
    assert result.stepped
    assert (result.micro_batch_size, result.micro_batches) == (used, micro_batches)
    assert result.telemetry is not None
    assert result.telemetry.micro_batch_size == used
    assert acc.micro_batch_size == setting  # the setting stays what was asked for


def test_streamed_and_packed_windows_report_their_largest_micro_batch() -> None:
    model = _mlp()
    acc = Accumulator(model, _sgd(model), accumulation_steps=3)
    x, y = _data(9)
    acc.micro_step((x[:2], y[:2]), _mse)
    acc.micro_step((x[2:6], y[2:6]), _mse)
    assert acc.micro_step((x[6:], y[6:]), _mse).micro_batch_size == 4
    # A token budget of 8 on rows of 4 tokens: micro-batches of 2 rows.
    packed = Accumulator(model, _sgd(model), micro_batch_size=64)
    ids = torch.ones(6, 4, dtype=torch.long)

    def rows_loss(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return m(batch["input_ids"].to(torch.float64)).pow(2).mean()

    result = packed.step({"input_ids": ids, "attention_mask": ids}, rows_loss, max_tokens=8)
    assert (result.micro_batch_size, result.micro_batches) == (2, 3)


# --------------------------------------------------------------------------------------------
# Two optimizers
# --------------------------------------------------------------------------------------------


class _Both(torch.optim.Optimizer):
    """README, 'Two optimizers on one model': several optimizers stepped as one."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        super().__init__([g for o in optimizers for g in o.param_groups], {})

    def step(self, closure: Any = None) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]


def _muon_and_adamw(model: torch.nn.Module) -> tuple[Any, Any]:
    if not hasattr(torch.optim, "Muon"):
        pytest.skip(f"torch.optim.Muon is not in torch {torch.__version__}")
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=0.01)


def test_a_list_of_optimizers_is_refused_naming_the_fix() -> None:
    model = _mlp()
    before = clone_state(model.state_dict())
    with pytest.raises(TypeError, match=r"list of 2 \(Muon, AdamW\).*one Optimizer that steps"):
        Accumulator(model, list(_muon_and_adamw(model)), micro_batch_size=4)
    assert_bitwise(clone_state(model.state_dict()), before)


def test_two_optimizers_stepped_as_one_equal_the_full_batch_steps(tmp_path: Any) -> None:
    """Muon for the 2-D weights, AdamW for the rest, a scheduler over both, and a resume."""
    model = _mlp()
    twin = copy.deepcopy(model)
    both = _Both(*_muon_and_adamw(model))
    scheduler = torch.optim.lr_scheduler.StepLR(both, 1, gamma=0.5)
    acc = Accumulator(model, both, micro_batch_size=3, scheduler=scheduler)
    muon, adamw = _muon_and_adamw(twin)
    schedules = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (muon, adamw)]
    for seed in range(3):
        batch = _data(seed=seed)
        assert acc.step(batch, _mse).stepped
        for optimizer in (muon, adamw):
            optimizer.zero_grad()
        _mse(twin, batch).backward()
        for optimizer, schedule in zip((muon, adamw), schedules, strict=True):
            optimizer.step()
            schedule.step()
    for got, want in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    path = tmp_path / "both.pt"
    gradaccum.save_checkpoint(
        path, model=model, optimizer=both, accumulator=acc, scheduler=scheduler
    )
    again = _mlp()
    both_again = _Both(*_muon_and_adamw(again))
    schedule_again = torch.optim.lr_scheduler.StepLR(both_again, 1, gamma=0.5)
    acc_again = Accumulator(again, both_again, micro_batch_size=3, scheduler=schedule_again)
    gradaccum.load_checkpoint(
        path, model=again, optimizer=both_again, accumulator=acc_again, scheduler=schedule_again
    )
    acc.step(_data(seed=9), _mse)
    acc_again.step(_data(seed=9), _mse)
    assert_bitwise(clone_state(again.state_dict()), clone_state(model.state_dict()))


def test_negative_control_one_optimizer_of_two_leaves_the_other_untrained() -> None:
    """Given only Muon, the AdamW stepped after acc.step() finds no gradient: warned of."""
    model = _mlp()
    muon, adamw = _muon_and_adamw(model)
    with pytest.warns(UserWarning, match="a second optimizer stepped after acc.step"):
        acc = Accumulator(model, muon, micro_batch_size=3)
    biases = [p.detach().clone() for p in model.parameters() if p.ndim != 2]
    acc.step(_data(), _mse)
    adamw.step()
    after = [p.detach() for p in model.parameters() if p.ndim != 2]
    assert all(torch.equal(a, b) for a, b in zip(after, biases, strict=True))


def test_a_gan_with_one_accumulator_per_model_equals_the_plain_loop() -> None:
    """The refusal's other fix: a GAN's generator and discriminator, one Accumulator each."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    disc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    gen, disc = gen.double(), disc.double()
    plain_gen, plain_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (gen, disc))
    plain_g, plain_d = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (plain_gen, plain_disc))
    acc_g, acc_d = (Accumulator(m, o, micro_batch_size=3) for m, o in ((gen, opt_g), (disc, opt_d)))
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def d_loss(d: Any, batch: Any, g: Any) -> torch.Tensor:
        real, z = batch
        ones, zeros = torch.ones(len(real), 1).double(), torch.zeros(len(real), 1).double()
        return (bce(d(real), ones) + bce(d(g(z).detach()), zeros)) / 2

    def g_loss(g: Any, z: Any, d: Any) -> torch.Tensor:
        return bce(d(g(z)), torch.ones(len(z), 1).double())

    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        real = torch.randn(10, 4, generator=generator).double()
        z = torch.randn(10, 3, generator=generator).double()
        acc_d.step((real, z), lambda d, b: d_loss(d, b, gen))
        acc_g.step(z, lambda g, b: g_loss(g, b, disc))
        plain_d.zero_grad()
        d_loss(plain_disc, (real, z), plain_gen).backward()
        plain_d.step()
        plain_g.zero_grad()
        g_loss(plain_gen, z, plain_disc).backward()
        plain_g.step()
    for got, want in zip(
        [*gen.parameters(), *disc.parameters()],
        [*plain_gen.parameters(), *plain_disc.parameters()],
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class _Gan(torch.nn.Module):
    """A generator and a discriminator in one module, as many GAN codebases hold them."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.nn.Sequential(
            torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)
        )
        self.discriminator = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )


def _gan_losses() -> tuple[Callable[[Any, Any], torch.Tensor], Callable[[Any, Any], torch.Tensor]]:
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def d_loss(gan: Any, batch: Any) -> torch.Tensor:
        real, z = batch
        fake = gan.generator(z).detach()
        ones, zeros = torch.ones(len(real), 1).double(), torch.zeros(len(real), 1).double()
        return (bce(gan.discriminator(real), ones) + bce(gan.discriminator(fake), zeros)) / 2

    def g_loss(gan: Any, batch: Any) -> torch.Tensor:
        ones = torch.ones(len(batch[1]), 1).double()
        return bce(gan.discriminator(gan.generator(batch[1])), ones)

    return d_loss, g_loss


def test_a_gan_in_one_module_with_two_accumulators_equals_plain_steps_and_names_the_parts() -> None:
    """Both Accumulators built on the whole module: step() is exact (the discriminator's gradients
    left over from the generator's window are set aside, as the plain loop's zero_grad() does),
    the warning names the per-part fix, and interleaved streaming windows, which clear each
    other's gradients, are refused naming it too."""
    torch.manual_seed(0)
    gan = _Gan().double()
    plain, leaky = copy.deepcopy(gan), copy.deepcopy(gan)

    def adams(model: _Gan) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return tuple(  # type: ignore[return-value]
            torch.optim.Adam(part.parameters(), lr=1e-2)
            for part in (model.discriminator, model.generator)
        )

    (opt_d, opt_g), (plain_d, plain_g), (leaky_d, leaky_g) = adams(gan), adams(plain), adams(leaky)
    part_fix = r"own part as the model.*gan\.discriminator"
    with pytest.warns(UserWarning, match=part_fix):
        acc_d = Accumulator(gan, opt_d, micro_batch_size=3)
    with pytest.warns(UserWarning, match=part_fix):
        acc_g = Accumulator(gan, opt_g, micro_batch_size=3)
    d_loss, g_loss = _gan_losses()
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = (torch.randn(10, 4, generator=generator).double(),)
        batch += (torch.randn(10, 3, generator=generator).double(),)
        acc_d.step(batch, d_loss)
        acc_g.step(batch, g_loss)
        plain.zero_grad()
        d_loss(plain, batch).backward()
        plain_d.step()
        plain.zero_grad()
        g_loss(plain, batch).backward()
        plain_g.step()
        # Control: a loop that does not clear the discriminator's gradients before its step
        # adds the generator's backward through it (and the earlier steps) into that step.
        d_loss(leaky, batch).backward()
        leaky_d.step()
        leaky_g.zero_grad()
        g_loss(leaky, batch).backward()
        leaky_g.step()
    for got, want in zip(gan.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    pairs = zip(leaky.parameters(), plain.parameters(), strict=True)
    assert max(float((a - b).detach().abs().max()) for a, b in pairs) > 1e-4

    # Interleaved streaming windows over the whole module: refused, naming the per-part fix.
    with pytest.warns(UserWarning, match=part_fix):
        stream_d = Accumulator(gan, opt_d, accumulation_steps=2)
    with pytest.warns(UserWarning, match=part_fix):
        stream_g = Accumulator(gan, opt_g, accumulation_steps=2)
    gan.discriminator.requires_grad_(False)
    stream_g.micro_step(batch, g_loss)  # the generator's window is open
    gan.discriminator.requires_grad_(True)
    held = [None if p.grad is None else p.grad.clone() for p in gan.parameters()]
    # Its window would set the generator's gradients aside: refused before it runs.
    with pytest.raises(RuntimeError, match=r"own part as the model") as raised:
        stream_d.micro_step(batch, d_loss)
    assert "gan.generator" in str(raised.value)
    for param, grad in zip(gan.parameters(), held, strict=True):  # the open window kept whole
        assert (param.grad is None and grad is None) or torch.equal(param.grad, grad)
    stream_g.flush("drop")


def test_a_scheduler_of_another_optimizer_is_refused_naming_the_fix() -> None:
    """A scheduler built on an earlier optimizer (a notebook cell run again) would step nothing."""
    model = _mlp()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(stale, 1, gamma=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"another optimizer: .*StepLR\(optimizer, \.\.\.\)"):
        Accumulator(model, optimizer, micro_batch_size=3, scheduler=scheduler)
    # Set later, it is checked all the same (the window is discarded, nothing stepped).
    acc = Accumulator(model, optimizer, micro_batch_size=3)
    acc.scheduler = scheduler
    with pytest.raises(ValueError, match="another optimizer"):
        acc.step(_data(seed=0), _mse)
    # Control: unchecked (stepped by hand), the steps go on at the first lr while the stale
    # optimizer's decays.
    acc.scheduler = None
    lrs = []
    for seed in range(3):
        lrs.append(acc.step(_data(seed=seed), _mse).lr)
        scheduler.step()
    assert lrs == [0.1, 0.1, 0.1]
    assert stale.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    # Accepted: the optimizer's own scheduler, and one over a part of it (README recipe).
    muon, adamw = _muon_and_adamw(model)
    Accumulator(model, _Both(muon, adamw), micro_batch_size=3, scheduler=_step_lr(adamw))


def test_a_schedule_of_another_optimizer_over_the_same_model_names_acc_optimizer() -> None:
    """Replaced optimizers: the refusal names `acc.optimizer =` and `acc.scheduler =`.

    Before, a schedule left on the SGD after `acc.optimizer = AdamW(...)`, or one built on a new
    AdamW the Accumulator was not given, was told "build it on the optimizer you pass".
    """
    model = _mlp()
    sgd = _sgd(model)
    acc = Accumulator(model, sgd, micro_batch_size=3, scheduler=_step_lr(sgd))
    acc.step(_data(seed=0), _mse)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01)
    acc.optimizer = adamw  # the old schedule is still set
    before = _snapshot(model, adamw)
    with pytest.raises(ValueError, match=r"acc\.scheduler = StepLR\(acc\.optimizer, \.\.\.\)"):
        acc.step(_data(seed=1), _mse)
    _assert_unchanged(before, model, adamw)
    # A new optimizer built but not given: its schedule names `acc.optimizer = it`.
    acc = Accumulator(model, sgd, micro_batch_size=3)
    acc.scheduler = _step_lr(adamw)
    before = _snapshot(model, sgd)
    with pytest.raises(ValueError, match=r"its AdamW trains .*set acc\.optimizer = it"):
        acc.step(_data(seed=1), _mse)
    _assert_unchanged(before, model, sgd)
    # Control: a schedule of an optimizer over other parameters keeps the plain advice.
    other = torch.optim.SGD(_mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"none of the param groups") as raised:
        Accumulator(model, sgd, micro_batch_size=3, scheduler=_step_lr(other))
    assert "acc.optimizer" not in str(raised.value)


def _step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


# --------------------------------------------------------------------------------------------
# The optimizer replaced mid-run (a stage change)
# --------------------------------------------------------------------------------------------


def _stage_change_run(swap: bool, drive: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two SGD windows, then `acc.optimizer = AdamW` and its own schedule for two more.

    With `swap=False` the attribute is only rebound (what the assignment did before): the
    engine stepped the old SGD on, the AdamW never moved (its scheduler would be refused).
    """
    model = _mlp()
    acc = Accumulator(model, _sgd(model), micro_batch_size=3, accumulation_steps=2)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for seed in range(4):
        if seed == 2:
            if swap:
                acc.optimizer = adamw
                acc.scheduler = torch.optim.lr_scheduler.StepLR(adamw, 1, gamma=0.5)
            else:  # its scheduler was refused as "another optimizer's" then
                acc.__dict__["_optimizer"] = adamw
        x, y = _data(seed=seed)
        if drive == "step":
            result = acc.step((x, y), _mse)
        else:
            acc.micro_step((x[:4], y[:4]), _mse)
            result = acc.micro_step((x[4:], y[4:]), _mse)
        assert result.stepped
        if swap:
            assert result.lr == (0.1 if seed < 2 else 0.01 * 0.5 ** (seed - 2))
    return model, adamw


def _stage_change_reference() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _mlp()
    sgd = _sgd(model)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for seed in range(4):
        optimizer = sgd if seed < 2 else adamw
        if seed == 2:
            scheduler = torch.optim.lr_scheduler.StepLR(adamw, 1, gamma=0.5)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(_data(seed=seed)[0]), _data(seed=seed)[1]).backward()
        optimizer.step()
        if seed >= 2:
            scheduler.step()
    return model, adamw


@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_an_optimizer_set_between_windows_is_the_one_stepped(drive: str) -> None:
    """`acc.optimizer = AdamW(...)` at a stage change: the next windows step it, exactly.

    Before, the assignment rebound the attribute only: the engine kept stepping the SGD, the
    AdamW held no state, and a scheduler built on it was refused as "another optimizer's".
    """
    reference, ref_adamw = _stage_change_reference()
    model, adamw = _stage_change_run(swap=True, drive=drive)
    _assert_params_close(model, reference)
    assert len(adamw.state) == len(ref_adamw.state) == 4
    for param, ref_param in zip(model.parameters(), reference.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                adamw.state[param][key], ref_adamw.state[ref_param][key], rtol=1e-10, atol=1e-13
            )


def test_negative_control_an_optimizer_only_rebound_keeps_stepping_the_old_one() -> None:
    reference, _ = _stage_change_reference()
    model, adamw = _stage_change_run(swap=False, drive="step")
    assert not adamw.state  # never stepped
    gap = max(
        float((p - q).abs().max())
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    assert gap > 1e-3


def test_replacing_the_optimizer_inside_a_window_or_by_a_non_optimizer_is_refused() -> None:
    """Refused naming the fix, changing nothing; the open window goes on with the old one."""
    model = _mlp()
    optimizer = _sgd(model)
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    x, y = _data()
    acc.micro_step((x[:4], y[:4]), _mse)
    before = _snapshot(model, optimizer)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match=r"inside an open window .*acc\.flush\('step'\)"):
        acc.optimizer = adamw
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer"):
        acc.optimizer = "adamw"  # type: ignore[assignment]
    assert acc.optimizer is optimizer
    _assert_unchanged(before, model, optimizer)
    reference, _, _ = _reference_step(model, (x[:4], y[:4]))  # the window's one micro-batch
    acc.flush("step")  # settled: now it may be replaced
    _assert_params_close(model, reference)
    acc.optimizer = adamw
    acc.micro_step((x[:4], y[:4]), _mse)
    with pytest.raises(RuntimeError, match=r"AdamW\.step\(\) was called inside"):
        adamw.step()  # the new optimizer's own step inside a window is refused too
    acc.flush("drop")


# --------------------------------------------------------------------------------------------
# Weight averaging (README, "Weight averaging: EMA and SWA")
# --------------------------------------------------------------------------------------------


def _readme_block(holding: str) -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    found = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL) if holding in b]
    assert len(found) == 1
    return found[0]


def _averaging_run(code: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The README's recipe on 7 micro-batches of 3 items: windows of 4, then 3 (flushed)."""
    model = _mlp()
    x, y = _data(21)
    loader = [(x[i : i + 3], y[i : i + 3]) for i in range(0, 21, 3)]
    scope = {"model": model, "optimizer": _sgd(model), "loader": loader, "loss_fn": _mse}
    exec(code, {"Accumulator": Accumulator, "torch": torch}, scope)
    return model, scope["ema"]


def test_weight_averages_updated_when_a_window_stepped_equal_the_full_batch_run() -> None:
    """EMA (buffers too) and SWALR, updated on `result.stepped`: the full-batch run's average."""
    from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn

    code = _readme_block("get_ema_multi_avg_fn")
    model, ema = _averaging_run(code)
    reference = _mlp()
    ref_ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)
    optimizer = _sgd(reference)
    scheduler = SWALR(optimizer, swa_lr=0.05)
    x, y = _data(21)
    for window in (slice(0, 12), slice(12, 21)):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x[window]), y[window]).backward()
        optimizer.step()
        scheduler.step()
        ref_ema.update_parameters(reference)
    _assert_params_close(model, reference)
    _assert_params_close(ema, ref_ema)
    assert int(ema.n_averaged) == 2
    # Control: the same recipe updating the average after every micro_step() is far off.
    naive_code = code.replace("    if result.stepped:  ", "    if True:  ")
    assert naive_code != code
    _, naive_ema = _averaging_run(naive_code)
    assert int(naive_ema.n_averaged) == 7 + 1  # every micro-batch, and the flush's step
    gap = max(
        float((p - q).abs().max())
        for p, q in zip(naive_ema.parameters(), ref_ema.parameters(), strict=True)
    )
    assert gap > 1e-4
