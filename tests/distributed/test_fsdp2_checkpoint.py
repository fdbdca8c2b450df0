"""Sharded checkpoints of FSDP2 models (`torch.distributed.checkpoint`), mid-window, on gloo ranks.

- SIGKILL mid-window, then resume in new processes: bitwise the uninterrupted run, on 2 ranks,
  both recipes (`sync_policy="micro"`, whose open window's gradient shards are in `.grad`).
- Resharding at a window boundary, 2 ranks -> 1 and 1 -> 2: the next window is the plain
  full-batch step (float64, rtol 1e-10) of the run that never stopped.
- Resharding mid-window is refused with a message naming the fix, and changes nothing; so is
  saving an open window under `sync_policy="window"`, which writes nothing.
- A save killed before its rename, or between moving the old checkpoint aside and the rename,
  loses nothing: the previous checkpoint loads.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed._harness import run_ranks, spawn_ranks
from tests.distributed.test_uneven_windows import EXACT, items, make_tiny, masked_loss, shard
from tests.reference import kept_items_reference

STEPS, PER_WINDOW, KILL_AFTER = 8, 3, 4  # micro-steps; window ends after 3 and 6; flush at 8


def micro_batch(rank: int, index: int) -> dict[str, torch.Tensor]:
    return items(300 + 17 * rank + index, 3, 3 - (index + rank) % 3)  # 1 to 3 items counted


def build(world_size: int, recipe: str, policy: str = "micro") -> tuple[Any, Any, Any]:
    from gradaccum import Accumulator

    model = shard(make_tiny(), world_size, recipe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    acc = Accumulator(model, optimizer, accumulation_steps=PER_WINDOW, sync_policy=policy)
    return model, optimizer, acc


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def train(acc: Any, rank: int, start: int, stop: int) -> None:
    for index in range(start, stop):
        acc.micro_step(micro_batch(rank, index), masked_loss)
    if stop == STEPS:
        acc.flush()


def resume_worker(rank: int, world_size: int, recipe: str, mode: str, path: str) -> Any:
    from gradaccum import load_checkpoint, save_checkpoint

    torch.manual_seed(rank)
    model, optimizer, acc = build(world_size, recipe)
    if mode == "reference":
        train(acc, rank, 0, STEPS)
        return full(model)
    if mode == "kill":
        train(acc, rank, 0, KILL_AFTER + 1)  # mid-window: 2 of the second window's 3
        save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc,
                        extra={"next": KILL_AFTER + 1})  # fmt: skip
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    kept = acc if mode == "resume" else None  # "forget": the window's progress left behind
    extra = load_checkpoint(path, model=model, optimizer=optimizer, accumulator=kept,
                            restore_rng=True)  # fmt: skip
    assert extra is not None
    train(acc, rank, extra["next"], STEPS)
    return full(model)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("recipe", "world_size"), [("blocks+root", 2), ("root", 2), ("blocks+root", 4)]
)
def test_sigkill_mid_window_then_resume_is_bitwise_the_uninterrupted_run(
    tmp_path: Path, recipe: str, world_size: int
) -> None:
    path = str(tmp_path / "ckpt")
    run = {"world_size": world_size, "timeout": 150.0, "pg_timeout": 60.0}
    reference = run_ranks(resume_worker, tmp_path / "a", recipe, "reference", path, **run)
    killed = spawn_ranks(resume_worker, tmp_path / "b", recipe, "kill", path, **run)
    assert all(o.exitcode == -signal.SIGKILL for o in killed), [o.exitcode for o in killed]
    files = sorted(p.name for p in Path(path).glob("rank*.pt"))
    assert files == [f"rank{r}.pt" for r in range(world_size)]
    resumed = run_ranks(resume_worker, tmp_path / "c", recipe, "resume", path, **run)
    for rank in range(world_size):
        for name, value in reference[rank].items():
            assert torch.equal(resumed[rank][name], value), (rank, name)
    # NEGATIVE CONTROL: without the Accumulator's state the open window's progress is lost.
    forgot = run_ranks(resume_worker, tmp_path / "d", recipe, "forget", path, **run)
    gap = max((forgot[0][n] - v).abs().max().item() for n, v in reference[0].items())
    assert gap > 1e-3, gap


# ------------------------------------------------------------------ resharding at a boundary


def boundary_worker(rank: int, world_size: int, stage: str, path: str) -> Any:
    """Stage "save": window 1 on this many ranks; stage "load": window 2 after loading it."""
    from gradaccum import Accumulator, load_checkpoint, save_checkpoint

    model = shard(make_tiny(), world_size, "root")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=3, sync_policy="micro")
    if stage == "save":
        assert acc.step(_window(rank, world_size, window=0), masked_loss).stepped
        save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
        return full(model)
    load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    loaded = full(model)
    assert acc.step(_window(rank, world_size, window=1), masked_loss).stepped
    return {"loaded": loaded, "after": full(model)}


def _window(rank: int, world_size: int, *, window: int) -> dict[str, torch.Tensor]:
    """This rank's part of a 2-rank run's window (on 1 rank: both ranks' parts)."""
    sources = [0, 1] if world_size == 1 else [rank]
    parts = [micro_batch(s, window * PER_WINDOW + i) for s in sources for i in range(PER_WINDOW)]
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def boundary_reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = make_tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    windows = [
        [micro_batch(s, w * PER_WINDOW + i) for s in (0, 1) for i in range(PER_WINDOW)]
        for w in range(2)
    ]
    first = kept_items_reference(model, optimizer, windows[:1])
    second = kept_items_reference(model, optimizer, windows[1:])
    return first, second


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, 1), (1, 2)])
def test_a_boundary_checkpoint_reshards(tmp_path: Path, saved_on: int, loaded_on: int) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(boundary_worker, tmp_path / "a", "save", path, world_size=saved_on,
                      timeout=120.0, pg_timeout=30.0)  # fmt: skip
    loaded = run_ranks(boundary_worker, tmp_path / "b", "load", path, world_size=loaded_on,
                       timeout=120.0, pg_timeout=30.0)  # fmt: skip
    first, second = boundary_reference()
    for got in loaded:
        for name, want in first.items():
            torch.testing.assert_close(saved[0][name], want, **EXACT)
            assert torch.equal(got["loaded"][name], saved[0][name]), name  # resharded as saved
            torch.testing.assert_close(got["after"][name], second[name], **EXACT, msg=name)


