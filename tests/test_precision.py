"""Tests for gradaccum.precision: fp16 loss scaling, non-finite windows, bf16 with fp32 buffers.

Everything runs on CPU: autocast and GradScaler both support it.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gradaccum
import gradaccum.norms
from gradaccum import Accumulator, LossSum, NonFiniteError
from gradaccum.options import Precision
from gradaccum.precision import PrecisionRuntime
from tests.state import assert_bitwise, clone_state

MICRO_BATCHES = 4
MICRO_BATCH_SIZE = 2
INITIAL_SCALE = 1024.0  # low enough that clean fp16 windows never overflow in these tests

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(seed: int, items: int = MICRO_BATCHES * MICRO_BATCH_SIZE):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(items, 6, generator=generator), torch.randn(items, 2, generator=generator)


def _mse(model: torch.nn.Module, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]).float(), batch[1])


def _mse_float64(model: torch.nn.Module, batch) -> torch.Tensor:
    """`_mse` of a float64 reference: its output rounded to float32 as `_mse` does, in float64.

    torch 2.4's mse_loss backward fails on a float32 input with a float64 target ("Found dtype
    Double but expected Float"), so the promotion torch does later is done here by hand.
    """
    return torch.nn.functional.mse_loss(model(batch[0]).float().double(), batch[1])


def _poisoned(kind: str, position: int) -> tuple[Callable[..., Any], list[int]]:
    """A loss_fn whose micro-batch number `position` turns non-finite in the way `kind` says."""
    calls: list[int] = []

    def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
        index = len(calls)
        calls.append(index)
        if index != position:
            return _mse(model, batch)
        if kind == "loss*inf":
            return _mse(model, batch) * float("inf")
        if kind == "loss*nan":
            return _mse(model, batch) * float("nan")
        if kind == "activation-nan":  # a NaN in a hidden activation spreads everywhere
            handle = model[0].register_forward_hook(lambda mod, args, out: out * float("nan"))
        elif kind == "output-inf":  # an inf in the model output
            handle = model[2].register_forward_hook(lambda mod, args, out: out * float("inf"))
        else:
            raise AssertionError(kind)
        try:
            return _mse(model, batch)
        finally:
            handle.remove()

    return loss_fn, calls


def _snapshot(model, optimizer, scheduler) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "optimizer": clone_state(optimizer.state_dict()),
        "scheduler": clone_state(scheduler.state_dict()),
        "lr": optimizer.param_groups[0]["lr"],
    }


def _set_scale(acc: Accumulator, scale: float) -> None:
    state = acc.scaler.state_dict()
    state["scale"] = scale
    acc.scaler.load_state_dict(state)


class Setup:
    """A model, AdamW with state from one clean window, a scheduler and an Accumulator."""

    def __init__(self, precision: str, on_nonfinite: str = "skip") -> None:
        self.model = _mlp()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda e: 0.5**e)
        self.acc = Accumulator(
            self.model,
            self.optimizer,
            micro_batch_size=MICRO_BATCH_SIZE,
            precision=precision,
            scheduler=self.scheduler,
            on_nonfinite=on_nonfinite,
        )
        if self.acc.scaler is not None:
            _set_scale(self.acc, INITIAL_SCALE)
        first = self.acc.step(_batch(0), _mse)
        assert first.stepped, "the clean warm-up window must step"
        assert self.optimizer.state, "AdamW must hold state before the test"

    def twin(self) -> Setup:
        """An independent copy of the current state (nothing shared, optimizer state included)."""
        other = copy.copy(self)
        other.model = copy.deepcopy(self.model)
        other.optimizer = torch.optim.AdamW(other.model.parameters(), lr=1e-2)
        other.scheduler = torch.optim.lr_scheduler.LambdaLR(other.optimizer, lambda e: 0.5**e)
        # Load after building the scheduler: its constructor resets the learning rate.
        other.optimizer.load_state_dict(copy.deepcopy(self.optimizer.state_dict()))
        other.scheduler.load_state_dict(copy.deepcopy(self.scheduler.state_dict()))
        other.acc = Accumulator(
            other.model,
            other.optimizer,
            micro_batch_size=MICRO_BATCH_SIZE,
            precision=self.acc.precision,
            scheduler=other.scheduler,
        )
        if self.acc.scaler is not None:
            other.acc.scaler.load_state_dict(self.acc.scaler.state_dict())
        return other


# --------------------------------------------------------------------------------------------
# A non-finite micro-batch anywhere in the window skips the whole window
# --------------------------------------------------------------------------------------------

POISONS = ["loss*inf", "loss*nan", "activation-nan", "output-inf"]


@pytest.mark.parametrize("position", range(MICRO_BATCHES))
@pytest.mark.parametrize("kind", POISONS)
def test_fp16_nonfinite_micro_batch_skips_the_window_whole(kind: str, position: int) -> None:
    setup = Setup("fp16")
    model, optimizer, scheduler, acc = setup.model, setup.optimizer, setup.scheduler, setup.acc
    before = _snapshot(model, optimizer, scheduler)
    epoch_before = scheduler.last_epoch
    scale_before = acc.scaler.get_scale()
    loss_fn, calls = _poisoned(kind, position)

    result = acc.step(_batch(1), loss_fn)

    assert len(calls) == MICRO_BATCHES  # the poisoned micro-batch was really in the window
    assert result.skipped is True
    assert result.stepped is False
    assert result.micro_batches == MICRO_BATCHES
    assert_bitwise(before, _snapshot(model, optimizer, scheduler))
    assert scheduler.last_epoch == epoch_before
    assert scheduler.get_last_lr() == before["scheduler"]["_last_lr"]
    # The scale backs off exactly once.
    assert acc.scaler.get_scale() == scale_before * acc.scaler.get_backoff_factor()

    # The skipped window leaves no trace: the next clean window steps exactly as it would
    # on a twin that never saw the poisoned window (given the same loss scale).
    twin = setup.twin()
    result = acc.step(_batch(2), _mse)
    twin_result = twin.acc.step(_batch(2), _mse)
    assert result.stepped is True
    assert result.skipped is False
    assert twin_result.stepped is True
    changed = [
        not torch.equal(p, b) for p, b in zip(model.parameters(), before["params"], strict=True)
    ]
    assert all(changed)
    for p, q in zip(model.parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert scheduler.last_epoch == epoch_before + 1


@pytest.mark.parametrize("position", range(MICRO_BATCHES))
@pytest.mark.parametrize("kind", ["loss*inf", "activation-nan"])
def test_fp32_nonfinite_window_is_skipped_bitwise(kind: str, position: int) -> None:
    setup = Setup("fp32")
    model, optimizer, scheduler, acc = setup.model, setup.optimizer, setup.scheduler, setup.acc
    assert acc.scaler is None
    before = _snapshot(model, optimizer, scheduler)
    loss_fn, calls = _poisoned(kind, position)
    result = acc.step(_batch(1), loss_fn)
    assert len(calls) == MICRO_BATCHES
    assert (result.skipped, result.stepped) == (True, False)
    assert_bitwise(before, _snapshot(model, optimizer, scheduler))

    twin = setup.twin()
    assert acc.step(_batch(2), _mse).stepped
    twin.acc.step(_batch(2), _mse)
    for p, q in zip(model.parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_streaming_nonfinite_window_is_skipped(precision: str) -> None:
    setup = Setup(precision)
    model, optimizer, scheduler = setup.model, setup.optimizer, setup.scheduler
    acc = Accumulator(
        model, optimizer, accumulation_steps=MICRO_BATCHES, precision=precision, scheduler=scheduler
    )
    if acc.scaler is not None:
        _set_scale(acc, INITIAL_SCALE)
    before = _snapshot(model, optimizer, scheduler)
    loss_fn, _ = _poisoned("loss*inf", 1)
    x, y = _batch(1)
    results = [acc.micro_step((x[i : i + 2], y[i : i + 2]), loss_fn) for i in range(0, len(x), 2)]
    assert [r.stepped for r in results] == [False] * MICRO_BATCHES
    assert [r.skipped for r in results] == [False] * (MICRO_BATCHES - 1) + [True]
    assert_bitwise(before, _snapshot(model, optimizer, scheduler))
    if acc.scaler is not None:
        assert acc.scaler.get_scale() == INITIAL_SCALE * acc.scaler.get_backoff_factor()


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_on_nonfinite_raise(precision: str) -> None:
    setup = Setup(precision, on_nonfinite="raise")
    model, optimizer, scheduler, acc = setup.model, setup.optimizer, setup.scheduler, setup.acc
    before = _snapshot(model, optimizer, scheduler)
    loss_fn, calls = _poisoned("output-inf", 2)
    with pytest.raises(NonFiniteError, match="non-finite") as info:
        acc.step(_batch(1), loss_fn)
    assert isinstance(info.value, FloatingPointError)
    assert "on_nonfinite='skip'" in str(info.value)  # names the alternative
    assert len(calls) == MICRO_BATCHES
    assert_bitwise(before, _snapshot(model, optimizer, scheduler))
    if acc.scaler is not None:  # never more than one back-off for one window
        assert acc.scaler.get_scale() in (INITIAL_SCALE, INITIAL_SCALE / 2)
    assert acc.step(_batch(2), _mse).stepped  # the accumulator is still usable


def test_fp16_nonfinite_loss_with_finite_gradients_backs_off_the_scale() -> None:
    """A loss that is inf while its gradient is finite (an inf constant term) is a non-finite
    window too: skipped whole, and the API promises the fp16 scale backs off exactly once."""
    setup = Setup("fp16")
    model, optimizer, scheduler, acc = setup.model, setup.optimizer, setup.scheduler, setup.acc
    before = _snapshot(model, optimizer, scheduler)
    scale_before = acc.scaler.get_scale()
    calls: list[int] = []

    def inf_offset(m, b) -> torch.Tensor:
        calls.append(1)
        loss = _mse(m, b)
        return loss + float("inf") if len(calls) == 2 else loss

    result = acc.step(_batch(1), inf_offset)
    assert (result.skipped, result.stepped) == (True, False)
    assert_bitwise(before, _snapshot(model, optimizer, scheduler))
    assert acc.scaler.get_scale() == scale_before * acc.scaler.get_backoff_factor()


# --------------------------------------------------------------------------------------------
# fp16: the loss scale within a window, and accuracy of a clean window
# --------------------------------------------------------------------------------------------


def test_fp16_scale_is_fixed_within_a_window() -> None:
    model = _mlp()
    acc = Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        accumulation_steps=MICRO_BATCHES,
        precision="fp16",
    )
    _set_scale(acc, INITIAL_SCALE)
    scales: list[float] = []

    def loss_fn(m, b) -> torch.Tensor:
        loss = _mse(m, b)
        # The gradient reaching the loss is (items * prescale * loss scale): fixed per window.
        loss.register_hook(lambda g: scales.append(g.item()))
        return loss

    x, y = _batch(1, items=MICRO_BATCHES * MICRO_BATCH_SIZE * 2)
    for start in range(0, len(x), MICRO_BATCH_SIZE):
        acc.micro_step((x[start : start + 2], y[start : start + 2]), loss_fn)
    assert len(scales) == 2 * MICRO_BATCHES
    assert len(set(scales)) == 1
    # The scaler is updated once per window (two clean windows), never per micro-batch.
    assert acc.scaler.state_dict()["_growth_tracker"] == 2
    # It is the loss scale times a power of two (the micro-batch's items times the prescale).
    assert math.frexp(scales[0] / INITIAL_SCALE)[0] == 0.5


def _scaler_settings(acc: Accumulator, **settings: float) -> None:
    state = acc.scaler.state_dict()
    state.update(settings)
    acc.scaler.load_state_dict(state)


def test_fp16_scale_follows_gradscaler_exactly_with_any_factors() -> None:
    """The scale after each window equals a plain loop's `torch.amp.GradScaler`, bit for bit,
    with factors that are not powers of two (torch keeps the scale in float32; the update was
    done in Python floats: 1473.8999999999999 where GradScaler has 1473.9000244140625)."""
    settings = {"growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 2}
    model = _mlp()
    reference = copy.deepcopy(model)
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=1e-3), micro_batch_size=2, precision="fp16"
    )
    _scaler_settings(acc, scale=1000.0, **settings)
    optimizer = torch.optim.SGD(reference.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, **settings)
    mine, theirs = [], []
    for window in range(12):
        poisoned = window in (4, 9)

        def loss_fn(m, b, poisoned=poisoned) -> torch.Tensor:
            return _mse(m, b) * float("inf") if poisoned else _mse(m, b)

        batch = _batch(window)
        assert acc.step(batch, loss_fn).skipped == poisoned
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(reference, batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        mine.append(acc.scaler.get_scale())
        theirs.append(scaler.get_scale())
    assert mine == theirs
    assert acc.scaler.state_dict() == scaler.state_dict()
    assert len(set(theirs)) > 4  # it grew and backed off with inexact factors


def test_fp16_scale_never_grows_past_float32() -> None:
    """GradScaler keeps the scale when growing it would overflow float32; a scale grown to 2**128
    in Python floats overflowed every later window's loss, skipping clean windows."""
    model = _mlp()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=1e-3), micro_batch_size=2, precision="fp16"
    )
    _scaler_settings(acc, scale=2.0**126, growth_interval=1)

    def tiny(m, b) -> torch.Tensor:
        return _mse(m, b) * 0.0

    results = [acc.step(_batch(i), tiny) for i in range(4)]
    assert [r.stepped for r in results] == [True] * 4
    assert acc.scaler.get_scale() == 2.0**127  # the largest float32 power of two


