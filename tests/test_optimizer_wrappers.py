"""Lookahead wrappers (timm's, torch-optimizer's), which never run `Optimizer.__init__`.

They share the param groups of the optimizer they wrap and add to its step. Before, both were
refused as "a wrapper ... as accelerate's Accelerator.prepare returns", with the advice to pass
the optimizer they wrap, which silently drops Lookahead; and planning (`micro_batch_size="auto"`)
deep-copied the wrapper, which made torch wrap its class's `step` in the hook runner for good, so
every later step raised `AttributeError: ... '_optimizer_step_pre_hooks'`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import nn

from gradaccum import Accumulator

LR = 0.1


class TimmLookahead(torch.optim.Optimizer):
    """timm.optim.Lookahead in substance: the slow weights kept in the base optimizer's state."""

    def __init__(self, base_optimizer: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2):
        defaults = {"lookahead_alpha": alpha, "lookahead_k": k, "lookahead_step": 0}
        self._base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(defaults)
        self.state: Any = defaultdict(dict)
        for name, default in defaults.items():
            for group in self._base_optimizer.param_groups:
                group.setdefault(name, default)

    @torch.no_grad()
    def update_slow(self, group: dict[str, Any]) -> None:
        for fast in group["params"]:
            if fast.grad is None:
                continue
            state = self._base_optimizer.state[fast]
            if "lookahead_slow_buff" not in state:
                state["lookahead_slow_buff"] = fast.detach().clone()
            slow = state["lookahead_slow_buff"]
            slow.add_(fast - slow, alpha=group["lookahead_alpha"])
            fast.copy_(slow)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups


