"""`micro_batch_size="auto"`/"largest" under DDP: ranks shrink, and choose, alike.

Two real gloo ranks. Rank 1's model fails like an allocator for micro-batches above 10 items;
rank 0's never fails. Both must shrink together (a rank that shrank alone would run a different
number of micro-batches and raise `RankMismatchError`, or hang in a reduction the other never
joins), end on the same size, with parameters equal across ranks and bitwise equal to a DDP run
that used that size from the start. The negative control is that reference at another size.

With "auto" the ranks time sizes on real windows; each rank's fake clock (advanced by its model's
forward) says a different size is fastest, and both ranks must still choose the same one: the
fastest for the slowest rank, so the windows stay in step and the parameters equal.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from tests.distributed._harness import describe, spawn_ranks

PER_RANK = 32
WINDOWS = 3


class OomAbove(nn.Module):
    """`inner`, failing with `torch.OutOfMemoryError` above `threshold` items per micro-batch."""

    def __init__(self, inner: nn.Module, threshold: float) -> None:
        super().__init__()
        self.inner = inner
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)  # fail after the forward: dropout has drawn, the graph exists
        if x.shape[0] > self.threshold:
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} > {self.threshold}")
        return out


def _model() -> DistributedDataParallel:
    torch.manual_seed(3)
    inner = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Dropout(0.1), nn.Linear(12, 4))
    return DistributedDataParallel(OomAbove(inner.double(), math.inf))


def _batch(window: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * window + rank)
    x = torch.randn(PER_RANK, 5, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 4, (PER_RANK,), generator=generator)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _train(rank: int, size: int | str, threshold: float) -> tuple[dict[str, torch.Tensor], list]:
    torch.manual_seed(10 + rank)  # per-rank dropout streams, the same in both runs
    ddp = _model()
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    budget = "256MiB" if size == "largest" else None
    acc = Accumulator(ddp, optimizer, micro_batch_size=size, memory_budget=budget)
    if size == "largest":  # plan while memory is plentiful, then make it scarce on one rank
        acc._auto.ensure_plan(
            ddp, _batch(0, rank), _loss, optimizer, precision=acc.precision, accum_dtype=None
        )
    ddp.module.threshold = threshold
    sizes = [acc.step(_batch(w, rank), _loss).micro_batch_size for w in range(WINDOWS)]
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return params, sizes


def oom_worker(rank: int, world_size: int) -> dict[str, Any]:
    threshold = 10 if rank == 1 else math.inf
    auto_params, auto_sizes = _train(rank, "largest", threshold)
    fixed_params, _ = _train(rank, auto_sizes[-1], math.inf)
    other_params, _ = _train(rank, 8, math.inf)
    return {
        "sizes": auto_sizes,
        "auto": auto_params,
        "bitwise_vs_fixed": all(torch.equal(auto_params[n], fixed_params[n]) for n in auto_params),
        "gap_vs_other_size": max(
            (auto_params[n] - other_params[n]).abs().max().item() for n in auto_params
        ),
    }


@pytest.mark.timeout(120)
def test_oom_on_one_rank_shrinks_every_rank_alike(tmp_path: Path) -> None:
    outcomes = spawn_ranks(oom_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    zero, one = (o.result for o in outcomes)
    # Planned 32 on both; rank 1 fails 32, 24, 18, 13; both settle on 9 together.
    assert zero["sizes"] == one["sizes"] == [9] * WINDOWS
    for name, value in zero["auto"].items():
        assert torch.equal(value, one["auto"][name]), name
    assert zero["bitwise_vs_fixed"]
    assert one["bitwise_vs_fixed"]
    # NEGATIVE CONTROL: another size rounds differently; the comparison can fail.
    assert zero["gap_vs_other_size"] > 0


class Clocked(nn.Module):
    """`inner`, advancing a fake clock by what this rank's micro-batch of that size costs."""

    def __init__(self, inner: nn.Module, cost: dict[int, float]) -> None:
        super().__init__()
        self.inner, self.cost, self.now = inner, cost, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.now += self.cost.get(x.shape[0], 1.0) * x.shape[0]
        return self.inner(x)


# Seconds per item by micro-batch size: alone, rank 0 would pick 16 and rank 1 would pick 8.
COSTS = [{32: 1.0, 16: 0.6, 8: 0.8, 4: 1.0}, {32: 1.0, 16: 0.9, 8: 0.7, 4: 1.0}]