# ------------------------------------------------------------------ refusals and crash safety


def refusal_worker(rank: int, world_size: int, case: str, path: str) -> Any:
    from gradaccum import CheckpointError, load_checkpoint, save_checkpoint

    if case == "mid-window save on 2":
        model, optimizer, acc = build(world_size, "root")
        train(acc, rank, 0, KILL_AFTER + 1)
        save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
        return None
    if case == "load on 1":
        model, optimizer, acc = build(world_size, "root")
        before = full(model)
        try:
            load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
        except CheckpointError as error:
            unchanged = all(torch.equal(v, full(model)[n]) for n, v in before.items())
            return {"message": str(error), "unchanged": unchanged}
        return {"message": "", "unchanged": None}
    model, optimizer, acc = build(world_size, "root", policy="window")  # case "window policy"
    acc.micro_step(micro_batch(rank, 0), masked_loss)
    try:
        save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.timeout(240)
def test_mid_window_reshard_and_window_policy_saves_are_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(refusal_worker, tmp_path / "a", "mid-window save on 2", path,
              timeout=120.0, pg_timeout=30.0)  # fmt: skip
    (refused,) = run_ranks(refusal_worker, tmp_path / "b", "load on 1", path, world_size=1,
                           timeout=120.0, pg_timeout=30.0)  # fmt: skip
    assert "resume it on 2 ranks" in refused["message"], refused
    assert "save at a window boundary" in refused["message"]
    assert refused["unchanged"]
    other = str(tmp_path / "other")
    messages = run_ranks(refusal_worker, tmp_path / "c", "window policy", other,
                         timeout=120.0, pg_timeout=30.0)  # fmt: skip
    for message in messages:
        assert "sync_policy='micro'" in message, message
        assert "save at a window boundary" in message
    assert not Path(other).exists()  # refused before anything was written


def crash_worker(rank: int, world_size: int, stage: str, path: str, die_at: int) -> Any:
    """Save A; then (stage "crash") train on and die at the `die_at`-th rename of a save."""
    from gradaccum import _sharded_checkpoint as sharded
    from gradaccum import load_checkpoint, save_checkpoint

    model, optimizer, acc = build(world_size, "root")
    if stage == "load":
        load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
        return full(model)
    train(acc, rank, 0, PER_WINDOW)
    save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    saved = full(model)
    train(acc, rank, PER_WINDOW, 2 * PER_WINDOW)
    renames = [0]
    real = sharded.os.replace

    def dying_replace(src: Any, dst: Any) -> None:
        renames[0] += 1
        if renames[0] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real(src, dst)

    sharded.os.replace = dying_replace  # type: ignore[assignment]
    if rank == 0:
        torch.save(saved, Path(path).parent / "saved.pt")
    dist.barrier()
    save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    return None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("die_at", [1, 2], ids=["before moving the old", "before the rename"])
def test_a_save_killed_midway_loses_nothing(tmp_path: Path, die_at: int) -> None:
    path = str(tmp_path / "ckpt")
    spawn_ranks(crash_worker, tmp_path / "a", "crash", path, die_at,
                timeout=120.0, pg_timeout=10.0)  # fmt: skip
    saved = torch.load(tmp_path / "saved.pt")
    loaded = run_ranks(crash_worker, tmp_path / "b", "load", path, die_at,
                       timeout=120.0, pg_timeout=30.0)  # fmt: skip
    for got in loaded:
        for name, value in saved.items():
            assert torch.equal(got[name], value), name