class PlainLookahead(torch.optim.Optimizer):
    """torch-optimizer's Lookahead in substance: `.optimizer`, slow weights in its own state."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5):
        self.optimizer, self.k, self.alpha = optimizer, k, alpha
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state: Any = defaultdict(dict)
        for group in self.param_groups:
            group["counter"] = 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self.optimizer.step(closure)
        for group in self.param_groups:
            if group["counter"] == 0:
                for fast in group["params"]:
                    slow = self.state[fast].setdefault("slow_param", fast.detach().clone())
                    fast.data.mul_(self.alpha).add_(slow, alpha=1.0 - self.alpha)
                    slow.copy_(fast)
            group["counter"] = (group["counter"] + 1) % self.k
        return loss


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(10, 4, generator=generator, dtype=torch.float64)
    return x, torch.randn(10, 1, generator=generator, dtype=torch.float64)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((model(batch[0]) - batch[1]) ** 2).mean()


def _reference(kind: type[torch.optim.Optimizer], windows: int) -> nn.Module:
    model = _model()
    optimizer = kind(torch.optim.AdamW(model.parameters(), lr=LR))  # type: ignore[call-arg]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
    for seed in range(windows):
        model.zero_grad()  # the wrapper's own zero_grad() makes torch wrap its class's step
        _loss(model, _batch(seed)).backward()
        optimizer.step()
        schedule.step()
    return model


def _assert_same(model: nn.Module, reference: nn.Module) -> None:
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=0)


@pytest.mark.parametrize("kind", [TimmLookahead, PlainLookahead])
@pytest.mark.parametrize("size", [3, "auto"])
def test_a_lookahead_wrapper_steps_as_the_full_batch_lookahead(
    kind: type[torch.optim.Optimizer], size: int | str
) -> None:
    """4 windows (2 slow-weight updates), a schedule built on the wrapper; "auto" plans first."""
    step_before = vars(kind)["step"]
    model = _model()
    optimizer = kind(torch.optim.AdamW(model.parameters(), lr=LR))  # type: ignore[call-arg]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
    budget = "1GiB" if size == "auto" else None
    acc = Accumulator(
        model, optimizer, micro_batch_size=size, scheduler=schedule, memory_budget=budget
    )
    for seed in range(4):
        assert acc.step(_batch(seed), _loss).stepped
    assert vars(kind)["step"] is step_before  # planning's copy left the class as it was
    _assert_same(model, _reference(kind, 4))


def test_a_lookahead_step_inside_a_window_is_refused_changing_nothing() -> None:
    model = _model()
    optimizer = PlainLookahead(torch.optim.AdamW(model.parameters(), lr=LR))
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    x, y = _batch(0)
    acc.micro_step((x[:5], y[:5]), _loss)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"PlainLookahead\.step\(\) was called inside"):
        optimizer.step()  # a copied loop's own line
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not optimizer.optimizer.state
    assert not optimizer.state
    assert acc.micro_step((x[5:], y[5:]), _loss).stepped  # the window completes: full batch
    reference = _model()
    plain = PlainLookahead(torch.optim.AdamW(reference.parameters(), lr=LR))
    _loss(reference, (x, y)).backward()
    plain.step()  # its first: no slow-weight pull yet
    _assert_same(model, reference)


def test_an_accelerate_wrapper_is_still_refused_and_an_unknown_one_names_the_fix() -> None:
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    kind = type("AcceleratedOptimizer", (PlainLookahead,), {"__module__": "accelerate.optimizer"})
    accelerated = kind(inner)  # as accelerate's: .optimizer, its param groups, no __init__ run
    with pytest.raises(TypeError, match=r"pass the AdamW it wraps \(optimizer\.optimizer"):
        Accumulator(model, accelerated, micro_batch_size=3)
    alone = PlainLookahead(inner)
    alone.optimizer = torch.optim.AdamW(_model().parameters(), lr=LR)  # shares no param groups
    with pytest.raises(TypeError, match=r"Call torch\.optim\.Optimizer\.__init__"):
        Accumulator(model, alone, micro_batch_size=3)


class SAM(torch.optim.Optimizer):
    """davda54/sam in substance: a two-pass optimizer around a base optimizer."""

    def __init__(
        self, params: Any, base: type[torch.optim.Optimizer], rho: float = 0.05, **kw: Any
    ) -> None:
        super().__init__(params, {"rho": rho, **kw})
        self.base_optimizer = base(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad.norm() for p in params]
        norm = torch.stack(grads).norm()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.detach().clone()
                    p.add_(p.grad * (group["rho"] / (norm + 1e-12)))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(self.state[p]["old_p"])
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is None:
            raise AssertionError("Sharpness Aware Minimization requires closure")
        self.first_step(zero_grad=True)
        with torch.enable_grad():
            closure()
        self.second_step()


def test_a_two_pass_optimizer_is_refused_at_construction_naming_accumulate_grad() -> None:
    """Before, it was accepted and every window ran whole, then its step() raised an
    AssertionError ("requires closure") at the boundary."""
    model = _model()
    optimizer = SAM(model.parameters(), torch.optim.SGD, lr=LR, momentum=0.9)
    with pytest.raises(ValueError, match=r"SAM is a two-pass optimizer.*accumulate_grad"):
        Accumulator(model, optimizer, micro_batch_size=3)


def test_sam_with_accumulate_grad_is_the_full_batch_sam() -> None:
    """The README's recipe: both passes' gradients from accumulate_grad, float64 rtol 1e-10."""
    from gradaccum import accumulate_grad

    model, reference = _model(), _model()
    optimizer = SAM(model.parameters(), torch.optim.SGD, lr=LR, momentum=0.9)
    plain = SAM(reference.parameters(), torch.optim.SGD, lr=LR, momentum=0.9)
    for seed in range(3):
        batch = _batch(seed)
        accumulate_grad(model, batch, _loss, micro_batch_size=3)
        optimizer.first_step(zero_grad=True)
        accumulate_grad(model, batch, _loss, micro_batch_size=3)
        optimizer.second_step(zero_grad=True)
        _loss(reference, batch).backward()
        plain.first_step(zero_grad=True)
        _loss(reference, batch).backward()
        plain.second_step(zero_grad=True)
    _assert_same(model, reference)
