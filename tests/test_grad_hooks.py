"""Gradient hooks on parameters under accumulation (`gradaccum._grad_hooks`).

A `register_hook` runs once per micro-batch on its share, a `register_post_accumulate_grad_hook`
on the window's running sum. Linear hooks (a fixed scaling, a fixed mask, logging, zeroing fixed
rows after accumulation) give the full-batch step with the hook applied once (float64, 1e-10)
and stay quiet; a clamp, a per-parameter norm clip, or an in-place change of the running sum
(which compounds) is not that step, and warns once naming the hook's line and the optimizer
step pre-hook. The control for each warning is the step's gap from that full-batch step.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradaccum import Accumulator, accumulate_grad, check_equivalence

_GEN = torch.Generator().manual_seed(3)
_X = 3 * torch.randn(24, 6, generator=_GEN, dtype=torch.float64)
_Y = torch.randint(0, 3, (24,), generator=_GEN)
_MASK = (torch.rand(8, 6, generator=_GEN) > 0.5).double()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _clip_norm(grad: torch.Tensor) -> torch.Tensor:
    return grad * min(1.0, 0.05 / float(grad.norm()))


def _scale_in_place(param: torch.Tensor) -> None:
    assert param.grad is not None
    param.grad.mul_(0.5)


def _clamp_in_place(param: torch.Tensor) -> None:
    assert param.grad is not None
    param.grad.clamp_(-0.02, 0.02)


def _zero_rows(param: torch.Tensor) -> None:
    if param.grad is not None and param.dim() == 2:
        param.grad[:3] = 0


def _log_norm(param: torch.Tensor) -> None:
    assert param.grad is not None
    float(param.grad.norm())


def _masked(grad: torch.Tensor) -> torch.Tensor:
    return grad * _MASK if grad.shape == _MASK.shape else grad


def _rows_zeroed(grad: torch.Tensor) -> torch.Tensor:
    return torch.cat([0 * grad[:3], grad[3:]]) if grad.dim() == 2 else grad


# Each case: the hook, whether it runs after accumulation, and what it does to a full batch's
# gradient (the reference applies it once).
_Case = tuple[Callable[..., Any], bool, Callable[[torch.Tensor], torch.Tensor]]
_WARNED: dict[str, _Case] = {
    "clamp": (lambda g: g.clamp(-0.02, 0.02), False, lambda g: g.clamp(-0.02, 0.02)),
    "norm_clip_per_parameter": (_clip_norm, False, _clip_norm),
    "post_scale_in_place": (_scale_in_place, True, lambda g: 0.5 * g),
    "post_clamp_in_place": (_clamp_in_place, True, lambda g: g.clamp(-0.02, 0.02)),
}
_QUIET: dict[str, _Case] = {
    "fixed_scale": (lambda g: 0.3 * g, False, lambda g: 0.3 * g),
    "fixed_mask": (_masked, False, _masked),
    "logging": (lambda g: None, False, lambda g: g),
    "post_zero_rows": (_zero_rows, True, _rows_zeroed),
    "post_logging": (_log_norm, True, lambda g: g),
}  # fmt: skip


def _full_batch(apply: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    model = _model()
    _loss(model, (_X, _Y)).backward()
    for param in model.parameters():
        assert param.grad is not None
        param.grad = apply(param.grad)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return model


def _accumulated(case: _Case, drive: str) -> tuple[nn.Module, list[str]]:
    hook, post, _ = case
    model = _model()
    for param in model.parameters():
        if post:
            param.register_post_accumulate_grad_hook(hook)
        else:
            param.register_hook(hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if drive == "step":
            assert Accumulator(model, optimizer, micro_batch_size=6).step((_X, _Y), _loss).stepped
        else:
            acc = Accumulator(model, optimizer, accumulation_steps=4)
            for i in range(4):
                acc.micro_step((_X[6 * i : 6 * i + 6], _Y[6 * i : 6 * i + 6]), _loss)
    return model, [str(w.message) for w in caught]


def _gap(got: nn.Module, want: nn.Module) -> float:
    return max(
        float((p - q).detach().abs().max() / q.detach().abs().max())
        for p, q in zip(got.parameters(), want.parameters(), strict=True)
    )


@pytest.mark.parametrize("drive", ["step", "micro_step"])
@pytest.mark.parametrize("name", sorted(_WARNED))
def test_a_gradient_hook_not_linear_per_micro_batch_warns_once(name: str, drive: str) -> None:
    case = _WARNED[name]
    model, told = _accumulated(case, drive)
    assert len(told) == 1, told
    assert "register_step_pre_hook" in told[0]
    assert f"{__file__}:" in told[0]  # the hook's own line
    assert ("post-accumulate-grad hook" in told[0]) == case[1]
    assert _gap(model, _full_batch(case[2])) > 1e-3  # control: not the full-batch step


@pytest.mark.parametrize("drive", ["step", "micro_step"])
@pytest.mark.parametrize("name", sorted(_QUIET))
def test_linear_gradient_hooks_are_exact_and_quiet(name: str, drive: str) -> None:
    case = _QUIET[name]
    model, told = _accumulated(case, drive)
    assert told == []
    assert _gap(model, _full_batch(case[2])) < 1e-10


def test_accumulate_grad_warns_of_a_clamping_hook_too() -> None:
    model = _model()
    for param in model.parameters():
        param.register_hook(lambda g: g.clamp(-0.02, 0.02))
    with pytest.warns(UserWarning, match="not a fixed scaling"):
        accumulate_grad(model, (_X, _Y), _loss, micro_batch_size=6)


def test_a_hook_scaling_by_another_factor_in_each_window_is_quiet() -> None:
    """The factor may change between windows (a schedule): only one window's calls compare."""
    model, factor = _model(), [1.0]
    for param in model.parameters():
        param.register_hook(lambda g: factor[0] * g)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            factor[0] = 0.5**step
            acc.step((_X, _Y), _loss)
    assert caught == []
    assert all(not p._backward_hooks or len(p._backward_hooks) == 1 for p in model.parameters())