def test_fp16_scale_updates_under_a_float64_default_dtype() -> None:
    """`torch.set_default_dtype(torch.float64)` set by the user changes no tensor the scale
    update makes (torch's kernel takes float32 only)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = _mlp().float()
        acc = Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2, precision="fp16"
        )
        _scaler_settings(acc, scale=INITIAL_SCALE, growth_interval=1)
        batch = tuple(t.float() for t in _batch(0))
        assert acc.step(batch, _mse).stepped
        assert acc.scaler.get_scale() == 2 * INITIAL_SCALE
        assert acc.step(batch, lambda m, b: _mse(m, b) * float("inf")).skipped
        assert acc.scaler.get_scale() == INITIAL_SCALE
    finally:
        torch.set_default_dtype(previous)


def test_fp16_clean_window_matches_float64_within_fp16_rounding() -> None:
    model = _mlp()
    x, y = _batch(3, items=7)  # micro-batches of 2, 2, 2, 1
    reference = copy.deepcopy(model).double()
    ref_grads = torch.autograd.grad(
        _mse_float64(reference, (x.double(), y.double())), list(reference.parameters())
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(opt, args, kwargs) -> None:
        seen["grads"] = [p.grad.double().clone() for p in model.parameters()]

    optimizer.register_step_pre_hook(hook)
    acc = Accumulator(model, optimizer, micro_batch_size=2, precision="fp16")
    _set_scale(acc, INITIAL_SCALE)
    result = acc.step((x, y), _mse)
    assert result.stepped
    flat = torch.cat([g.flatten() for g in seen["grads"]])
    flat_ref = torch.cat([g.flatten() for g in ref_grads])
    error = float((flat - flat_ref).norm() / flat_ref.norm())
    # fp16 forward rounding only; a missing unscale would be off by a factor of 1024, and a
    # missing or doubled division by the count by far more than 1e-2.
    assert error < 1e-2, f"relative error {error:.2e}"
    assert result.grad_norm == pytest.approx(float(flat_ref.norm()), rel=1e-2)


def test_fp16_needs_float32_parameters() -> None:
    model = _mlp().half()
    with pytest.raises(ValueError, match="precision='fp16' needs float32 parameters"):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")


def test_fp16_with_float64_buffers_is_exact_or_rejected() -> None:
    """accum_dtype=torch.float64 on float32 parameters makes buffers; the GradScaler must still
    unscale what the optimizer sees (or the combination must be refused up front)."""
    model = _mlp()
    x, y = _batch(3)
    reference = copy.deepcopy(model).double()
    ref_grads = torch.autograd.grad(
        _mse_float64(reference, (x.double(), y.double())), list(reference.parameters())
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[str, list[torch.Tensor]] = {}

    def capture(opt, args, kwargs) -> None:
        seen.setdefault("grads", [p.grad.double() for p in model.parameters()])

    optimizer.register_step_pre_hook(capture)
    try:
        acc = Accumulator(
            model, optimizer, micro_batch_size=2, precision="fp16", accum_dtype=torch.float64
        )
    except ValueError:
        return  # refusing the combination with a clear message is acceptable
    _set_scale(acc, INITIAL_SCALE)
    result = acc.step((x, y), _mse)
    assert result.stepped
    flat = torch.cat([g.flatten() for g in seen["grads"]])
    flat_ref = torch.cat([g.flatten() for g in ref_grads])
    assert float((flat - flat_ref).norm() / flat_ref.norm()) < 1e-2


# --------------------------------------------------------------------------------------------
# bf16 parameters with float32 accumulation buffers
# --------------------------------------------------------------------------------------------


def _bf16_mlp_error(accum_dtype: torch.dtype | None, seed: int = 0) -> float:
    """Relative error of the gradient the optimizer sees after 64 bf16 micro-steps."""
    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))
    model = base.to(torch.bfloat16)
    reference = copy.deepcopy(model).double()  # the very same weights, in float64
    generator = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(64 * 2, 16, generator=generator).to(torch.bfloat16)
    y = (torch.randn(64 * 2, 4, generator=generator) + 1.0).to(torch.bfloat16)

    def loss_fn(m, b) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]).float(), b[1].float())

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(opt, args, kwargs) -> None:
        seen["grads"] = [p.grad.double().clone() for p in model.parameters()]

    optimizer.register_step_pre_hook(hook)
    acc = Accumulator(
        model, optimizer, accumulation_steps=64, precision="bf16", accum_dtype=accum_dtype
    )
    for start in range(0, len(x), 2):
        result = acc.micro_step((x[start : start + 2], y[start : start + 2]), loss_fn)
    assert result.stepped
    assert result.micro_batches == 64
    ref_loss = loss_fn(reference, (x.double(), y.double()))
    ref_grads = torch.autograd.grad(ref_loss, list(reference.parameters()))
    flat = torch.cat([g.flatten() for g in seen["grads"]])
    flat_ref = torch.cat([g.flatten() for g in ref_grads])
    return float((flat - flat_ref).norm() / flat_ref.norm())


def test_bf16_float32_buffers_beat_native_bf16_accumulation() -> None:
    """Over 64 micro-steps, fp32 buffers must be clearly more accurate than bf16 .grad sums.

    Measured on this model (10 seeds): fp32 buffers ~2e-3, native bf16 7e-3..1e-2 (x3.0-4.8).
    Both include the bf16 forward/backward rounding that no accumulation dtype can remove, so
    the asserted bound is x2.
    """
    buffered = _bf16_mlp_error(torch.float32)
    native = _bf16_mlp_error(None)
    print(
        f"\nbf16 MLP, 64 micro-steps: fp32 buffers {buffered:.3e}, native bf16 {native:.3e}, "
        f"x{native / buffered:.1f}"
    )
    assert native >= 2.0 * buffered, (
        f"fp32 buffers {buffered:.3e} vs native bf16 {native:.3e} (x{native / buffered:.2f})"
    )


def _bf16_exact_sum(accum_dtype: torch.dtype | None, seed: int):
    """A window whose 64 micro-gradients are exact in bf16, so only accumulation can round.

    A bias-free linear layer with loss sum(out * t), t = +-1 and one item per micro-batch:
    each micro-gradient is t x^T, exact products of bf16 numbers. Their sum fits float32
    exactly (inputs have |x| in [1/8, 8), 8 significant bits; 64 terms).
    """
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(16, 4, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randn(4, 16, generator=generator))
    model = model.to(torch.bfloat16)
    magnitude = (0.125 + torch.randn(64, 16, generator=generator).abs()).clamp(max=7.9)
    sign = torch.randint(0, 2, (64, 16), generator=generator) * 2 - 1
    x = (magnitude * sign).to(torch.bfloat16)
    t = (torch.randint(0, 2, (64, 4), generator=generator) * 2 - 1).float()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: dict[str, torch.Tensor] = {}

    def hook(opt, args, kwargs) -> None:
        seen["grad"] = model.weight.grad.clone()

    optimizer.register_step_pre_hook(hook)
    acc = Accumulator(
        model, optimizer, accumulation_steps=64, precision="bf16", accum_dtype=accum_dtype
    )

    def loss_fn(m, b) -> LossSum:
        return LossSum((m(b[0]).float() * b[1]).sum(), 1)

    for i in range(64):
        acc.micro_step((x[i : i + 1], t[i : i + 1]), loss_fn)
    reference = (t.double().T @ x.double()) / 64  # exact in float64
    return seen["grad"], reference


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_float32_buffers_round_once(seed: int) -> None:
    """With fp32 buffers the optimizer sees the exact mean gradient rounded ONCE to bf16."""
    buffered, reference = _bf16_exact_sum(torch.float32, seed)
    native, _ = _bf16_exact_sum(None, seed)
    assert buffered.dtype == torch.bfloat16
    assert torch.equal(buffered, reference.to(torch.bfloat16))
    # Negative control: summing in bf16 .grad rounds 63 more times and is far off.
    assert not torch.equal(native, reference.to(torch.bfloat16))
    err_buffered = float((buffered.double() - reference).norm() / reference.norm())
    err_native = float((native.double() - reference).norm() / reference.norm())
    print(
        f"\nbf16 exact-sum seed {seed}: fp32 buffers {err_buffered:.3e}, "
        f"native {err_native:.3e}, x{err_native / err_buffered:.1f}"
    )
    assert err_native >= 3.0 * err_buffered, (err_buffered, err_native)


def test_bf16_buffers_with_clipping_clip_what_the_optimizer_sees() -> None:
    torch.manual_seed(0)
    model = _mlp().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(opt, args, kwargs) -> None:
        seen["grads"] = [p.grad.double().clone() for p in model.parameters()]

    optimizer.register_step_pre_hook(hook)
    acc = Accumulator(
        model,
        optimizer,
        micro_batch_size=2,
        precision="bf16",
        accum_dtype=torch.float32,
        max_grad_norm=0.01,
    )
    x, y = _batch(4)
    result = acc.step((x.to(torch.bfloat16), y.to(torch.bfloat16)), _mse)
    assert result.grad_norm > 0.1  # so clipping to 0.01 really happens
    clipped = torch.cat([grad.flatten() for grad in seen["grads"]]).norm().item()
    assert clipped == pytest.approx(0.01, rel=1e-2)


def _fp16_weights_with_a_huge_gradient(**settings: Any):
    """A float16 linear layer whose window gradient (1e5 per weight) exceeds float16's 65504,
    while each micro-batch's share (2.5e4) and their float32 sum are finite."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    acc = Accumulator(model, optimizer, micro_batch_size=2, scheduler=scheduler, **settings)
    x = torch.full((8, 4), 1000.0, dtype=torch.float16)

    def loss_fn(m, b) -> LossSum:
        return LossSum(m(b).float().sum() * 100.0, len(b))

    return model, optimizer, scheduler, acc, x, loss_fn


