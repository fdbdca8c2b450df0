"""FSDP2 with optimizer parameters outside the sharded model, on 2 gloo ranks.

A learnable loss weight (or any parameter the optimizer holds that `fully_shard` did not shard)
gets no reduction from FSDP2. Before, each rank stepped it on its own items alone: the replicas
drifted apart (0.781 on rank 0 against 0.803 on rank 1 after 3 windows, 0.792 in the reference)
and the model's own parameters, trained through it, were 26 % off. Now it is averaged over ranks
as FSDP2 averages its own gradients, and the step is the full-batch one (float64, rtol 1e-10):

- `weight`, used by every rank; `bias0`, used by rank 0's items only (zeros on rank 1 before the
  sum); `spare`, used by no rank, keeps `grad=None` and does not move under weight decay;
- both sync policies, with clipping (`max_grad_norm`, over sharded and plain gradients alike),
  `step()` and a streamed window settled by `flush()`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed._harness import run_ranks
from tests.distributed.test_fsdp2_recipes import rank_batch
from tests.distributed.test_uneven_windows import make_tiny

EXACT = dict(rtol=1e-10, atol=1e-12)
WINDOWS, MICRO, MAX_NORM = 3, 3, 0.5


def extras() -> dict[str, nn.Parameter]:
    return {
        "weight": nn.Parameter(torch.tensor(0.8, dtype=torch.float64)),
        "bias0": nn.Parameter(torch.zeros(2, dtype=torch.float64)),
        "spare": nn.Parameter(torch.ones(3, dtype=torch.float64)),
    }


def make_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=0.01)


def rank_loss(
    out: torch.Tensor, batch: dict[str, torch.Tensor], extra: dict[str, nn.Parameter], rank: int
) -> torch.Tensor:
    keep = batch["keep"]
    pred = out[keep] * extra["weight"]
    if rank == 0:
        pred = pred + extra["bias0"]
    return (pred - batch["y"][keep]).pow(2).sum()


def worker(rank: int, world_size: int, policy: str, drive: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradaccum import Accumulator, LossSum

    model = make_tiny()
    for block in model.blocks:
        fully_shard(block, mesh=init_device_mesh("cpu", (world_size,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    extra = extras()
    optimizer = make_optimizer([*model.parameters(), *extra.values()])

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
        return LossSum(rank_loss(m(batch["x"]), batch, extra, rank), int(batch["keep"].sum()))

    common: dict[str, Any] = dict(max_grad_norm=MAX_NORM, sync_policy=policy)
    if drive == "step":
        acc = Accumulator(model, optimizer, micro_batch_size=MICRO, **common)
    else:
        acc = Accumulator(model, optimizer, accumulation_steps=4, **common)
    for window in range(WINDOWS):
        batch = rank_batch(window, rank)
        if drive == "step":
            assert acc.step(batch, loss_fn).stepped
        else:
            for start in range(0, len(batch["x"]), MICRO):
                acc.micro_step({k: v[start : start + MICRO] for k, v in batch.items()}, loss_fn)
            assert acc.flush().stepped  # 3 of 4 micro-batches: a partial window
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    params.update({n: p.detach().clone() for n, p in extra.items()})
    return {"params": params, "spare_grad": extra["spare"].grad}


def reference(ranks: tuple[int, ...] = (0, 1)) -> dict[str, torch.Tensor]:
    """Plain PyTorch: one step per window over the kept items of `ranks`, clipped."""
    model, extra = make_tiny(), extras()
    params = [*model.parameters(), *extra.values()]
    optimizer = make_optimizer(params)
    for window in range(WINDOWS):
        batches = {rank: rank_batch(window, rank) for rank in ranks}
        count = sum(int(b["keep"].sum()) for b in batches.values())
        optimizer.zero_grad(set_to_none=True)
        total = sum(rank_loss(model(b["x"]), b, extra, r) for r, b in batches.items())
        (total / count).backward()
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], MAX_NORM)
        optimizer.step()
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    named.update({n: p.detach().clone() for n, p in extra.items()})
    return named


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("policy", "drive"), [("window", "step"), ("micro", "stream")])
def test_parameters_outside_the_sharded_model_are_reduced_over_ranks(
    tmp_path: Path, policy: str, drive: str
) -> None:
    results = run_ranks(worker, tmp_path, policy, drive, timeout=90.0, pg_timeout=20.0)
    expected = reference()
    for rank, got in enumerate(results):
        for name, want in expected.items():
            torch.testing.assert_close(got["params"][name], want, **EXACT, msg=f"{rank} {name}")
        assert got["spare_grad"] is None
        assert torch.equal(got["params"]["spare"], torch.ones(3, dtype=torch.float64))


def test_negative_control_one_ranks_items_alone_move_the_weight_elsewhere() -> None:
    """What each rank stepped to before: the outside weight trained on its own items."""
    expected, alone = reference(), reference(ranks=(0,))
    assert abs(float(alone["weight"] - expected["weight"])) > 1e-3


def blocks_only_worker(rank: int, world_size: int) -> str:
    """`fully_shard` on the blocks but not on the root: refused at construction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradaccum import Accumulator

    model = make_tiny()
    for block in model.blocks:
        fully_shard(block, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = make_optimizer(list(model.parameters()))
    try:
        Accumulator(model, optimizer, micro_batch_size=MICRO)
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.timeout(120)
def test_a_model_whose_root_is_not_sharded_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """Before, the root's own parameters were reduced by no one, and the Accumulator saw no
    sharding: the first step crashed in a foreach op mixing DTensors and plain tensors."""
    for message in run_ranks(blocks_only_worker, tmp_path, timeout=60.0, pg_timeout=20.0):
        assert "Call fully_shard(model) on the root as well" in message, message
