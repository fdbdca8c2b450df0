"""Uneven windows on FSDP2 and DDP: ranks run different numbers of micro-batches, exactly.

Length-skewed data gives one rank 1 micro-batch and another 4 in the same window. Under FSDP2
every forward and backward is a collective, so the ranks first agree on the most micro-batches any
of them plans, and a rank with fewer runs zero-item ones that join the same collectives and add
nothing; under DDP the backward passes are no collectives and the ranks meet at the boundary.
Both give the single-process full-batch step (float64, rtol 1e-10), on 2, 3 and 4 ranks, for both
FSDP2 recipes, and in every window shape:

- `step()` with 4 micro-batches on rank 0 and 1 on the others (a LossSum, then a plain mean);
- `step()` where a rank has no item at all (an empty batch);
- `step(max_tokens=...)`, whose packing differs per rank;
- `micro_step()` with `accumulation_steps=Tokens(n)`: the window closes when the tokens counted
  over all ranks reach `n`, on every rank at the same micro-batch;
- `micro_step()` with `accumulation_steps=2` and micro-batches of 3 items on one rank, 1 on the
  others (FSDP2 ranks must agree on one backward scale).

The negative control is the per-rank mean (each rank's own mean, averaged over ranks), which
is what the backends compute without gradaccum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed._harness import fsdp_api, needs_fsdp2, run_ranks
from tests.reference import kept_items_reference

EXACT = dict(rtol=1e-10, atol=1e-12)
MICRO = 3
TOKENS = 10  # the Tokens(n) window of the streamed scenario
STREAMED = 6  # micro-batches each rank streams


class Tiny(nn.Module):
    """Embedding and head on the root; two blocks that a user shards one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def make_tiny() -> Tiny:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Tiny().double()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def items(seed: int, n: int, kept: int | None = None) -> dict[str, torch.Tensor]:
    """`n` regression items, of which the first `kept` (all by default) count."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(n, 2, generator=generator, dtype=torch.float64)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[: n if kept is None else kept] = True
    return {"x": x, "y": y, "keep": keep}


def masked_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    from gradaccum import LossSum

    out = model(batch["x"])
    keep = batch["keep"]
    return LossSum((out[keep] - batch["y"][keep]).pow(2).sum(), int(keep.sum()))


def mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]).pow(2).sum(dim=1).mean()


def rows(seed: int, lengths: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded rows of the given lengths: one item per kept position (a token batch)."""
    width = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), width, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(len(lengths), width, 2, generator=generator, dtype=torch.float64)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return {"x": x, "y": y, "attention_mask": mask}


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    from gradaccum import LossSum

    keep = batch["attention_mask"].bool()
    out = model(batch["x"])
    return LossSum((out[keep] - batch["y"][keep]).pow(2).sum(), int(keep.sum()))