@pytest.mark.parametrize("on_nonfinite", ["skip", "raise"])
def test_a_buffered_gradient_overflowing_its_parameters_dtype_is_a_nonfinite_window(
    on_nonfinite: str,
) -> None:
    """float32 buffers hold a finite sum that is inf once written back to float16 `.grad`: the
    optimizer stepped on it (every weight inf). Such a window is non-finite, like the same
    window accumulated in float16 `.grad`: skipped whole, or raised, nothing changed."""
    model, optimizer, scheduler, acc, x, loss_fn = _fp16_weights_with_a_huge_gradient(
        accum_dtype=torch.float32, on_nonfinite=on_nonfinite
    )
    before = _snapshot(model, optimizer, scheduler)
    if on_nonfinite == "raise":
        with pytest.raises(NonFiniteError, match="weight"):
            acc.step(x, loss_fn)
    else:
        result = acc.step(x, loss_fn)
        assert (result.stepped, result.skipped) == (False, True)
        assert math.isfinite(result.grad_norm)  # the sum itself was finite (float32)
    assert_bitwise(before, _snapshot(model, optimizer, scheduler))
    assert acc.state_dict()["engine"]["precision"]["buffers"] == []  # the window is gone
    # NEGATIVE CONTROL: without buffers the float16 sum overflows and the window is skipped too.
    *_, plain, x, loss_fn = _fp16_weights_with_a_huge_gradient()
    assert plain.step(x, loss_fn).skipped
    # Clipping in the float32 buffers brings it in range: the window steps, finite.
    model, *_, clipped, x, loss_fn = _fp16_weights_with_a_huge_gradient(
        accum_dtype=torch.float32, max_grad_norm=1.0
    )
    assert clipped.step(x, loss_fn).stepped
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_only_the_optimizers_buffered_gradients_must_fit_their_dtype() -> None:
    """A float16 parameter the optimizer does not hold (its gradient is cleared unused) may
    overflow when written back; the optimizer's own, large but in range, still step."""
    torch.manual_seed(0)
    held, other = torch.nn.Linear(4, 1, bias=False), torch.nn.Linear(4, 1, bias=False)
    model = torch.nn.ModuleDict({"held": held, "other": other}).half()
    optimizer = torch.optim.SGD(model["held"].parameters(), lr=1e-9)
    with pytest.warns(UserWarning, match="in no param group"):
        acc = Accumulator(model, optimizer, micro_batch_size=2, accum_dtype=torch.float32)
    x = torch.full((8, 4), 1000.0, dtype=torch.float16)

    def loss_fn(m, b) -> LossSum:  # d/d(held) = 40000 each (norm 8e4), d/d(other) = 1e5
        return LossSum(
            m["held"](b).float().sum() * 40.0 + m["other"](b).float().sum() * 100.0, len(b)
        )

    result = acc.step(x, loss_fn)
    assert result.stepped
    assert result.grad_norm == pytest.approx(8e4)
    assert bool(torch.isfinite(held.weight).all())


