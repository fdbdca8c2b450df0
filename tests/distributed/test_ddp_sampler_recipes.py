"""docs/distributed.md's ways to shard an epoch under DDP, on 2 gloo ranks, each step against the
plain full-batch step over the union of the ranks' items (float64, rtol 1e-10).

- `DistributedSampler(drop_last=False)` with `set_epoch`: 23 items pad to 12 per rank (a repeated
  item weighs twice, as the sampler yields it), a ragged last batch of 2 per rank, both drives.
- Without padding: each epoch's global batches, each rank taking its share `batch[rank::world]`
  (the last batch of 1 item leaves rank 1 none). The page said "shard without padding
  (`indices[rank::world_size]`) and use `step()`": batched per rank, 21 items give rank 0 three
  batches and rank 1 two, so rank 1's next epoch's first `step()` met rank 0's last batch of
  this epoch (a window of two epochs' items, silently), and rank 0 waited at the end until the
  process group's timeout.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from gradaccum import Accumulator, LossSum
from tests.distributed._harness import run_ranks


def loss_fn(model: nn.Module, batch: Any) -> LossSum:
    x, y = batch
    return LossSum(nn.functional.cross_entropy(model(x), y, reduction="sum"), count=len(y))


def _data(items: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(items, 5, generator=generator, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, 3, (items,), generator=generator))


def _setup() -> tuple[Accumulator, DistributedDataParallel, nn.Module, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(net)
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return model, optimizer, reference, ref_optimizer


def _reference_step(reference: nn.Module, optimizer: Any, shares: list[Any]) -> None:
    x = torch.cat([share[0] for share in shares])
    y = torch.cat([share[1] for share in shares])
    optimizer.zero_grad(set_to_none=True)
    (nn.functional.cross_entropy(reference(x), y, reduction="sum") / len(y)).backward()
    optimizer.step()


def _gap(model: DistributedDataParallel, reference: nn.Module) -> float:
    pairs = zip(model.module.parameters(), reference.parameters(), strict=True)
    return max(float((p - q).abs().max() / q.abs().max()) for p, q in pairs)


def _everyone(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _all_held(held: list[Any]) -> list[Any]:
    return [batch for rank_held in _everyone(held) for batch in rank_held]


def _distributed_sampler(rank: int, world: int, drive: str) -> float:
    model, optimizer, reference, ref_optimizer = _setup()
    if drive == "step":
        acc = Accumulator(model, optimizer, micro_batch_size=3)
    else:
        acc = Accumulator(model, optimizer, accumulation_steps=2)
    dataset = _data(23)
    sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=3, drop_last=False)
    loader = DataLoader(dataset, batch_size=5, sampler=sampler)
    worst, held = 0.0, []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in loader:
            if drive == "step":
                acc.step(batch, loss_fn)
                _reference_step(reference, ref_optimizer, _everyone(batch))
            else:
                held.append(batch)
                if not acc.micro_step(batch, loss_fn).stepped:
                    continue
            if held:
                _reference_step(reference, ref_optimizer, _all_held(held))
                held = []
            worst = max(worst, _gap(model, reference))
        if drive != "step" and acc.flush().stepped:
            _reference_step(reference, ref_optimizer, _all_held(held))
            held = []
            worst = max(worst, _gap(model, reference))
    return worst


def _global_batches(rank: int, world: int) -> dict[str, Any]:
    """The documented recipe: the epoch's global batches, each rank its share of each."""
    model, optimizer, reference, ref_optimizer = _setup()
    acc = Accumulator(model, optimizer, micro_batch_size=2)
    x, y = _data(21).tensors
    worst, empty = 0.0, 0
    for epoch in range(2):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(7 + epoch))
        for batch in order.split(5):  # the global batches, alike on every rank
            mine = batch[rank::world]  # this rank's share (the last batch may leave it none)
            acc.step((x[mine], y[mine]), loss_fn)
            empty += len(mine) == 0
            _reference_step(reference, ref_optimizer, [(x[batch], y[batch])])
            worst = max(worst, _gap(model, reference))
    # What the page said before: shard, then batch per rank.
    per_rank = len(DataLoader(Subset(_data(21), range(21)[rank::world]), batch_size=5))
    return {"worst": worst, "empty": empty, "per_rank_batches": per_rank}


def worker(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "sampler_step": _distributed_sampler(rank, world_size, "step"),
        "sampler_micro": _distributed_sampler(rank, world_size, "micro"),
        "global": _global_batches(rank, world_size),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(worker, tmp_path_factory.mktemp("sampler"), timeout=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("drive", ["sampler_step", "sampler_micro"])
def test_a_padding_distributed_sampler_steps_exactly_on_what_it_yields(
    runs: list[dict[str, Any]], drive: str
) -> None:
    for run in runs:
        assert run[drive] <= 1e-10


@pytest.mark.timeout(180)
def test_unpadded_shares_of_each_global_batch_step_exactly(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        assert run["global"]["worst"] <= 1e-10
    assert runs[1]["global"]["empty"] == 2  # the last batch of each epoch left rank 1 none


@pytest.mark.timeout(180)
def test_negative_control_sharding_then_batching_gives_the_ranks_unequal_step_counts(
    runs: list[dict[str, Any]],
) -> None:
    assert [run["global"]["per_rank_batches"] for run in runs] == [3, 2]