def as_items(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A token batch as the plain items the reference steps on."""
    keep = batch["attention_mask"].bool()
    x, y = batch["x"][keep], batch["y"][keep]
    return {"x": x, "y": y, "keep": torch.ones(len(x), dtype=torch.bool)}


def streamed_kept(rank: int) -> list[int]:
    """Items each streamed micro-batch of `rank` counts: skewed, and 0 for some."""
    table = [[3, 3, 1, 2, 3, 3], [1, 0, 2, 3, 3, 1], [0, 2, 2, 0, 1, 3], [2, 0, 0, 3, 1, 0]]
    return table[rank][:STREAMED]


def step_batches(rank: int) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """The `step()` windows of `rank`: (loss name, batch)."""
    long_rows = [7, 6, 6, 5] if rank == 0 else [2, 1]
    return [
        ("masked", items(10 + rank, 12 if rank == 0 else 3, 10 if rank == 0 else 2)),
        ("mean", items(20 + rank, 12 if rank == 0 else 2)),
        ("masked", items(30 + rank, 5 if rank == 0 else 0)),
        ("tokens", rows(40 + rank, long_rows)),
    ]


def streamed_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    return [items(50 + 10 * rank + i, MICRO, k) for i, k in enumerate(streamed_kept(rank))]


def sized_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """Streamed with accumulation_steps=2: micro-batches of 3 items on rank 0, 1 elsewhere."""
    return [items(90 + 10 * rank + i, MICRO if rank == 0 else 1) for i in range(4)]


def streamed_count(window: list[int], world_size: int) -> int:
    return sum(streamed_kept(rank)[i] for rank in range(world_size) for i in window)


def streamed_windows(world_size: int) -> list[list[int]]:
    """The streamed micro-batch indices of each Tokens window, from the counts alone."""
    windows: list[list[int]] = [[]]
    total = 0
    for index in range(STREAMED):
        windows[-1].append(index)
        total += sum(streamed_kept(rank)[index] for rank in range(world_size))
        if total >= TOKENS:
            windows.append([])
            total = 0
    return [w for w in windows if w]


def shard(model: nn.Module, world_size: int, recipe: str) -> nn.Module:
    if recipe == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fsdp_api().fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    if recipe == "blocks+root":
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name.removeprefix("module.")] = value.detach().clone()
    return out


def uneven_worker(
    rank: int, world_size: int, recipe: str, policy: str = "window"
) -> dict[str, Any]:
    from gradaccum import Accumulator, Tokens

    model = shard(make_tiny(), world_size, recipe)
    optimizer = make_optimizer(model)
    losses = {"masked": masked_loss, "mean": mean_loss, "tokens": token_loss}
    micro_batches = []
    for name, batch in step_batches(rank):
        acc = Accumulator(model, optimizer, micro_batch_size=MICRO, sync_policy=policy)
        budget = {"max_tokens": 14} if name == "tokens" else {}
        result = acc.step(batch, losses[name], **budget)
        assert result.stepped
        micro_batches.append(result.micro_batches)
    acc = Accumulator(model, optimizer, accumulation_steps=Tokens(TOKENS), sync_policy=policy)
    closed = []
    for index, micro_batch in enumerate(streamed_batches(rank)):
        if acc.micro_step(micro_batch, masked_loss).stepped:
            closed.append(index)
    last = acc.flush()
    acc = Accumulator(model, optimizer, accumulation_steps=2, sync_policy=policy)
    sized = [acc.micro_step(b, masked_loss).stepped for b in sized_batches(rank)]
    assert sized == [False, True, False, True]
    return {
        "params": full_params(model),
        "micro_batches": micro_batches,
        "closed": closed,
        "flushed": last.stepped,
        "count": last.count,
    }


def reference(world_size: int) -> dict[str, torch.Tensor]:
    model = make_tiny()
    windows: list[list[dict[str, torch.Tensor]]] = []
    per_rank = [step_batches(rank) for rank in range(world_size)]
    for index, (name, _) in enumerate(per_rank[0]):
        batches = [per_rank[rank][index][1] for rank in range(world_size)]
        windows.append([as_items(b) if name == "tokens" else b for b in batches])
    streamed = [streamed_batches(rank) for rank in range(world_size)]
    for window in streamed_windows(world_size):
        windows.append([streamed[rank][i] for rank in range(world_size) for i in window])
    sized = [sized_batches(rank) for rank in range(world_size)]
    for window in ([0, 1], [2, 3]):
        windows.append([sized[rank][i] for rank in range(world_size) for i in window])
    return kept_items_reference(model, make_optimizer(model), windows)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("recipe", "world_size"),
    [
        ("ddp", 2),
        ("ddp", 3),
        pytest.param("blocks+root", 2, marks=needs_fsdp2),
        pytest.param("blocks+root", 3, marks=needs_fsdp2),
        pytest.param("blocks+root", 4, marks=needs_fsdp2),
        pytest.param("root", 2, marks=needs_fsdp2),
        pytest.param("root", 4, marks=needs_fsdp2),
    ],
)
def test_uneven_windows_equal_the_full_batch_step(
    tmp_path: Path, recipe: str, world_size: int
) -> None:
    results = run_ranks(
        uneven_worker, tmp_path, recipe, world_size=world_size, timeout=150.0, pg_timeout=60.0
    )
    expected = reference(world_size)
    windows = streamed_windows(world_size)
    for rank, got in enumerate(results):
        # Really uneven: rank 0 runs 4 micro-batches where the others run 1, or none.
        want_counts = [4, 4, 2, 2] if rank == 0 else [1, 1, 0, 1]
        assert got["micro_batches"] == want_counts, (rank, got["micro_batches"])
        # Every rank closes each Tokens window at the same micro-batch, when the sum is reached;
        # a last window short of it is settled by flush().
        complete = [w for w in windows if streamed_count(w, world_size) >= TOKENS]
        assert got["closed"] == [w[-1] for w in complete], (rank, got["closed"], windows)
        assert got["flushed"] == (len(complete) < len(windows)), rank
        for name, want in expected.items():
            torch.testing.assert_close(got["params"][name], want, **EXACT, msg=f"{rank} {name}")


def test_the_scenarios_are_uneven_and_the_per_rank_mean_is_a_wrong_answer() -> None:
    """Negative control: each rank's own mean, averaged over ranks, misses the full batch."""
    windows = streamed_windows(2)
    assert len(windows) >= 3
    assert len({len(w) for w in windows}) > 1
    model = make_tiny()
    batches = [step_batches(rank)[0][1] for rank in (0, 1)]
    kept = [{k: v[b["keep"]] for k, v in b.items()} for b in batches]
    per_rank = sum((model(b["x"]) - b["y"]).pow(2).sum(dim=1).mean() for b in kept) / 2
    per_rank.backward()
    wrong = model.embed.weight.grad.clone()
    model.zero_grad()
    x, y = torch.cat([b["x"] for b in kept]), torch.cat([b["y"] for b in kept])
    (model(x) - y).pow(2).sum().div(len(x)).backward()
    exact = model.embed.weight.grad
    assert (wrong - exact).norm() / exact.norm() > 1e-2