@pytest.mark.parametrize("on_nonfinite", ["skip", "raise"])
def test_finite_gradients_whose_norm_overflows_are_a_nonfinite_window(on_nonfinite: str) -> None:
    """Every gradient finite (1e20), their float32 2-norm inf: the window is non-finite, as
    `clip_grad_norm_(..., error_if_nonfinite=True)` refuses the same full-batch gradient (its
    default would scale every gradient by 0 and step). Nothing changes either way."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    acc = Accumulator(
        model,
        optimizer,
        micro_batch_size=2,
        max_grad_norm=1.0,
        scheduler=scheduler,
        on_nonfinite=on_nonfinite,
    )
    x = torch.full((8, 4), 1e19)

    def loss_fn(m, b) -> LossSum:
        return LossSum(m(b).sum() * 10.0, len(b))

    loss = loss_fn(reference, x)
    (loss.value / loss.count).backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in reference.parameters())
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, error_if_nonfinite=True)
    before = _snapshot(model, optimizer, scheduler)
    if on_nonfinite == "raise":
        # The loss is finite: the message names the norm (it blamed the loss itself before).
        with pytest.raises(NonFiniteError, match=r"grad norm inf.*every gradient is finite"):
            acc.step(x, loss_fn)
    else:
        result = acc.step(x, loss_fn)
        assert (result.stepped, result.skipped, result.grad_norm) == (False, True, math.inf)
    assert_bitwise(before, _snapshot(model, optimizer, scheduler))


def _half_linear() -> torch.nn.Module:
    """Pure float16 weights (`model.half()`) of 4 x 4096: with inputs of 200 and `_half_loss`,
    every weight's gradient is 800 (exact in float16, halves and quarters on the way) and their
    2-norm 102400 passes float16's largest value, 65504."""
    torch.manual_seed(0)
    return torch.nn.Linear(4096, 4).half()


def _half_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).float().sum(-1).mean() * 4.0


