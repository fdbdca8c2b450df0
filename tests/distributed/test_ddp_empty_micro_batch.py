"""`micro_step()` under DDP (2 gloo ranks) when a rank's micro-batch holds no row.

A rank whose loader runs dry mid-window (uneven shards from a custom or length-grouped
sampler, a last partial micro-batch empty on one rank only) gave `micro_step()` a micro-batch
of 0 rows: that rank raised "the batch is empty; add items" and every rank discarded the
window (`RankMismatchError` on the others), although `step()` takes a rank with no item. Now
the empty micro-batch counts nothing, the ranks take the same collectives, and each window is
the plain full-batch step over the rows the ranks held (float64, rtol 1e-10): an empty
micro-batch in the middle, at the end, a whole window empty on one rank, plain means and
`LossSum`s alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator, LossSum
from tests.distributed._harness import run_ranks

EXACT = dict(rtol=1e-10, atol=1e-12)
# Rows per micro-batch, per window and rank: an empty middle, an empty last, a whole empty window.
ROWS = [{0: [3, 3, 2], 1: [3, 0, 2]}, {0: [3, 3, 1], 1: [3, 3, 0]}, {0: [2, 3, 3], 1: [0, 0, 0]}]


def make_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def micro_batch(window: int, rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * window + 10 * rank + index)
    rows = ROWS[window][rank][index]
    x = torch.randn(rows, 4, generator=generator, dtype=torch.float64)
    return x, torch.randn(rows, 2, generator=generator, dtype=torch.float64)


def plain_mean(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1], reduction="none").sum(dim=1).mean()


def summed(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    return LossSum(F.mse_loss(model(batch[0]), batch[1], reduction="sum"), len(batch[0]))


def worker(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    acc = Accumulator(model, optimizer, accumulation_steps=3)
    loss_fn = plain_mean if kind == "plain" else summed
    results = []
    for window in range(len(ROWS)):
        for index in range(3):
            result = acc.micro_step(micro_batch(window, rank, index), loss_fn)
        results.append((result.stepped, result.count))
    return {"results": results, "params": [p.detach().clone() for p in model.parameters()]}


def reference(skip_rank: int | None = None) -> list[torch.Tensor]:
    """One AdamW step per window on every row of both ranks (`skip_rank`: a control)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for window in range(len(ROWS)):
        parts = [
            micro_batch(window, rank, index)
            for rank in (0, 1)
            for index in range(3)
            if rank != skip_rank
        ]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        optimizer.zero_grad(set_to_none=True)
        plain_mean(model, (x, y)).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["plain", "sum"])
def test_an_empty_micro_batch_on_one_rank_counts_nothing_and_the_step_is_exact(
    tmp_path: Path, kind: str
) -> None:
    results = run_ranks(worker, tmp_path, kind, timeout=90.0, pg_timeout=20.0)
    expected = reference()
    counts = [sum(sum(ROWS[w][r]) for r in (0, 1)) for w in range(len(ROWS))]
    for result in results:
        assert result["results"] == [(True, count) for count in counts]
        for got, want in zip(result["params"], expected, strict=True):
            torch.testing.assert_close(got, want, **EXACT)
    # NEGATIVE CONTROL: rank 1's rows left out (the window it spoiled) end elsewhere.
    alone = reference(skip_rank=1)
    assert max(float((a - b).abs().max()) for a, b in zip(alone, expected, strict=True)) > 1e-3
