"""Checkpoints under DDP on 2 real gloo ranks, saved the way users write them.

The common recipe saves on rank 0 only (`if rank == 0: save_checkpoint(...)`) and loads the file
on every rank. At a window boundary every rank's state is the same, so that is exact. In an open
window the `Accumulator` state holds rank 0's own partial gradients and counts: loaded on rank 1 it
would replace rank 1's, a silently wrong step (the negative control measures how wrong), so it is
refused there, naming the fix, with nothing changed. One file per rank resumes an open window
bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator, CheckpointError, load_checkpoint, save_checkpoint
from tests.distributed._harness import run_ranks

STEPS, MICRO_STEPS, SAVE_AT_BOUNDARY, SAVE_MID_WINDOW = 3, 8, 3, 4


def _build() -> tuple[nn.Module, DistributedDataParallel, Any, Any, Accumulator]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.05, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    acc = Accumulator(
        ddp, optimizer, accumulation_steps=STEPS, scheduler=scheduler, max_grad_norm=0.5
    )
    return model, ddp, optimizer, scheduler, acc


def _micro_batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged micro-batches (1 to 3 items), different on each rank."""
    generator = torch.Generator().manual_seed(10 * index + rank)
    items = 1 + (index + rank) % 3
    x = torch.randn(items, 4, generator=generator, dtype=torch.float64)
    return x, torch.randn(items, 2, generator=generator, dtype=torch.float64)


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (model(batch[0]) - batch[1]).pow(2).mean()


def _snapshot(model: nn.Module, optimizer: Any) -> list[torch.Tensor]:
    state = [p.detach().clone() for p in model.parameters()]
    for param_state in optimizer.state.values():
        state += [v.clone() for v in param_state.values() if isinstance(v, torch.Tensor)]
    return state


def _run(rank: int, folder: Path, save_at: int | None, per_rank: bool, origin: bool) -> Any:
    """Train MICRO_STEPS micro-steps and flush; at `save_at` save, rebuild everything and load.

    `per_rank`: every rank saves its own file; else rank 0 alone saves one file, which every rank
    loads. `origin=False` strips the record of who saved the state (the negative control: the
    state loads anywhere, as before the check).
    """
    model, ddp, optimizer, scheduler, acc = _build()
    refusal = None
    for index in range(MICRO_STEPS):
        if index == save_at:
            path = folder / (f"ckpt-rank{rank}.pt" if per_rank else "ckpt.pt")
            own = folder / f"own-rank{rank}.pt"  # what the refusal says to do, kept for later
            for target in {path, own} if (per_rank or rank == 0) else {own}:
                save_checkpoint(
                    target, model=ddp, optimizer=optimizer, accumulator=acc, scheduler=scheduler
                )
            dist.barrier()
            if not origin:
                payload = torch.load(path, weights_only=True)
                payload["accumulator"]["engine"].pop("origin", None)
                path = folder / f"stripped-rank{rank}.pt"
                torch.save(payload, path)
            model, ddp, optimizer, scheduler, acc = _build()
            before = _snapshot(model, optimizer), scheduler.state_dict()
            try:
                load_checkpoint(
                    path, model=ddp, optimizer=optimizer, accumulator=acc, scheduler=scheduler
                )
            except CheckpointError as error:
                after = _snapshot(model, optimizer), scheduler.state_dict()
                unchanged = all(
                    torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True)
                ) and (before[1] == after[1])
                refusal = (str(error), unchanged, [p.grad is None for p in model.parameters()])
                load_checkpoint(  # what the message says to do: each rank's own file
                    own, model=ddp, optimizer=optimizer, accumulator=acc, scheduler=scheduler
                )
        acc.micro_step(_micro_batch(rank, index), _mse)
    acc.flush()
    return {"params": [p.detach().clone() for p in model.parameters()], "refusal": refusal}


def checkpoint_worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    root = Path(folder)
    runs: dict[str, Any] = {}
    for name, save_at, per_rank, origin in [
        ("uninterrupted", None, False, True),
        ("boundary_rank0", SAVE_AT_BOUNDARY, False, True),
        ("mid_window_per_rank", SAVE_MID_WINDOW, True, True),
        ("mid_window_rank0", SAVE_MID_WINDOW, False, True),
        ("mid_window_rank0_unchecked", SAVE_MID_WINDOW, False, False),
    ]:
        sub = root / name
        if rank == 0:
            sub.mkdir()
        dist.barrier()
        runs[name] = _run(rank, sub, save_at, per_rank, origin)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("ddp_checkpoint")
    (folder / "ckpt").mkdir()
    return run_ranks(checkpoint_worker, folder, str(folder / "ckpt"), timeout=240)


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_rank0_checkpoint_at_a_window_boundary_resumes_every_rank_bitwise(
    runs: list[dict[str, Any]],
) -> None:
    for run in runs:
        assert _bitwise(run["boundary_rank0"]["params"], run["uninterrupted"]["params"])


def test_per_rank_checkpoints_resume_an_open_window_bitwise(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        assert _bitwise(run["mid_window_per_rank"]["params"], run["uninterrupted"]["params"])


def test_another_ranks_open_window_is_refused_naming_the_fix_and_changing_nothing(
    runs: list[dict[str, Any]],
) -> None:
    assert runs[0]["mid_window_rank0"]["refusal"] is None  # rank 0 loads its own window
    assert _bitwise(runs[0]["mid_window_rank0"]["params"], runs[0]["uninterrupted"]["params"])
    message, unchanged, grads_none = runs[1]["mid_window_rank0"]["refusal"]
    for phrase in ("saved on rank 0 of 2", "rank 1 of 2", "own file", "window boundary"):
        assert phrase in message, message
    assert unchanged
    assert all(grads_none)
    # Then loading its own file, as the message says, resumes it bitwise.
    assert _bitwise(runs[1]["mid_window_rank0"]["params"], runs[1]["uninterrupted"]["params"])


def test_negative_control_another_ranks_open_window_gives_a_wrong_step(
    runs: list[dict[str, Any]],
) -> None:
    """Without the check, rank 0's partial window loads on rank 1 and the step is far off."""
    run = runs[1]["mid_window_rank0_unchecked"]
    assert run["refusal"] is None
    gap = max(
        float((a - b).abs().max())
        for a, b in zip(run["params"], runs[1]["uninterrupted"]["params"], strict=True)
    )
    assert gap > 1e-3