@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
def test_float16_gradients_whose_norm_passes_float16s_range_are_clipped_in_float32(
    accum_dtype: torch.dtype | None,
) -> None:
    """Every float16 gradient finite (800), their norm 102400 > 65504: in float16 (what
    `clip_grad_norm_` computes) it is inf, and the window was skipped as non-finite window after
    window (`"raise"` blamed the loss, which was finite). The norm is taken in float32: the step
    is the full-batch step clipped by it, computed by hand."""
    model, reference = _half_linear(), _half_linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = Accumulator(
        model, optimizer, micro_batch_size=2, max_grad_norm=1.0, accum_dtype=accum_dtype
    )
    batch = torch.full((8, 4096), 200.0, dtype=torch.float16)
    result = acc.step(batch, _half_loss)
    grads = torch.autograd.grad(_half_loss(reference, batch), list(reference.parameters()))
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    wide = [g.double() for g in grads]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in wide])))
    assert norm > 65504.0
    assert torch.isinf(torch.nn.utils.get_total_norm(grads))  # torch's own, in float16
    assert result.stepped
    assert result.grad_norm == pytest.approx(norm, rel=1e-6)
    coefficient = 1.0 / (norm + 1e-6)
    for param, start, grad in zip(model.parameters(), reference.parameters(), wide, strict=True):
        expected = start.detach().double() - 0.5 * grad * coefficient
        torch.testing.assert_close(param.detach().double(), expected, rtol=1e-3, atol=1e-3)


def test_negative_control_float16_norms_left_in_float16_skip_every_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gradaccum.norms, "_float32_if_overflowed", lambda grads, norm: norm)
    model = _half_linear()
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=2, max_grad_norm=1.0
    )
    result = acc.step(torch.full((8, 4096), 200.0, dtype=torch.float16), _half_loss)
    assert (result.stepped, result.grad_norm) == (False, math.inf)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_fp16_refuses_float16_parameters_the_optimizer_holds_outside_the_model() -> None:
    """A float16 loss weight outside the model took the loss scale in its float16 gradient:
    windows overflowed and were skipped until the scale had backed off (5 windows here),
    where float16 weights inside the model are refused up front (and torch's GradScaler
    refuses to unscale float16 gradients)."""
    model = _mlp()
    weight = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float16))
    optimizer = torch.optim.SGD([*model.parameters(), weight], lr=0.1)
    with pytest.raises(ValueError, match="precision='fp16' needs float32 parameters"):
        Accumulator(model, optimizer, micro_batch_size=2, precision="fp16")
    # NEGATIVE CONTROL: a float32 weight outside the model is fine.
    weight32 = torch.nn.Parameter(torch.tensor(1.0))
    optimizer = torch.optim.SGD([*model.parameters(), weight32], lr=0.1)
    Accumulator(model, optimizer, micro_batch_size=2, precision="fp16")


def _bf16_weight_sum(accum_dtype: torch.dtype | None, *, unfreeze_later: bool) -> torch.Tensor:
    """The gradient the optimizer sees for a bfloat16 scalar in a float32 model's window whose
    micro-gradients are 1 and four times 2**-9: 1 + 2**-7 in float32 (exact in bf16), 1 when
    summed in bf16 (each 1 + 2**-9 rounds back to 1)."""
    model = torch.nn.Linear(1, 1)
    scale = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.bfloat16))
    if unfreeze_later:  # in the model, frozen when the Accumulator is built
        model.scale = scale
        scale.requires_grad_(False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    else:  # outside the model, in the optimizer
        optimizer = torch.optim.SGD([*model.parameters(), scale], lr=0.0)
    seen: dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(lambda o, a, k: seen.update(grad=scale.grad.clone()))
    acc = Accumulator(
        model, optimizer, micro_batch_size=1, normalize="sum", accum_dtype=accum_dtype
    )
    scale.requires_grad_(True)
    coefficients = torch.tensor([[1.0], [2**-9], [2**-9], [2**-9], [2**-9]])

    def loss_fn(m, b) -> LossSum:
        return LossSum((scale.float() * b).sum() + 0 * m(b).sum(), len(b))

    assert acc.step(coefficients, loss_fn).stepped
    return seen["grad"]


@pytest.mark.parametrize("unfreeze_later", [False, True])
def test_float32_buffers_serve_every_less_precise_parameter_of_the_window(
    unfreeze_later: bool,
) -> None:
    """`accum_dtype` buffers were decided from the model's trainable parameters at construction:
    a bf16 parameter outside the model, or unfrozen later, summed in bf16 `.grad` instead."""
    buffered = _bf16_weight_sum(torch.float32, unfreeze_later=unfreeze_later)
    assert buffered.dtype == torch.bfloat16
    assert buffered.item() == 1 + 2**-7
    # NEGATIVE CONTROL: summed in bf16 the small contributions are lost.
    assert _bf16_weight_sum(None, unfreeze_later=unfreeze_later).item() == 1.0


def test_float32_buffers_on_float32_parameters_change_nothing() -> None:
    results = []
    for accum_dtype in (None, torch.float32):
        model = _mlp()
        acc = Accumulator(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            micro_batch_size=2,
            accum_dtype=accum_dtype,
        )
        acc.step(_batch(5), _mse)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# PrecisionRuntime and autocast
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "dtype", "has_scaler"),
    [
        ("fp32", torch.float32, False),
        ("bf16", torch.bfloat16, False),
        ("fp16", torch.float16, True),
    ],
)
def test_forward_runs_under_the_requested_autocast(precision, dtype, has_scaler) -> None:
    model = _mlp()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4, precision=precision
    )
    assert (acc.scaler is not None) == has_scaler
    if has_scaler:
        assert isinstance(acc.scaler, torch.amp.GradScaler)
        _set_scale(acc, INITIAL_SCALE)
    dtypes = []

    def loss_fn(m, b) -> torch.Tensor:
        out = m(b[0])
        dtypes.append(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), b[1])

    assert acc.step(_batch(6), loss_fn).stepped
    assert dtypes == [dtype, dtype]
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("bad", [torch.int64, torch.bool, "float32", 32])
def test_runtime_rejects_non_floating_accum_dtype(bad: object) -> None:
    params = list(_mlp().parameters())
    with pytest.raises(ValueError, match=r"must be a floating torch\.dtype"):
        PrecisionRuntime(Precision.BF16, params, bad)  # type: ignore[arg-type]


def test_accum_dtype_narrower_in_range_than_the_parameters_is_refused() -> None:
    """float16 buffers are more precise than bfloat16 but hold only up to 65504 and flush
    gradients below 6e-8 to 0: bf16 weights' gradients of 1e-9 summed to exactly 0 (a silent
    wrong step) and 1e5 to inf (a skipped window). Refused up front, naming float32."""
    assert torch.tensor(1e-9, dtype=torch.bfloat16).to(torch.float16).item() == 0.0
    model = _mlp().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=r"accum_dtype=torch.float16 cannot hold .*accum_dtype=torch.float32"
    ):
        Accumulator(model, optimizer, micro_batch_size=2, accum_dtype=torch.float16)
    # NEGATIVE CONTROL: float32 buffers hold every bf16 gradient; float16 buffers for float16
    # weights, and float16 on float32 weights (no buffer: nothing less precise), are fine.
    Accumulator(model, optimizer, micro_batch_size=2, accum_dtype=torch.float32)
    half = _mlp().half()
    Accumulator(half, torch.optim.SGD(half.parameters(), lr=0.1), accum_dtype=torch.float16)
    full = _mlp()
    Accumulator(full, torch.optim.SGD(full.parameters(), lr=0.1), accum_dtype=torch.float16)


