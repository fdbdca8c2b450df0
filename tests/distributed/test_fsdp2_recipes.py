"""FSDP2 as users write it, on 2 real gloo CPU ranks: exact against a plain full-batch step.

Two recipes:

- `fully_shard` on each block, then `fully_shard(model)` on the root, which then owns the
  embedding and the head (their parameters are unsharded between the root's forward and its
  backward: the library must not read the mesh from them);
- `fully_shard(model)` alone.

Each runs both drives with ragged, uneven token counts; rank 1's last micro-batch counts no item,
and in one window its loss has no graph at all (the model ran, the loss is a constant), which
makes every rank settle the window with a zero-item synchronized backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed._harness import fsdp_api, needs_fsdp2, run_ranks
from tests.distributed.test_uneven_windows import make_tiny
from tests.reference import kept_items_reference

pytestmark = needs_fsdp2

EXACT = dict(rtol=1e-10, atol=1e-12)
MICRO, ITEMS, WINDOWS = 3, 7, 3


def rank_batch(window: int, rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * window + rank)
    x = torch.randn(ITEMS, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(ITEMS, 2, generator=generator, dtype=torch.float64)
    keep = torch.ones(ITEMS, dtype=torch.bool)
    if rank == 1:
        keep[5:] = False  # uneven counts; rank 1's last micro-batch (item 6) counts nothing
    return {"x": x, "y": y, "keep": keep}


def masked_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """Squared error over kept items; the model always runs (FSDP2 forwards are collectives)."""
    from gradaccum import LossSum

    out = model(batch["x"])
    keep = batch["keep"]
    if not bool(keep.any()) and batch.get("no_graph") is not None:
        return LossSum(out.detach().sum() * 0, 0)  # a constant: no graph on this rank
    return LossSum((out[keep] - batch["y"][keep]).pow(2).sum(), int(keep.sum()))


def reference_params() -> dict[str, torch.Tensor]:
    model = make_tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    batches = [[rank_batch(window, rank) for rank in (0, 1)] for window in range(WINDOWS)]
    return kept_items_reference(model, optimizer, batches)


def recipe_worker(rank: int, world_size: int, recipe: str, drive: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fsdp_api().fully_shard

    from gradaccum import Accumulator

    mesh = init_device_mesh("cpu", (world_size,))
    model = make_tiny()
    if recipe == "blocks+root":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for window in range(WINDOWS):
        batch: dict[str, Any] = dict(rank_batch(window, rank))
        if window == 1:
            batch["no_graph"] = torch.ones(ITEMS)  # window 1: rank 1's last loss has no graph
        if drive == "step":
            acc = Accumulator(model, optimizer, micro_batch_size=MICRO)
            assert acc.step(batch, masked_loss).stepped
        else:
            acc = Accumulator(model, optimizer, accumulation_steps=4, partial_window="step")
            for start in range(0, ITEMS, MICRO):
                acc.micro_step({k: v[start : start + MICRO] for k, v in batch.items()}, masked_loss)
            assert acc.flush().stepped  # 3 of 4 micro-batches: a partial window, settled
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"params": full}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("drive", ["step", "stream"])
@pytest.mark.parametrize("recipe", ["blocks+root", "root"])
def test_fsdp2_recipes_match_the_full_batch_reference(
    tmp_path: Path, recipe: str, drive: str
) -> None:
    results = run_ranks(recipe_worker, tmp_path, recipe, drive, timeout=90.0, pg_timeout=20.0)
    expected = reference_params()
    for rank, got in enumerate(results):
        for name, want in expected.items():
            torch.testing.assert_close(got["params"][name], want, **EXACT, msg=f"{rank} {name}")


def test_negative_control_the_per_rank_mean_is_far_from_the_reference() -> None:
    """What FSDP2's default (a mean over ranks of each rank's own mean) would step to."""
    model = make_tiny()
    batches = [rank_batch(0, rank) for rank in (0, 1)]
    losses = [
        (model(b["x"][b["keep"]]) - b["y"][b["keep"]]).pow(2).sum() / int(b["keep"].sum())
        for b in batches
    ]
    (sum(losses) / 2).backward()
    per_rank = model.embed.weight.grad.clone()
    model.zero_grad()
    x = torch.cat([b["x"][b["keep"]] for b in batches])
    y = torch.cat([b["y"][b["keep"]] for b in batches])
    (model(x) - y).pow(2).sum().div(len(x)).backward()
    exact = model.embed.weight.grad
    assert (per_rank - exact).norm() / exact.norm() > 1e-2


def terms_refusal_worker(rank: int, world_size: int) -> dict[str, Any]:
    """`LossSum.terms` under FSDP2: refused on every rank alike, nothing stepped, then a plain
    loss still steps."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fsdp_api().fully_shard

    from gradaccum import Accumulator, LossSum

    model = make_tiny()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    acc = Accumulator(model, optimizer, micro_batch_size=MICRO)
    before = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    def two_terms(m: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        loss = masked_loss(m, batch)
        return LossSum.terms(mse=(loss.value, loss.count), l2=(loss.value * 0, 1))

    message = ""
    try:
        acc.step(rank_batch(0, rank), two_terms)
    except ValueError as error:
        message = str(error)
    unchanged = all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    stepped = acc.step(rank_batch(0, rank), masked_loss).stepped
    return {"message": message, "unchanged": unchanged, "stepped": stepped}


@pytest.mark.timeout(120)
def test_loss_terms_are_refused_under_fsdp2_naming_the_fix(tmp_path: Path) -> None:
    results = run_ranks(terms_refusal_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    for result in results:
        assert "not supported with FSDP2" in result["message"]
        assert result["unchanged"]
        assert result["stepped"]


def compiled_worker(rank: int, world_size: int) -> dict[str, Any]:
    """`torch.compile` of a sharded model: before the fix the wrapper hid FSDP2, the library ran
    one-process windows, and the ranks' collectives paired wrongly (a hang)."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fsdp_api().fully_shard

    from gradaccum import Accumulator

    mesh = init_device_mesh("cpu", (world_size,))
    model = make_tiny()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.2, momentum=0.9)
    acc = Accumulator(compiled, optimizer, micro_batch_size=MICRO)
    for window in range(WINDOWS):
        assert acc.step(rank_batch(window, rank), masked_loss).stepped
    return {"params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.timeout(180)
def test_a_compiled_fsdp2_model_matches_the_full_batch_reference(tmp_path: Path) -> None:
    results = run_ranks(compiled_worker, tmp_path, timeout=150.0, pg_timeout=30.0)
    expected = reference_params()
    for rank, got in enumerate(results):
        for name, want in expected.items():
            torch.testing.assert_close(got["params"][name], want, **EXACT, msg=f"{rank} {name}")
