"""`micro_batch_size="auto"` under DDP (2 gloo ranks) with a loss that compares its rows.

InfoNCE's negatives are the other rows of the micro-batch. "auto" timed a split window (16 of
each rank's 32 rows), whose step was then taken before the warning stopped the timing. Now the
ranks agree (one all-reduce, in timed windows only) to forget that window and rerun it whole:
every window equals the plain DDP step over each rank's 32 rows (float64, rtol 1e-10).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator
from tests.distributed._harness import run_ranks

EXACT = dict(rtol=1e-10, atol=1e-12)
WINDOWS, ROWS = 8, 32


class Clocked(nn.Module):
    """A float64 encoder whose fake clock makes micro-batches of 16 the fastest."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.body = nn.Linear(8, 4).double()
        self.now = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        self.now += m * (1.0 if m <= 16 else 1.6) + 0.5
        return self.body(x)


def info_nce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    anchors, positives = model(batch[0]), model(batch[1])
    return F.cross_entropy(anchors @ positives.T, torch.arange(len(anchors)))


def rank_batch(window: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * window + rank)
    a, p = (torch.randn(ROWS, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    return a, p


def worker(rank: int, world_size: int) -> dict[str, Any]:
    inner = Clocked()
    model = DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = Accumulator(model, opt, micro_batch_size="auto", memory_budget="256MiB")
    acc._auto.clock = lambda: inner.now
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sizes = [acc.step(rank_batch(w, rank), info_nce).micro_batch_size for w in range(WINDOWS)]
    return {"sizes": sizes, "params": [p.detach().clone() for p in inner.parameters()]}


def reference(split_window: int | None = None) -> list[torch.Tensor]:
    """The plain DDP step (each rank's 32 rows, gradients averaged); `split_window` at 16."""
    model = Clocked()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for window in range(WINDOWS):
        opt.zero_grad(set_to_none=True)
        parts = []
        for rank in (0, 1):
            a, p = rank_batch(window, rank)
            cut = 16 if window == split_window else ROWS
            parts += [
                info_nce(model, (a[i : i + cut], p[i : i + cut])) for i in range(0, ROWS, cut)
            ]
        (sum(parts) / len(parts)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_ddp_auto_reruns_whole_the_timed_split_window_that_warned(tmp_path: Path) -> None:
    results = run_ranks(worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    expected = reference()
    for result in results:
        assert result["sizes"] == [ROWS] * WINDOWS
        for got, want in zip(result["params"], expected, strict=True):
            torch.testing.assert_close(got, want, **EXACT)
    # NEGATIVE CONTROL: the old behaviour, the third window (timed at 16) stepped split.
    old = reference(split_window=2)
    assert max(float((a - b).abs().max()) for a, b in zip(old, expected, strict=True)) > 1e-3