def test_runtime_buffers_only_less_precise_parameters() -> None:
    model = _mlp()
    model[0].to(torch.bfloat16)
    runtime = PrecisionRuntime(Precision.BF16, list(model.parameters()), torch.float32)
    assert [runtime.buffered(p) for p in model.parameters()] == [True, True, False, False]
    assert runtime.uses_buffers
    assert not PrecisionRuntime(Precision.FP32, list(model.parameters()), None).uses_buffers


def test_nonfinite_error_is_exported() -> None:
    assert gradaccum.NonFiniteError is NonFiniteError


# ------------------------------------------------------------------ a loss in a low precision


def _low_precision_loss(dtype: torch.dtype) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
    """A float64 model whose loss is handed back in `dtype` (a hand-written loss under autocast,
    or a `.to(dtype)`): the full-batch step seeds it with 1, exact in any dtype."""

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1]).to(dtype)

    return loss_fn


def _twelve_rows() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(12, 4, generator=generator, dtype=torch.float64),
        torch.randn(12, 2, generator=generator, dtype=torch.float64),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    return model.double(), batch


def _full_batch_grads(model: torch.nn.Module, batch: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    reference = copy.deepcopy(model)
    _low_precision_loss(dtype)(reference, batch).backward()
    return [p.grad for p in reference.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("drive", ["step", "accumulate_grad"])
def test_a_low_precision_loss_gets_exact_backward_seeds(dtype: torch.dtype, drive: str) -> None:
    """12 rows split 5 + 5 + 2: a folded seed 5/12 rounded to bfloat16 was 3e-3 off the
    full-batch gradient; a power-of-two denominator gives the seed 5/16, exact, and the
    boundary divides by 12/16 in float64."""
    model, batch = _twelve_rows()
    expected = _full_batch_grads(model, batch, dtype)
    if drive == "step":  # SGD with lr=1: each parameter moves by its gradient
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batch_size=5)
        before = [p.detach().clone() for p in model.parameters()]
        assert acc.step(batch, _low_precision_loss(dtype)).stepped
        actual = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]
    else:
        gradaccum.accumulate_grad(model, batch, _low_precision_loss(dtype), micro_batch_size=5)
        actual = [p.grad for p in model.parameters()]
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_negative_control_a_hand_loop_folding_the_count_into_a_bfloat16_loss_is_off() -> None:
    """`loss * n / B` on the bfloat16 loss (the seed the fold gave): more than 1e-4 off."""
    model, batch = _twelve_rows()
    expected = _full_batch_grads(model, batch, torch.bfloat16)
    for start in range(0, 12, 5):
        part = (batch[0][start : start + 5], batch[1][start : start + 5])
        loss = _low_precision_loss(torch.bfloat16)(model, part)
        (loss * len(part[0]) / 12).backward()
    gap = max(
        float((p.grad - want).abs().max() / want.abs().max())
        for p, want in zip(model.parameters(), expected, strict=True)
    )
    assert gap > 1e-4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_on_a_float64_model_warns_that_it_does_nothing_and_stays_exact(precision) -> None:
    """Autocast leaves float64 alone: bf16/fp16 asked for on a float64 model ran silently in
    float64. It warns once, at the user's line, naming model.float(); the steps stay exactly the
    float64 full-batch ones (the run is not refused: a config may set the precision for all)."""
    model = _mlp().double()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    says = f"precision='{precision}' has no effect.*model.float"
    with pytest.warns(UserWarning, match=says) as w:
        acc = Accumulator(model, optimizer, micro_batch_size=3, precision=precision)
    assert [r.filename for r in w] == [__file__]
    x, y = (t.double() for t in _batch(4, items=7))
    assert acc.step((x, y), _mse_float64).stepped
    _mse_float64(reference, (x, y)).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q - 0.1 * q.grad, rtol=1e-10, atol=0)


def test_negative_control_autocast_on_a_float32_model_does_not_warn_and_rounds() -> None:
    model = _mlp()
    reference = copy.deepcopy(model).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    x, y = _batch(4, items=7)
    acc.micro_batch_size = 3
    assert acc.step((x, y), _mse).stepped
    _mse_float64(reference, (x.double(), y.double())).backward()
    gaps = [
        float((p.double() - (q - 0.1 * q.grad)).abs().max().detach())
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    assert max(gaps) > 1e-5  # bf16 autocast did round: the warning's case is the float64 one


def test_fp16_nonfinite_error_says_the_loss_scale_backed_off_and_nothing_else_changed() -> None:
    """`on_nonfinite="raise"` under fp16: the scale backs off once (as GradScaler does, so a
    retry can pass) and the error says so; it used to say only that the window was discarded,
    as if nothing had changed. Everything else is bitwise as before."""
    setup = Setup("fp16", on_nonfinite="raise")
    model, optimizer, scheduler, acc = setup.model, setup.optimizer, setup.scheduler, setup.acc
    before = _snapshot(model, optimizer, scheduler)
    with pytest.raises(NonFiniteError, match=r"loss scale backed off to 512\b.*retry") as info:
        acc.step(_batch(1), lambda m, b: _mse(m, b) * float("inf"))
    assert "optimizer and scheduler unchanged" in str(info.value)
    assert_bitwise(before, _snapshot(model, optimizer, scheduler))
    assert acc.scaler.get_scale() == INITIAL_SCALE / 2
    # Negative control: fp32 has no scale to name.
    fp32 = Setup("fp32", on_nonfinite="raise")
    with pytest.raises(NonFiniteError) as info:
        fp32.acc.step(_batch(1), lambda m, b: _mse(m, b) * float("inf"))
    assert "loss scale" not in str(info.value)


def _low_precision_errors(dtype: torch.dtype, seed: int) -> tuple[float, float, float]:
    """Gradient errors vs float64 of a pure `dtype` MLP (no autocast) on 256 items: the full
    batch's own backward, and 64 micro-batches of 4 with and without float32 buffers."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    model = model.to(dtype)
    generator = torch.Generator().manual_seed(50 + seed)
    x = torch.randn(256, 16, generator=generator).to(dtype)
    y = torch.randn(256, 4, generator=generator) + 1

    def loss_fn(m, b) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]).float(), b[1])

    def error(grads) -> float:
        flat = torch.cat([g.double().flatten() for g in grads])
        return float((flat - truth).norm() / truth.norm())

    reference = copy.deepcopy(model).double()
    loss = torch.nn.functional.mse_loss(reference(x.double()), y.double())
    truth = torch.cat(
        [g.flatten() for g in torch.autograd.grad(loss, list(reference.parameters()))]
    )
    full = error(torch.autograd.grad(loss_fn(model, (x, y)), list(model.parameters())))
    errors = []
    for accum_dtype in (torch.float32, None):
        copied = copy.deepcopy(model)
        optimizer = torch.optim.SGD(copied.parameters(), lr=0.0)
        seen: dict[str, list[torch.Tensor]] = {}

        def hook(o, a, k, m=copied, seen=seen) -> None:
            seen["grads"] = [p.grad.clone() for p in m.parameters()]

        optimizer.register_step_pre_hook(hook)
        Accumulator(copied, optimizer, micro_batch_size=4, accum_dtype=accum_dtype).step(
            (x, y), loss_fn
        )
        errors.append(error(seen["grads"]))
    return full, errors[0], errors[1]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pure_low_precision_weights_with_float32_buffers_are_as_exact_as_the_full_batch(
    dtype: torch.dtype, seed: int
) -> None:
    """`model.bfloat16()` / `.half()` trained without autocast: with float32 buffers the window's
    gradient is as exact as the full batch's own low-precision backward (measured 1.00-1.07x over
    5 seeds), whatever the split; README states it. Control: summed in the weights' own `.grad`,
    64 micro-batches round 63 more times (3.3-5.5x)."""
    full, buffered, native = _low_precision_errors(dtype, seed)
    assert buffered <= 1.15 * full, (full, buffered)
    assert native >= 2.0 * full, (full, native)


def _tiny_logits(model: torch.nn.Module, batch) -> torch.Tensor:
    """Gradients around 1e-8: below float16's smallest subnormal once unscaled."""
    labels = (batch[1][:, 0] > 0).long()
    return torch.nn.functional.cross_entropy(model(batch[0]) * 1e-6, labels)


