"""`micro_batch_size="auto"`/`"largest"` under FSDP2, on 2 gloo ranks.

- The plan counts what each rank holds: its shards of the parameters and optimizer state, and
  gradients as the sync policy keeps them (unsharded sums under `"window"`, the shard under
  `"micro"`). Every probe is a collective, so the ranks probe the same sizes (each probe's peak is
  the largest rank's) and choose the same size.
- Out of memory on every rank at once (as balanced data does) reruns the window smaller on both,
  exactly: the parameters equal the single-process full-batch steps (float64, rtol 1e-10).
- `"auto"` times sizes on real windows; the ranks agree on the choice.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed._harness import fsdp_api, needs_fsdp2, run_ranks
from tests.distributed.test_uneven_windows import EXACT, Tiny, items, masked_loss
from tests.reference import kept_items_reference

pytestmark = needs_fsdp2

WINDOWS, ITEMS = 4, 12


class OomTiny(Tiny):
    """`Tiny` that fails like an allocator above `threshold` items (on every rank alike)."""

    threshold = math.inf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.threshold:
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} > {self.threshold}")
        return super().forward(x)


def make() -> OomTiny:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return OomTiny().double()


def batch(window: int, rank: int) -> dict[str, torch.Tensor]:
    return items(500 + 10 * window + rank, ITEMS, ITEMS - rank)


def auto_worker(rank: int, world_size: int, recipe: str, policy: str, mode: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fsdp_api().fully_shard

    from gradaccum import Accumulator

    mesh = init_device_mesh("cpu", (world_size,))
    model = make()
    if recipe == "blocks+root":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=mode, memory_budget="64MiB",
                      sync_policy=policy)  # fmt: skip
    results = [acc.step(batch(0, rank), masked_loss)]
    plan = acc.plan
    model.threshold = 5 if mode == "largest" else math.inf  # memory runs short after planning
    results += [acc.step(batch(w, rank), masked_loss) for w in range(1, WINDOWS)]
    local = sum(p.to_local().numel() * 8 for p in model.parameters())
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {
        "plan": (plan.micro_batch_size, plan.parameters_bytes, plan.gradients_bytes),
        "local_bytes": local,
        "global_bytes": sum(p.numel() * 8 for p in model.parameters()),
        "sizes": [r.micro_batch_size for r in results],
        "sizing": results[-1].sizing,
        "params": full,
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("recipe", "policy", "mode", "world_size"),
    [
        ("blocks+root", "window", "largest", 2),
        ("root", "micro", "largest", 2),
        ("root", "window", "auto", 2),
        ("root", "window", "largest", 4),
    ],
)
def test_fsdp2_sizes_alike_on_every_rank_and_reruns_exactly(
    tmp_path: Path, recipe: str, policy: str, mode: str, world_size: int
) -> None:
    results = run_ranks(auto_worker, tmp_path, recipe, policy, mode, world_size=world_size,
                        timeout=200.0, pg_timeout=60.0)  # fmt: skip
    zero, one = results[:2]
    for got in results:  # the same probes, the same size, the same reruns
        assert got["plan"][0] == zero["plan"][0]
        assert got["sizes"] == zero["sizes"]
        size, parameters, gradients = got["plan"]
        assert size == ITEMS  # a roomy budget: the whole batch fits
        assert parameters == got["local_bytes"] < got["global_bytes"]  # this rank's shards
        held = got["global_bytes"] if policy == "window" else got["local_bytes"]
        assert gradients == held
    if mode == "largest":  # 12 fails from window 2 on: 12 -> 9 -> 6 -> 4 fits
        assert zero["sizes"] == [12, 4, 4, 4]
    else:
        assert zero["sizing"] == one["sizing"]
    model = make()
    windows = [[batch(w, r) for r in range(world_size)] for w in range(WINDOWS)]
    want = kept_items_reference(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                windows)  # fmt: skip
    for got in results:
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name], value, **EXACT, msg=name)
