"""DDP on 2 gloo ranks: a window whose scheduler or `optimizer.step()` raises on ONE rank.

The exchange and the reduction give every rank the same gradients, but the commit can still
raise on one rank alone (out of memory while Adam's state is first allocated, a custom
optimizer's or scheduler's rank-dependent check). Before, the other ranks stepped and returned
normally: a loop that catches the error and goes on trained replicas that silently differed.

- a scheduler raising on one rank is tried before the exchange, so every rank raises and
  nothing changed on any rank (bitwise); the next window is the full-batch step;
- `optimizer.step()` raising on one rank, after the others stepped: every rank raises (they a
  `RankMismatchError`) and refuses further windows until a state is loaded;
- `optimizer.step()` raising on every rank alike changes nothing and breaks nothing;
- a scheduler the window cannot try (a class of one's own) raising after the step on one rank:
  every rank raises and refuses further windows until a checkpoint is loaded on every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator, LossSum, load_checkpoint, save_checkpoint
from tests.distributed._harness import describe, spawn_ranks

EXACT = dict(rtol=1e-10, atol=1e-12)
ITEMS = 6


def make_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()


def rank_batch(window: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * window + rank)
    x = torch.randn(ITEMS, 3, generator=generator, dtype=torch.float64)
    return x, torch.randn(ITEMS, 1, generator=generator, dtype=torch.float64)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    x, y = batch
    return LossSum((model(x) - y).pow(2).sum(), count=len(x))


class FlakySGD(torch.optim.SGD):
    """SGD whose next step raises (before changing anything) while `fail` is set."""

    fail = False

    def step(self, closure: Any = None) -> Any:
        if self.fail:
            raise RuntimeError("injected optimizer failure")
        return super().step(closure)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Any:
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        copy.deepcopy(optimizer.state_dict()),
        None if scheduler is None else copy.deepcopy(scheduler.state_dict()),
    )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _attempt(fn: Any) -> str | None:
    try:
        fn()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _scheduler_case(rank: int) -> dict[str, Any]:
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    failing = {"armed": False}

    def factor(epoch: int) -> float:
        if failing["armed"]:
            failing["armed"] = False  # raise once, then behave
            raise ValueError("injected scheduler failure")
        return 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    acc = Accumulator(model, optimizer, micro_batch_size=4, scheduler=scheduler)
    acc.step(rank_batch(0, rank), loss_fn)
    before = _state(model, optimizer, scheduler)
    failing["armed"] = rank == 1
    raised = _attempt(lambda: acc.step(rank_batch(1, rank), loss_fn))
    unchanged = _equal(before, _state(model, optimizer, scheduler))
    acc.step(rank_batch(1, rank), loss_fn)  # the same window again, now on every rank
    params = [p.detach().clone() for p in model.parameters()]
    return {"raised": raised, "unchanged": unchanged, "params": params}


def _optimizer_case(rank: int, failing_ranks: tuple[int, ...]) -> dict[str, Any]:
    model = DistributedDataParallel(make_model())
    optimizer = FlakySGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=4)
    acc.step(rank_batch(0, rank), loss_fn)
    before = _state(model, optimizer, None)
    optimizer.fail = rank in failing_ranks
    raised = _attempt(lambda: acc.step(rank_batch(1, rank), loss_fn))
    unchanged = _equal(before, _state(model, optimizer, None))
    optimizer.fail = False
    again = _attempt(lambda: acc.step(rank_batch(1, rank), loss_fn))
    return {"raised": raised, "unchanged": unchanged, "again": again}


def _before_step_case(rank: int) -> dict[str, Any]:
    """Clipping raises on rank 1 alone, after the exchange and before its optimizer.step()."""
    import gradaccum._engine as engine

    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=4, max_grad_norm=1e9)
    acc.step(rank_batch(0, rank), loss_fn)
    before = _state(model, optimizer, None)
    clip = engine.clip_

    def failing_clip(*args: Any) -> None:
        raise RuntimeError("injected clipping failure")

    if rank == 1:
        engine.clip_ = failing_clip  # fault injection on one rank: out of memory, say
    try:
        raised = _attempt(lambda: acc.step(rank_batch(1, rank), loss_fn))
    finally:
        engine.clip_ = clip
    unchanged = _equal(before, _state(model, optimizer, None))
    again = _attempt(lambda: acc.step(rank_batch(1, rank), loss_fn))
    return {"raised": raised, "unchanged": unchanged, "again": again}


class WarmupLR(torch.optim.lr_scheduler.LambdaLR):
    """A lab's own scheduler class (not torch's, so not tried before the step): while `fail`
    is set, its step raises, after the optimizer's step, as a rank-dependent check would."""

    fail = False

    def step(self, epoch: Any = None) -> None:
        if self.fail:
            raise RuntimeError("injected scheduler failure after the step")
        super().step(epoch)