@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_an_outer_fp16_autocast_with_precision_fp32_warns_once(drive: str) -> None:
    """A loop that keeps its own `torch.autocast(dtype=float16)` around the Accumulator (its
    GradScaler removed) ran the forward in fp16 with no loss scale: the first layer's gradient
    flushed to 0 and the step was taken, silently. It warns once, at the caller's line, naming
    'fp16'."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(opt, args, kwargs) -> None:
        seen["grads"] = [p.grad.clone() for p in model.parameters()]

    optimizer.register_step_pre_hook(hook)
    steps = 4 if drive == "micro_step" else None
    size = 2 if drive == "step" else None
    acc = Accumulator(model, optimizer, micro_batch_size=size, accumulation_steps=steps)
    x, y = _batch(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two windows: one warning
            with torch.autocast("cpu", dtype=torch.float16):
                if drive == "step":
                    acc.step((x, y), _tiny_logits)
                else:
                    for i in range(0, len(x), 2):
                        acc.micro_step((x[i : i + 2], y[i : i + 2]), _tiny_logits)
    said = [w for w in caught if "autocast of your own" in str(w.message)]
    assert len(said) == 1
    assert said[0].filename == __file__
    assert "precision='fp16'" in str(said[0].message)
    assert float(seen["grads"][0].abs().max()) == 0.0  # what it warns of: the first layer's


def test_negative_control_precision_fp16_or_a_bf16_autocast_do_not_warn() -> None:
    """precision='fp16' opens its own autocast and loss scale: under the same outer autocast the
    gradient is right (fp16 rounding); an outer bf16 autocast needs no scale. Neither warns."""
    x, y = _batch(5)
    reference = _mlp().double()
    loss = _tiny_logits(reference, (x.double(), y.double()))
    truth = torch.cat(
        [g.flatten() for g in torch.autograd.grad(loss, list(reference.parameters()))]
    )
    for precision, dtype in (("fp16", torch.float16), ("fp32", torch.bfloat16)):
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        seen: dict[str, torch.Tensor] = {}

        def hook(opt, args, kwargs, model=model, seen=seen) -> None:
            seen["grad"] = torch.cat([p.grad.double().flatten() for p in model.parameters()])

        optimizer.register_step_pre_hook(hook)
        acc = Accumulator(model, optimizer, micro_batch_size=2, precision=precision)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.autocast("cpu", dtype=dtype):
                assert acc.step((x, y), _tiny_logits).stepped
        error = float((seen["grad"] - truth).norm() / truth.norm())
        assert error < 5e-2, (precision, error)


def _buffered_window(dtype: torch.dtype, micro_batches: int = 2):
    """A `dtype` MLP with float32 buffers, `micro_batches` of a 4-micro-batch window streamed."""
    model = _mlp().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, accumulation_steps=4, accum_dtype=torch.float32)
    x, y = _batch(6)
    loss_fn = lambda m, b: _mse(m, (b[0].to(dtype), b[1]))  # noqa: E731
    for i in range(micro_batches):
        acc.micro_step((x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]), loss_fn)
    return model, optimizer, acc, (x, y, loss_fn)


def test_a_mid_window_state_with_buffers_is_refused_where_the_parameters_need_none() -> None:
    """A window saved with float32 buffers (bf16 weights) loaded into a float32 model: the buffers
    were loaded and never read (float32 parameters need none), so the window's first micro-batches
    were lost and the step silently differed. It is refused, naming the dtype, changing nothing."""
    _, _, saved, _ = _buffered_window(torch.bfloat16)
    state = saved.state_dict()
    model, _, acc, _ = _buffered_window(torch.float32, micro_batches=0)
    before = (copy.deepcopy(model.state_dict()), acc.state_dict())
    with pytest.raises(ValueError, match=r"needs none: the model's dtype changed.*saved dtype"):
        acc.load_state_dict(state)
    assert_bitwise(before[0], model.state_dict())
    assert_bitwise(before[1], acc.state_dict())
    assert all(p.grad is None for p in model.parameters())


def test_negative_control_the_same_state_resumes_bitwise_in_the_saved_dtype() -> None:
    _, _, saved, _ = _buffered_window(torch.bfloat16)
    model, _, acc, (x, y, loss_fn) = _buffered_window(torch.bfloat16, micro_batches=0)
    acc.load_state_dict(saved.state_dict())
    twin, _, uninterrupted, _ = _buffered_window(torch.bfloat16)
    for accumulator in (acc, uninterrupted):
        for i in (2, 3):
            result = accumulator.micro_step((x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]), loss_fn)
        assert result.stepped
    assert_bitwise(model.state_dict(), twin.state_dict())


def test_an_outer_fp16_autocast_around_a_float64_model_does_not_warn() -> None:
    """Autocast casts nothing in a float64 model: no gradient can flush, nothing to warn of."""
    model = _mlp().double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2)
    x, y = (t.double() for t in _batch(5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.float16):
            assert acc.step((x, y), _mse_float64).stepped


# --------------------------------------------------------------------------------------------
# A model cast after the Accumulator was built
# --------------------------------------------------------------------------------------------


def _mse_in_model_dtype(model: torch.nn.Module, batch) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(batch[0].to(dtype)).float(), batch[1])


_CASTS = [({"precision": "fp16"}, torch.float16), ({"accum_dtype": torch.float16}, torch.bfloat16)]


def _cast_run(settings: dict[str, Any], cast: torch.dtype) -> tuple[Any, ...]:
    """One float32 window, then the model cast to `cast` as a loop would after building."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=4, accumulation_steps=2, **settings)
    assert acc.step(_batch(0, 8), _mse_in_model_dtype).stepped
    model.to(cast)
    return model, optimizer, acc


