"""HSDP: FSDP2 on a 2-D device mesh (2 replicas x 2 shards), 4 gloo CPU ranks, exact.

`fully_shard(model, mesh=init_device_mesh("cpu", (2, 2)))` shards each parameter over the mesh's
second dimension and replicates it over the first: a backward reduce-scatters within a replica
and all-reduces across replicas, dividing by all 4 ranks. The library exchanges over all 4
ranks and undoes that mean once. Uneven windows (rank r holds 3(r+1) items, so 1 to 4
micro-batches), both sync policies and both recipes must give the single-process full-batch step
(float64, rtol 1e-10).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed._harness import fsdp_api, needs_fsdp2, run_ranks
from tests.distributed.test_uneven_windows import EXACT, items, make_tiny, masked_loss
from tests.reference import kept_items_reference

pytestmark = needs_fsdp2

WORLD = 4
WINDOWS = 2


def rank_items(window: int, rank: int) -> dict[str, torch.Tensor]:
    n = 3 * (rank + 1) if window == 0 else 3 * (WORLD - rank)
    return items(1000 * window + rank, n, n - 1)  # the last item of each rank counts nothing


def hsdp_worker(rank: int, world_size: int, recipe: str, policy: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fsdp_api().fully_shard

    from gradaccum import Accumulator

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_tiny()
    if recipe == "blocks+root":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=3, sync_policy=policy)
    counts = []
    for window in range(WINDOWS):
        result = acc.step(rank_items(window, rank), masked_loss)
        assert result.stepped
        counts.append(result.micro_batches)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "micro_batches": counts}


def reference() -> dict[str, torch.Tensor]:
    model = make_tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    windows = [[rank_items(w, r) for r in range(WORLD)] for w in range(WINDOWS)]
    return kept_items_reference(model, optimizer, windows)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("recipe", "policy"), [("root", "window"), ("blocks+root", "window"), ("root", "micro")]
)
def test_hsdp_on_a_two_by_two_mesh_equals_the_full_batch_step(
    tmp_path: Path, recipe: str, policy: str
) -> None:
    results = run_ranks(
        hsdp_worker, tmp_path, recipe, policy, world_size=WORLD, timeout=150.0, pg_timeout=60.0
    )
    expected = reference()
    for rank, got in enumerate(results):
        assert got["micro_batches"] == [rank + 1, WORLD - rank]  # really uneven
        for name, want in expected.items():
            torch.testing.assert_close(got["params"][name], want, **EXACT, msg=f"{rank} {name}")