def _untried_scheduler_case(rank: int, failing_ranks: tuple[int, ...], folder: str) -> Any:
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = WarmupLR(optimizer, lambda epoch: 0.5**epoch)
    acc = Accumulator(model, optimizer, micro_batch_size=4, scheduler=scheduler)
    acc.step(rank_batch(0, rank), loss_fn)
    path = f"{folder}/untried-{len(failing_ranks)}.pt"
    if rank == 0:  # at a window boundary: rank 0's file serves every rank
        save_checkpoint(
            path, model=model, optimizer=optimizer, accumulator=acc, scheduler=scheduler
        )
    dist.barrier()
    scheduler.fail = rank in failing_ranks
    raised = _attempt(lambda: acc.step(rank_batch(1, rank), loss_fn))
    scheduler.fail = False
    lr = optimizer.param_groups[0]["lr"]
    again = _attempt(lambda: acc.step(rank_batch(2, rank), loss_fn))
    load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc, scheduler=scheduler)
    acc.step(rank_batch(1, rank), loss_fn)  # the window again, on every rank
    params = [p.detach().clone() for p in model.parameters()]
    return {"raised": raised, "lr": lr, "again": again, "params": params}


def worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    return {
        "untried_one": _untried_scheduler_case(rank, (1,), folder),
        "untried_all": _untried_scheduler_case(rank, (0, 1), folder),
        "scheduler": _scheduler_case(rank),
        "optimizer_one": _optimizer_case(rank, failing_ranks=(1,)),
        "optimizer_all": _optimizer_case(rank, failing_ranks=(0, 1)),
        "before_step": _before_step_case(rank),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("commit")
    outcomes = spawn_ranks(worker, folder, str(folder), timeout=120.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    return [o.result for o in outcomes]


def reference(windows: tuple[int, ...] = (0, 1), decay: float = 1.0) -> list[torch.Tensor]:
    """Plain PyTorch: one full-batch step over both ranks' items per window (lr * decay**k)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: decay**epoch)
    for window in windows:
        batches = [rank_batch(window, rank) for rank in (0, 1)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        optimizer.zero_grad(set_to_none=True)
        ((model(x) - y).pow(2).sum() / len(x)).backward()
        optimizer.step()
        scheduler.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.timeout(180)
def test_a_scheduler_raising_on_one_rank_makes_every_rank_raise_and_change_nothing(
    runs: list[dict[str, Any]],
) -> None:
    failing, other = runs[1]["scheduler"], runs[0]["scheduler"]
    assert failing["raised"].startswith("ValueError: injected scheduler failure")
    assert other["raised"] is not None  # before: rank 0 stepped alone and returned normally
    assert other["raised"].startswith("RankMismatchError: rank 1 raised inside")
    expected = reference()
    for run in runs:
        assert run["scheduler"]["unchanged"]
        for got, want in zip(run["scheduler"]["params"], expected, strict=True):
            torch.testing.assert_close(got, want, **EXACT)
    # NEGATIVE CONTROL: rank 0 stepping the failed window alone (what happened before) ends
    # elsewhere than the reference: the replicas would differ.
    alone = reference(windows=(0, 1, 1))
    gap = max(float((p - q).abs().max()) for p, q in zip(alone, expected, strict=True))
    assert gap > 1e-3


@pytest.mark.timeout(180)
def test_an_optimizer_raising_on_one_rank_makes_every_rank_raise_and_refuse_windows(
    runs: list[dict[str, Any]],
) -> None:
    failing, other = runs[1]["optimizer_one"], runs[0]["optimizer_one"]
    assert failing["raised"].startswith("RuntimeError: injected optimizer failure")
    assert failing["unchanged"]  # it raised before changing anything; rank 0 has stepped
    assert other["raised"] is not None  # before: rank 0 returned normally, the replicas apart
    assert other["raised"].startswith("RankMismatchError: optimizer.step() raised on 1 of 2")
    assert "reload your last checkpoint on every rank" in other["raised"]
    for run in runs:  # the replicas differ: no rank trains on until a state is loaded
        assert run["optimizer_one"]["again"].startswith("PartialStepError: no window was run")


@pytest.mark.timeout(180)
def test_an_optimizer_raising_on_every_rank_alike_changes_nothing_and_breaks_nothing(
    runs: list[dict[str, Any]],
) -> None:
    for run in runs:
        case = run["optimizer_all"]
        assert case["raised"] == "RuntimeError: injected optimizer failure"
        assert case["unchanged"]
        assert case["again"] is None


@pytest.mark.timeout(180)
def test_a_rank_failing_between_the_exchange_and_its_step_makes_every_rank_raise(
    runs: list[dict[str, Any]],
) -> None:
    """Rank 1 fails clipping; rank 0 steps, then learns it at the step agreement, not never."""
    failing, other = runs[1]["before_step"], runs[0]["before_step"]
    assert failing["raised"].startswith("RuntimeError: injected clipping failure")
    assert failing["unchanged"]  # nothing changed on the rank that failed
    assert other["raised"] is not None  # before: rank 0 stepped alone and returned normally
    assert other["raised"].startswith("RankMismatchError: optimizer.step() raised on 1 of 2")
    assert not other["unchanged"]  # rank 0 did step: the replicas differ, so both refuse
    for run in runs:
        assert run["before_step"]["again"].startswith("PartialStepError: no window was run")


@pytest.mark.timeout(180)
def test_an_untried_scheduler_raising_after_the_step_on_one_rank_makes_every_rank_raise(
    runs: list[dict[str, Any]],
) -> None:
    """A scheduler class of one's own is not tried before the step: raising after it on rank 1
    alone, rank 0 returned normally at another learning rate (0.05 against 0.1), silently."""
    failing, other = runs[1]["untried_one"], runs[0]["untried_one"]
    assert failing["raised"].startswith("RuntimeError: injected scheduler failure after the step")
    assert other["raised"] is not None  # before: None, rank 0 trained on at lr 0.05
    assert other["raised"].startswith("RankMismatchError: the scheduler's step raised on 1 of 2")
    assert "reload your last checkpoint on every rank" in other["raised"]
    assert other["lr"] != failing["lr"]  # the schedules differ: no rank may train on
    for run in runs:
        assert run["untried_one"]["again"].startswith("PartialStepError: no window was run")
    # Loaded on every rank, the run goes on exactly: the full-batch steps of windows 0 and 1.
    expected = reference(decay=0.5)
    for run in runs:
        for got, want in zip(run["untried_one"]["params"], expected, strict=True):
            torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.timeout(180)
def test_an_untried_scheduler_raising_on_every_rank_alike_breaks_nothing(
    runs: list[dict[str, Any]],
) -> None:
    """Every rank stepped and every schedule failed alike: each raises its own error, as on
    one process, and the next window runs."""
    for run in runs:
        case = run["untried_all"]
        assert case["raised"] == "RuntimeError: injected scheduler failure after the step"
        assert case["again"] is None