@pytest.mark.parametrize("drive", ["step", "micro_step"])
@pytest.mark.parametrize(("settings", "cast"), _CASTS, ids=["fp16-half", "fp16-buffers-bf16"])
def test_a_model_cast_after_construction_is_refused_as_at_construction(
    drive: str, settings: dict[str, Any], cast: torch.dtype
) -> None:
    """`model.half()` after `Accumulator(..., precision='fp16')` (or bf16 weights under float16
    buffers) is refused when the next window opens, as the constructor refuses it, changing
    nothing; cast back, the run goes on bitwise as a twin that never tried."""
    model, optimizer, acc = _cast_run(settings, cast)
    batch = _batch(1, 8)
    before = clone_state(
        ([p.detach() for p in model.parameters()], optimizer.state_dict(), acc.state_dict())
    )
    run = acc.step if drive == "step" else acc.micro_step
    first = batch if drive == "step" else (batch[0][:4], batch[1][:4])
    with pytest.raises(ValueError, match=r"\(the model was cast after the Accumulator was built\)"):
        run(first, _mse_in_model_dtype)
    after = ([p.detach() for p in model.parameters()], optimizer.state_dict(), acc.state_dict())
    assert_bitwise(after, before)
    assert all(p.grad is None for p in model.parameters())
    twin, twin_optimizer, twin_acc = _cast_run(settings, cast)
    for run_model, run_acc in ((model, acc), (twin, twin_acc)):
        run_model.float()
        assert run_acc.step(batch, _mse_in_model_dtype).stepped
    assert_bitwise(list(model.parameters()), list(twin.parameters()))
    assert_bitwise(optimizer.state_dict(), twin_optimizer.state_dict())


def test_negative_control_fp16_loss_scaling_on_a_model_cast_to_half_skips_its_windows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check = PrecisionRuntime.check_dtypes
    monkeypatch.setattr(
        PrecisionRuntime,
        "check_dtypes",
        lambda self, params, *, built: None if built else check(self, params, built=built),
    )
    _, _, acc = _cast_run({"precision": "fp16"}, torch.float16)
    x, y = _batch(1, 8)
    results = [acc.step((x * 10, y * 100), _mse_in_model_dtype) for _ in range(3)]
    assert all(result.skipped and not result.stepped for result in results)


def _cast_mid_window(*, accumulator: bool) -> torch.nn.Module:
    """bf16 weights, float32 buffers, `model.float()` after the first of three micro-batches."""
    model = _mlp().bfloat16()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(2, 12)
    parts = [(x[i : i + 4], y[i : i + 4]) for i in (0, 4, 8)]
    if accumulator:
        acc = Accumulator(model, optimizer, accumulation_steps=3, accum_dtype=torch.float32)
        for index, part in enumerate(parts):
            if index == 1:
                model.float()
            result = acc.micro_step(part, _mse_in_model_dtype)
        assert result.stepped
        return model
    for index, part in enumerate(parts):  # the plain loop: torch casts `.grad` with the model
        if index == 1:
            model.float()
        (_mse_in_model_dtype(model, part) * 4 / 12).backward()
    optimizer.step()
    return model


def test_a_model_cast_mid_window_keeps_the_buffered_micro_batches() -> None:
    """The buffer held since the first micro-batch stays the holder after `model.float()`.

    Before, the later micro-batches' float32 `.grad` were kept apart from it and overwritten by
    it at the boundary: the first micro-batch alone was stepped, silently (0.36 off)."""
    reference = _cast_mid_window(accumulator=False)
    model = _cast_mid_window(accumulator=True)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-4)  # bf16: the first part


def test_negative_control_buffers_by_the_present_dtype_drop_the_later_micro_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(PrecisionRuntime, "_keeps", lambda self, index, param: self.buffered(param))
    reference = _cast_mid_window(accumulator=False)
    model = _cast_mid_window(accumulator=True)
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    assert max(float((a - b).detach().abs().max()) for a, b in pairs) > 1e-2


@pytest.fixture
def swapped_conversion() -> Any:
    """`module.to(device)` keeping each Parameter object, as a CPU-to-CUDA move does."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def test_a_model_moved_after_construction_is_refused_naming_the_fix(
    swapped_conversion: Any,
) -> None:
    """Built on one device, moved to another (`model.to('cuda')` after building; 'meta' here):
    refused when the next window opens, before any micro-batch runs, naming the fix. Before,
    micro-batches were moved to the old device and the forward failed with torch's own
    "Tensor on device meta is not on the expected device cpu!" (autocast ran there too)."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=4)
    acc.step(_batch(0, 8), _mse)
    held = clone_state(optimizer.state_dict())
    model.to("meta")
    assert next(model.parameters()) is optimizer.param_groups[0]["params"][0]
    with pytest.raises(ValueError, match=r"moved to meta after the Accumulator was built \(on cpu"):
        acc.step(_batch(1, 8), _mse)
    assert_bitwise(optimizer.state_dict(), held)
    assert all(p.grad is None for p in model.parameters())
    assert not acc._engine.window.is_open


def test_negative_control_a_moved_model_failed_inside_its_forward(
    swapped_conversion: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4)
    model.to("meta")
    monkeypatch.setattr(acc._engine.runtime, "_anchor", torch.zeros(1))  # never moved
    with pytest.raises(RuntimeError, match=r"not on the expected device") as raised:
        acc.step(_batch(1, 8), _mse)
    assert "Accumulator after model.to" not in str(raised.value)


def _fp16_run() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Accumulator]:
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    acc = Accumulator(model, optimizer, accumulation_steps=2, precision="fp16", scheduler=scheduler)
    return model, optimizer, scheduler, acc


@pytest.mark.parametrize("call", ["unscale_", "step", "update"])
def test_a_plain_loops_gradscaler_calls_on_acc_scaler_are_refused_changing_nothing(
    call: str,
) -> None:
    """`acc.scaler.unscale_(optimizer)` before a clip (and `step`, `update`), a plain fp16 loop's
    lines, raised torch's bare `AssertionError: Attempted unscale_ but _scale is None`. They
    are refused naming `max_grad_norm=` and the step pre-hook, nothing changed (the open window
    included): the run goes on bitwise as one without the call."""
    model, optimizer, scheduler, acc = _fp16_run()
    twin, twin_opt, twin_sched, twin_acc = _fp16_run()
    for seed in range(3):  # a full window, then one left open
        acc.micro_step(_batch(seed, 4), _mse)
        twin_acc.micro_step(_batch(seed, 4), _mse)
    before = _snapshot(model, optimizer, scheduler)
    scale = acc.scaler.get_scale()
    with pytest.raises(ValueError, match=r"max_grad_norm=.*step pre-hook"):
        {
            "unscale_": lambda: acc.scaler.unscale_(optimizer),
            "step": lambda: acc.scaler.step(optimizer),
            "update": lambda: acc.scaler.update(),
        }[call]()
    assert_bitwise(_snapshot(model, optimizer, scheduler), before)
    assert acc.scaler.get_scale() == scale
    assert acc.micro_step(_batch(3, 4), _mse).stepped
    assert twin_acc.micro_step(_batch(3, 4), _mse).stepped
    assert_bitwise(_snapshot(model, optimizer, scheduler), _snapshot(twin, twin_opt, twin_sched))
    assert isinstance(acc.scaler, torch.amp.GradScaler)


def test_negative_control_a_plain_gradscaler_fails_with_torchs_bare_assertion() -> None:
    model = _mlp()
    with pytest.raises(AssertionError, match="_scale is None"):
        torch.amp.GradScaler("cpu").unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
