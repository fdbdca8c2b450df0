"""Checkpoints of FSDP2 models: a `torch.distributed.checkpoint` (DCP) folder, one shard per rank.

`save_checkpoint`/`load_checkpoint` come here when the model is sharded (`fully_shard`). The
checkpoint is a folder:

- the model and optimizer states, through DCP (`get_state_dict`/`set_state_dict`): each rank
  writes its own shards, and DCP reshards them on load when the number of ranks changed;
- `rank{r}.pt`, one small file per rank: that rank's `Accumulator` state (an open window's
  gradient shards and counts), scheduler state, the `extra` data, its RNG states and the class
  names, written with `torch.save` and read with `weights_only=True`.

Crash safety: every rank writes into a staging folder next to the target; once all are done
(a barrier), rank 0 moves the old checkpoint aside, renames the staging folder to the target and
deletes the old one, fsyncing the parent folder. An interrupted save leaves the previous
checkpoint loadable, under its name or, if the rename itself was cut short, under `<name>.old`,
which `load_checkpoint` falls back to.

Resharding: a checkpoint saved at a window boundary loads on any number of ranks (the
accumulator's counters are the same on every rank then). One saved mid-window holds each rank's
own partial gradient shards and counts, and loads only on as many ranks as saved it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradaccum._checkpoint_fit import default_scheduler, scheduler_kind
from gradaccum._dtensor import local_shards
from gradaccum._plain_state import plain_numbers
from gradaccum._rng_state import capture_rng, checked_rng

__all__ = ["fsync_folder", "load_sharded", "save_sharded"]

_FORMAT = "gradaccum-sharded-checkpoint"
_VERSION = 1


def save_sharded(
    target: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    accumulator: Any,
    scheduler: Any,
    extra: dict[str, Any] | None,
) -> None:
    """Write an FSDP2 checkpoint folder at `target` (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    rank, world = dist.get_rank(), dist.get_world_size()
    accumulator_state = None if accumulator is None else accumulator.state_dict()  # may refuse
    staging = target.with_name(f".{target.name}.staging")
    if rank == 0 and staging.exists():
        shutil.rmtree(staging)  # a save that was interrupted before
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(staging))
    own = {
        "format": _FORMAT,
        "version": _VERSION,
        "rank": rank,
        "world": world,
        "accumulator": local_shards(accumulator_state),
        "open_window": bool(
            accumulator_state and accumulator_state["engine"]["window"].get("micro_batches")
        ),
        "optimizer_class": type(optimizer).__name__,
        "scheduler": None if scheduler is None else plain_numbers(scheduler.state_dict()),
        "scheduler_class": None if scheduler is None else scheduler_kind(scheduler),
        "extra": extra,
        "rng": capture_rng(),
    }
    with open(staging / f"rank{rank}.pt", "wb") as handle:
        torch.save(own, handle)
        handle.flush()
        os.fsync(handle.fileno())
    dist.barrier()  # every shard and rank file is on disk before the swap
    if rank == 0:
        old = target.with_name(f"{target.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if target.exists():
            os.replace(target, old)
        os.replace(staging, target)
        fsync_folder(target.parent)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()


def load_sharded(
    source: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    accumulator: Any,
    scheduler: Any,
    restore_rng: bool,
    error: type[Exception],
) -> dict[str, Any] | None:
    """Read an FSDP2 checkpoint folder into the objects (every rank calls it); checks first.

    Raises:
        FileNotFoundError: If there is no checkpoint folder at `source` (nor its `.old`).
        error: If the folder is damaged or does not fit; nothing has changed then.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    folder = _existing(source)
    rank, world = dist.get_rank(), dist.get_world_size()
    own = _read_rank_file(folder, rank, world, error)
    if own["optimizer_class"] != type(optimizer).__name__:
        raise error(
            f"{folder} holds the state of a {own['optimizer_class']} optimizer, not of a "
            f"{type(optimizer).__name__}; build the optimizer it was saved from."
        )
    scheduler = default_scheduler(accumulator, own) if scheduler is None else scheduler
    for name, wanted in (("accumulator", accumulator), ("scheduler", scheduler)):
        if wanted is not None and own.get(name) is None:
            raise error(f"{folder} holds no {name} state; pass {name}=None.")
    rng = None
    if restore_rng:
        try:
            rng = checked_rng(own["rng"])
        except Exception as failure:
            raise error(f"{folder} holds damaged RNG states ({failure}).") from failure
    # Loaded into copies, so that a checkpoint that does not fit changes nothing.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    loaded = {"model": _empty_like(model_state), "optimizer": _empty_like(optimizer_state)}
    try:
        load(loaded, checkpoint_id=str(folder))
    except Exception as failure:  # DCP reports missing keys and shape mismatches many ways
        raise error(f"{folder} does not fit this model and optimizer: {failure}") from failure
    if accumulator is not None:
        try:
            accumulator.load_state_dict(own["accumulator"])
        except ValueError as failure:
            raise error(f"{folder} does not fit the Accumulator: {failure}") from failure
    set_state_dict(
        model,
        optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optimizer"],
    )
    if scheduler is not None:
        scheduler.load_state_dict(own["scheduler"])
    if rng is not None:
        rng.restore()
    extra: dict[str, Any] | None = own["extra"]
    return extra


def _existing(source: Path) -> Path:
    if source.is_dir():
        return source
    old = source.with_name(f"{source.name}.old")
    if old.is_dir():  # a save was cut short between moving the old checkpoint and the rename
        return old
    raise FileNotFoundError(f"no checkpoint at {source}")


def _read_rank_file(folder: Path, rank: int, world: int, error: type[Exception]) -> Any:
    """This rank's file; at a window boundary, rank 0's serves any number of ranks."""
    first = _load(folder / "rank0.pt", error)
    saved_world = int(first["world"])
    if saved_world == world:
        return first if rank == 0 else _load(folder / f"rank{rank}.pt", error)
    if first["open_window"]:
        raise error(
            f"{folder} was saved in the middle of an accumulation window on {saved_world} ranks, "
            f"which holds each rank's own partial gradients; resume it on {saved_world} ranks, "
            "or save at a window boundary (after a step) to load on "
            f"{world} ranks."
        )
    return first


def _load(path: Path, error: type[Exception]) -> Any:
    if not path.is_file():
        raise error(f"{path.parent} is incomplete: it lacks {path.name}.")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as failure:  # damaged bytes fail deep in the unpickler, in many ways
        raise error(f"cannot read {path}: it is truncated or corrupted ({failure}).") from failure
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise error(f"{path} is not part of a gradaccum sharded checkpoint.")
    if payload.get("version") != _VERSION:
        raise error(f"{path} has version {payload.get('version')!r}; this reads {_VERSION}.")
    return payload


def _empty_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {key: _empty_like(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_empty_like(value) for value in state]
    return state


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable: its entry is on disk once the folder is synced."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
