"""`micro_batch_size="auto"` under DDP on 2 gloo ranks when one rank's batch is empty.

With an int `micro_batch_size`, a rank with no items joins the window's collectives and the step
is exact. Under "auto" the empty batch was refused on that rank alone ("the batch is empty"),
before the plan's or the window's collectives, so the other ranks waited for it until the
process group's timeout (or failed when it exited). Now:

- a rank whose batch is empty after the plan joins the window with no micro-batch: exact
  against the full-batch step (float64, rtol 1e-10);
- the plan itself needs items on every rank: an empty first batch on one rank makes every rank
  raise the same `ValueError`, nothing changed, and the next `step()` plans and runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator, LossSum
from tests.distributed._harness import run_ranks

EXACT = dict(rtol=1e-10, atol=1e-12)
SIZES = {0: (6, 3), 1: (0, 4), 2: (5, 7), 3: (9, 0)}  # window: items on rank 0, rank 1


def make_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()


def rank_batch(window: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * window + rank)
    items = SIZES[window][rank]
    x = torch.randn(items, 3, generator=generator, dtype=torch.float64)
    return x, torch.randn(items, 1, generator=generator, dtype=torch.float64)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    x, y = batch
    return LossSum((model(x) - y).pow(2).sum(), count=len(x))


def worker(rank: int, world_size: int, first: int) -> dict[str, Any]:
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    acc = Accumulator(model, optimizer, micro_batch_size="auto", memory_budget="64MiB")
    refused, unchanged = None, True
    before = [p.detach().clone() for p in model.parameters()]
    if first == 1:  # rank 1's first batch is empty: the plan cannot be made on every rank
        try:
            acc.step(rank_batch(1, rank), loss_fn)
        except ValueError as error:
            refused = str(error)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        unchanged = unchanged and not optimizer.state

    def failing(model: nn.Module, batch: Any) -> LossSum:
        if rank == 1:
            raise ValueError("a bad row on rank 1")
        return loss_fn(model, batch)

    if first == 2:  # rank 1's loss_fn raises while the plan probes: every rank raises at once
        started = time.monotonic()
        try:
            acc.step(rank_batch(0, rank), failing)
        except Exception as error:
            refused = f"{type(error).__name__}: {error}"
        unchanged = time.monotonic() - started < 10.0  # before: rank 0 waited for the timeout
        unchanged = unchanged and not optimizer.state
        unchanged = unchanged and all(
            torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
        )
    if first == 3:  # after the plan, rank 1 raises in a window still timed: all raise at once
        acc.step(rank_batch(0, rank), loss_fn)
        before = [p.detach().clone() for p in model.parameters()]
        state = str(optimizer.state_dict())
        started = time.monotonic()
        try:
            acc.step(rank_batch(0, rank), failing)  # the same size: no new plan
        except Exception as error:
            refused = f"{type(error).__name__}: {error}"
        unchanged = time.monotonic() - started < 10.0  # before: rank 0 waited for the timeout
        unchanged = unchanged and state == str(optimizer.state_dict())
        unchanged = unchanged and all(
            torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
        )
    for window in (0, 1, 2, 3):  # rank 1 holds no item in window 1, rank 0 none in window 3
        assert acc.step(rank_batch(window, rank), loss_fn).stepped
    params = [p.detach().clone() for p in model.parameters()]
    return {"refused": refused, "unchanged": unchanged, "params": params}


def reference(windows: tuple[int, ...] = (0, 1, 2, 3)) -> list[torch.Tensor]:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for window in windows:
        batches = [rank_batch(window, rank) for rank in (0, 1)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        optimizer.zero_grad(set_to_none=True)
        ((model(x) - y).pow(2).sum() / len(x)).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", [0, 1, 2, 3])
def test_auto_with_an_empty_rank_joins_the_window_or_refuses_the_plan_on_every_rank(
    tmp_path: Path, first: int
) -> None:
    results = run_ranks(worker, tmp_path, first, timeout=90.0, pg_timeout=20.0)
    expected = reference((0, 0, 1, 2, 3) if first == 3 else (0, 1, 2, 3))
    for result in results:
        for got, want in zip(result["params"], expected, strict=True):
            torch.testing.assert_close(got, want, **EXACT)
        if first == 1:
            assert result["refused"] is not None
            assert (
                "the batch is empty (0 items along the batch dimension) on this rank or"
                in (result["refused"])
            )
            assert result["unchanged"]
    if first >= 2:  # before: rank 0 waited for the timeout (2: rank 1's retry read garbage)
        assert results[1]["refused"] == "ValueError: a bad row on rank 1"
        told = "loss_fn raised on another" if first == 2 else "another rank raised inside this"
        assert results[0]["refused"].startswith(f"RankMismatchError: {told}")
        assert all(result["unchanged"] for result in results)
    # NEGATIVE CONTROL: the empty rank's window skipped (rank 0 stepping alone) ends elsewhere.
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for window in (0, 1, 2, 3):
        x, y = rank_batch(window, 0)
        optimizer.zero_grad(set_to_none=True)
        if len(x):
            ((model(x) - y).pow(2).sum() / len(x)).backward()
            optimizer.step()
    alone = [p.detach() for p in model.parameters()]
    gap = max(float((p - q).abs().max()) for p, q in zip(alone, expected, strict=True))
    assert gap > 1e-3