def tuning_worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(3)
    inner = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 4)).double()
    model = Clocked(inner, COSTS[rank])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    acc = Accumulator(ddp, optimizer, micro_batch_size="auto", memory_budget="256MiB")
    acc._auto.clock = lambda: model.now
    results = [acc.step(_batch(w, rank), _loss) for w in range(11)]
    return {
        "sizes": [r.micro_batch_size for r in results],
        "sizing": results[-1].sizing,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


@pytest.mark.timeout(120)
def test_auto_ranks_time_alike_and_choose_the_same_size(tmp_path: Path) -> None:
    outcomes = spawn_ranks(tuning_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    zero, one = (o.result for o in outcomes)
    # Slowest-rank seconds per item: 32: 1.0, 16: 0.9, 8: 0.8, 4: 1.0, so 8 (1.25x 32).
    assert zero["sizes"] == one["sizes"] == [32] + [32, 16, 8, 4] * 2 + [8, 8]
    assert zero["sizing"] == one["sizing"]
    assert "fastest: 8" in zero["sizing"]
    for name, value in zero["params"].items():
        assert torch.equal(value, one["params"][name]), name


# Ranks holding different batch sizes (the last batch of a DistributedSampler, a token budget):
# rank 0 has 12 items per window, rank 1 has 5; in window 2 rank 0's batch also carries a wide
# extra tensor (longer sequences: more work per item), which restarts the "auto" timing.
UNEVEN_ITEMS = (12, 5)
UNEVEN_WINDOWS = 9


def _uneven_batch(window: int, rank: int) -> tuple[torch.Tensor, ...]:
    x, y = _batch(window, rank)
    items = UNEVEN_ITEMS[rank]
    if window >= 2 and rank == 0:
        return x[:items], y[:items], torch.zeros(items, 64)
    return x[:items], y[:items]


def _sum_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> Any:
    from gradaccum import LossSum

    return LossSum(F.cross_entropy(model(batch[0]), batch[1], reduction="sum"), len(batch[1]))


def uneven_auto_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("auto", "largest"):
        torch.manual_seed(3)
        inner = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 4)).double()
        ddp = DistributedDataParallel(inner)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        acc = Accumulator(ddp, optimizer, micro_batch_size=mode, memory_budget="256MiB")
        results = [acc.step(_uneven_batch(w, rank), _sum_loss) for w in range(UNEVEN_WINDOWS)]
        out[mode] = {
            "sizes": [r.micro_batch_size for r in results],
            "stepped": all(r.stepped for r in results),
            "params": {n: p.detach().clone() for n, p in inner.named_parameters()},
        }
    return out


def _uneven_reference(per_rank_mean: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 4)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for window in range(UNEVEN_WINDOWS):
        batches = [_uneven_batch(window, rank) for rank in (0, 1)]
        optimizer.zero_grad(set_to_none=True)
        if per_rank_mean:
            losses = [F.cross_entropy(model(b[0]), b[1]) for b in batches]
            (sum(losses) / 2).backward()
        else:
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_auto_agrees_when_ranks_hold_different_batch_sizes(tmp_path: Path) -> None:
    """Before the fix each rank planned and timed up to its own batch size: different probe and
    candidate counts, so the ranks' small all-reduces paired up wrongly and they hung."""
    outcomes = spawn_ranks(uneven_auto_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    want = _uneven_reference(per_rank_mean=False)
    for mode in ("auto", "largest"):
        zero, one = (o.result[mode] for o in outcomes)
        assert zero["stepped"], mode
        assert one["stepped"], mode
        assert zero["sizes"] == one["sizes"], mode  # every rank runs the same size
        assert max(zero["sizes"]) <= UNEVEN_ITEMS[1], mode  # planned on the smaller batch
        for got in (zero, one):
            for name, value in want.items():
                torch.testing.assert_close(got["params"][name], value, rtol=1e-10, atol=1e-12)
    # NEGATIVE CONTROL: the mean of per-rank means steps elsewhere; the comparison can fail.
    control = _uneven_reference(per_rank_mean=True)
    assert max((control[n] - want[n]).abs().max().item() for n in want) > 1e-3