def test_a_hook_in_one_micro_batch_window_is_quiet() -> None:
    """One micro-batch is the full batch: the hook runs once on its gradient, exact."""
    case = _WARNED["clamp"]
    model = _model()
    for param in model.parameters():
        param.register_hook(case[0])
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=24)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.step((_X, _Y), _loss)
    assert caught == []
    assert _gap(model, _full_batch(case[2])) < 1e-10


def test_the_watch_leaves_the_users_hooks_in_their_order() -> None:
    model, calls = _model(), []
    weight = model[0].weight
    weight.register_hook(lambda g: calls.append("a"))
    weight.register_hook(lambda g: calls.append("b"))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=12)
    acc.step((_X, _Y), _loss)
    assert calls == ["a", "b", "a", "b"]
    assert len(weight._backward_hooks) == 2


def test_check_equivalence_names_the_hooks_its_copies_run_without() -> None:
    """Deep copies of parameters drop their hooks, so the check compares gradients before any
    hook and reported a clamping hook's model as plainly exact; it names the hooks now."""
    model = _model()
    assert check_equivalence(model, (_X, _Y), _loss, 6).non_additive == ()
    model[0].weight.register_hook(lambda g: g.clamp(-0.02, 0.02))
    report = check_equivalence(model, (_X, _Y), _loss, 6)
    assert [(m.name, m.kind) for m in report.non_additive] == [("0.weight", "gradient hook")]
    assert f"{__file__}:" in report.non_additive[0].reason
    assert "register_step_pre_hook" in report.explain()


def test_a_post_accumulate_scaling_of_each_share_moved_to_buffers_is_quiet() -> None:
    """bf16 weights with float32 buffers: `.grad` holds one micro-batch's share at each hook
    (moved to its buffer after every backward), so a fixed scaling adds up: no warning, and the
    step is the reference's with the scaling applied once (to bf16 rounding)."""
    model = _model().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(_scale_in_place)
    acc = Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        micro_batch_size=6,
        accum_dtype=torch.float32,
    )
    batch = (_X.to(torch.bfloat16), _Y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.step(batch, _loss)
    assert caught == []
    _loss(reference, batch).backward()
    for param in reference.parameters():
        assert param.grad is not None
        param.grad.mul_(0.5)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert _gap(model, reference) < 5e-2


def _late_hook_run(case: _Case, drive: str) -> tuple[nn.Module, nn.Module, list[str]]:
    """Five windows of four micro-batches (20, beyond the watch's first 16) without hooks, then
    the hook registered (a callback's, at a later epoch) and one more window; the reference takes
    the same plain full-batch steps with the hook applied once in the last."""
    hook, post, apply = case
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    plain = torch.optim.SGD(reference.parameters(), lr=0.5)
    acc = Accumulator(model, optimizer, micro_batch_size=6, accumulation_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for window in range(6):
            if window == 5:
                for param in model.parameters():
                    if post:
                        param.register_post_accumulate_grad_hook(hook)
                    else:
                        param.register_hook(hook)
            if drive == "step":
                assert acc.step((_X, _Y), _loss).stepped
            else:
                for i in range(4):
                    acc.micro_step((_X[6 * i : 6 * i + 6], _Y[6 * i : 6 * i + 6]), _loss)
            plain.zero_grad(set_to_none=True)
            _loss(reference, (_X, _Y)).backward()
            for param in reference.parameters():
                assert param.grad is not None
                param.grad = apply(param.grad) if window == 5 else param.grad
            plain.step()
    return model, reference, [str(w.message) for w in caught]


@pytest.mark.parametrize("drive", ["step", "micro_step"])
@pytest.mark.parametrize("name", ["clamp", "post_scale_in_place"])
def test_a_hook_registered_after_the_first_16_micro_batches_is_watched_too(
    name: str, drive: str
) -> None:
    """The watch bracketed an Accumulator's first 16 micro-batches only: a clamping hook added
    after them (a callback at epoch 2) was silent, 2e-2 off the step. Each window's start now
    looks for hooks registered since and brackets them as the first ones were."""
    model, reference, told = _late_hook_run(_WARNED[name], drive)
    assert len(told) == 1, told
    assert "register_step_pre_hook" in told[0]
    assert f"{__file__}:" in told[0]
    assert _gap(model, reference) > 1e-3  # control: the late hook's step is not the reference's


@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_a_linear_hook_registered_late_stays_exact_and_quiet(drive: str) -> None:
    model, reference, told = _late_hook_run(_QUIET["fixed_scale"], drive)
    assert told == []
    assert _gap(model, reference) < 1e-10
