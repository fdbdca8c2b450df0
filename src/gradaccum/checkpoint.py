"""Crash-safe checkpoints: atomic writes, loads that never run pickled code, RNG states included.

A checkpoint holds the model, optimizer, scheduler and `Accumulator` states (so a run resumes even
in the middle of a window), the user's `extra` (such as the data position), the class names of the
optimizer and scheduler, and the RNG states of Python, NumPy and torch (CPU and CUDA). It is
written to a temporary file in the same folder, fsynced, renamed over the target and the folder
fsynced, so a crash at any moment leaves either the old file or the new one under the real name,
never half of one. Loading compares each record's CRC-32 (a flipped bit is refused, not loaded),
uses `torch.load(weights_only=True)` and checks the whole file against the objects it is loaded
into before changing any of them.

For an FSDP2 model (`fully_shard`) the checkpoint is a folder written through
`torch.distributed.checkpoint`, each rank writing its own shards (`gradaccum._sharded_checkpoint`);
every rank calls both functions then.

The RNG states are always saved, but `load_checkpoint` restores them into the process-wide
generators only when asked (`restore_rng=True`), as a bitwise resume needs; a plain load leaves the
caller's random streams alone. The helpers that capture, check and restore them are in
`gradaccum._rng_state`.

Example:
    >>> import tempfile, torch
    >>> from gradaccum import save_checkpoint, load_checkpoint
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> path = tempfile.mkdtemp() + "/ckpt.pt"
    >>> save_checkpoint(path, model=model, optimizer=opt, extra={"epoch": 3})
    >>> load_checkpoint(path, model=model, optimizer=opt)
    {'epoch': 3}
    >>> load_checkpoint(path, model=model, optimizer=opt, restore_rng=True)  # to resume exactly
    {'epoch': 3}
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import torch

from gradaccum._atomic_file import write_atomically
from gradaccum._buffer_watch import observer_buffers
from gradaccum._checkpoint_fit import (
    CheckpointError,
    check_accumulator_targets,
    check_class,
    check_extra,
    check_intact,
    check_optimizer_fits,
    default_scheduler,
    one_line,
    scheduler_kind,
    strip_wrapper_prefixes,
    unwrapped,
)
from gradaccum._plain_state import check_stateful, plain_numbers, refuse_unreadable
from gradaccum._rng_state import RngStates, capture_rng, checked_rng
from gradaccum._sharded_checkpoint import load_sharded, save_sharded
from gradaccum._sync_base import is_fsdp
from gradaccum._window_registry import refuse_loading_under_open_window
from gradaccum.accumulator import Accumulator

__all__ = ["CheckpointError", "load_checkpoint", "load_model_weights", "save_checkpoint"]

_FORMAT = "gradaccum-checkpoint"
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_VERSION = 1


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    accumulator: Accumulator | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write a checkpoint atomically to `path`.

    The file also records the class names of `optimizer` and `scheduler` (so that a load into
    another kind refuses it) and the RNG states of Python, NumPy and torch.

    Args:
        path: Target file; its folder must exist.
        model: The model (its `state_dict`).
        optimizer: The optimizer.
        accumulator: The `Accumulator`, for an exact resume mid-window.
        scheduler: The learning-rate scheduler; by default the `accumulator`'s, if it has one.
        extra: Your own plain data: dicts, lists, tuples and sets of numbers, strings, bytes,
            tensors, dtypes and devices (what a `weights_only` load reads back).

    Raises:
        ValueError: If the folder of `path` does not exist, `path` is a folder (but for an
            FSDP2 model), `extra` holds another type (such as a numpy array: convert it with
            `torch.as_tensor` or `.tolist()`), or `optimizer` or `scheduler` is not the one
            `accumulator` steps; nothing is written then.
    """
    check_extra(extra)
    check_accumulator_targets(optimizer, accumulator, scheduler, "save")
    scheduler = default_scheduler(accumulator) if scheduler is None else scheduler
    check_stateful(scheduler)
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(
            f"cannot write checkpoint {target}: folder {target.parent} does not exist; create it "
            "first."
        )
    if target.is_dir() and not is_fsdp(model):  # else the rename fails, the file written
        raise ValueError(
            f"cannot write checkpoint {target}: it is a folder; give a file path, e.g. "
            f"{target / 'checkpoint.pt'}."
        )
    if is_fsdp(model):  # a DCP folder, each rank writing its own shards
        save_sharded(
            target,
            model=model,
            optimizer=optimizer,
            accumulator=accumulator,
            scheduler=scheduler,
            extra=extra,
        )
        return
    payload = {
        "format": _FORMAT,
        "version": _VERSION,
        "model": plain_numbers(unwrapped(model).state_dict()),  # wrapped or not, it loads
        "optimizer": plain_numbers(optimizer.state_dict()),  # an lr computed with NumPy...
        "optimizer_class": type(optimizer).__name__,
        "scheduler": None if scheduler is None else plain_numbers(scheduler.state_dict()),
        "scheduler_class": None if scheduler is None else scheduler_kind(scheduler),
        "accumulator": None if accumulator is None else accumulator.state_dict(),
        "extra": extra,
        "rng": capture_rng(),
    }
    write_atomically(target, payload, lambda written: refuse_unreadable(written, payload, target))


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    accumulator: Accumulator | None = None,
    scheduler: Any = None,
    restore_rng: bool = False,
    map_location: Any = "cpu",
) -> dict[str, Any] | None:
    """Restore a checkpoint written by `save_checkpoint`.

    Everything is checked before anything changes: the file (format, version, completeness), that
    the model state has this model's keys and shapes, that the optimizer state was saved from the
    same optimizer class with the same number of parameter groups and of parameters per group,
    that the scheduler state is of this scheduler's class and loads, the RNG states (with
    `restore_rng`) and last the accumulator state. On any error, `model`, `optimizer`,
    `scheduler`, `accumulator` and the RNGs are left as they were.

    The file always holds the RNG states of Python (`random`), NumPy (`np.random`) and torch
    (CPU and CUDA). Restoring them changes process-wide generators, so it is opt-in: pass
    `restore_rng=True` to resume a run bitwise (its data order, dropout masks and so on continue
    exactly); by default they are left untouched.

    Args:
        path: The checkpoint file.
        model: Receives the model state.
        optimizer: Receives the optimizer state.
        accumulator: Receives the accumulator state (the checkpoint must hold one).
        scheduler: Receives the scheduler state (the checkpoint must hold one); by default the
            `accumulator`'s, if it has one and the checkpoint holds a state of its class.
        restore_rng: Also set the global RNG states of Python, NumPy and torch (and of each CUDA
            device present, up to the number saved) to the saved ones.
        map_location: Where the file's tensors are read to, as `torch.load` takes it (a device,
            a string or a mapping); the default reads them to CPU memory, so a file written on
            a GPU loads on a machine without one. Each state then goes where its object lives
            (the model's and optimizer's parameters, the window's gradients). FSDP2 folders
            load in place, each rank to its own shards.

    Returns:
        The `extra` dict given to `save_checkpoint`.

    Raises:
        ValueError: If `optimizer` or `scheduler` is not the one `accumulator` steps, or
            another Accumulator over `model` has an open window (pass it as `accumulator`).
        FileNotFoundError: If there is no file at `path`.
        CheckpointError: If the file is truncated, corrupted, not a gradaccum checkpoint, of an
            unknown version, holds pickled code or damaged RNG states, lacks a requested state,
            or does not fit the model, optimizer, scheduler or accumulator given.
    """
    source = Path(path)
    check_accumulator_targets(optimizer, accumulator, scheduler, "load")
    if is_fsdp(model):
        refuse_loading_under_open_window(model, optimizer, accumulator)
        return load_sharded(
            source,
            model=model,
            optimizer=optimizer,
            accumulator=accumulator,
            scheduler=scheduler,
            restore_rng=restore_rng,
            error=CheckpointError,
        )
    payload = _read_payload(source, map_location)
    scheduler = default_scheduler(accumulator, payload) if scheduler is None else scheduler
    for name, wanted in (("accumulator", accumulator), ("scheduler", scheduler)):
        if wanted is not None and payload.get(name) is None:
            raise CheckpointError(f"{source} holds no {name} state; pass {name}=None.")
    missing = [
        key for key in ("model", "optimizer", "rng") if not isinstance(payload.get(key), dict)
    ]
    if missing:
        raise CheckpointError(f"{source} is incomplete: it lacks {', '.join(missing)}.")
    model, weights = unwrapped(model), payload["model"]
    weights = _check_model_fits(source, weights, model.state_dict(), observer_buffers(model))
    check_optimizer_fits(source, payload, optimizer)
    if scheduler is not None:
        _check_scheduler_fits(source, payload, scheduler, optimizer)
    rng = _checked_rng(source, payload["rng"]) if restore_rng else None
    refuse_loading_under_open_window(model, optimizer, accumulator)  # stale window gradients
    # Every other check is done; the accumulator checks its own state and changes nothing if it
    # refuses it, so it goes first of the changes.
    if accumulator is not None:
        try:
            accumulator.load_state_dict(payload["accumulator"])
        except ValueError as error:
            raise CheckpointError(f"{source} does not fit the Accumulator: {error}") from error
    model.load_state_dict(weights)
    optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(payload["scheduler"])
    if rng is not None:
        rng.restore()
    extra: dict[str, Any] | None = payload.get("extra")
    return extra


def load_model_weights(
    path: str | os.PathLike[str], model: torch.nn.Module, *, map_location: Any = "cpu"
) -> None:
    """Load only the model weights of a checkpoint, e.g. to fine-tune from it.

    The file is read and checked as `load_checkpoint` does; the model is unchanged on error. No
    RNG state is restored.

    Args:
        path: The checkpoint file.
        model: Receives the model state.
        map_location: Where the file's tensors are read to (`torch.load`'s); CPU by default.

    Raises:
        ValueError: If `optimizer` or `scheduler` is not the one `accumulator` steps.
        FileNotFoundError: If there is no file at `path`.
        CheckpointError: If the file is not a readable gradaccum checkpoint of this model.
    """
    source = Path(path)
    payload = _read_payload(source, map_location)
    if not isinstance(payload.get("model"), dict):
        raise CheckpointError(f"{source} is incomplete: it lacks model.")
    model = unwrapped(model)
    fits = _check_model_fits(source, payload["model"], model.state_dict(), observer_buffers(model))
    model.load_state_dict(fits)


def _read_payload(source: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """The checked payload of a checkpoint file (format and version), never unpickling code."""
    if source.is_dir():  # a run folder, or a sharded checkpoint, given for the file
        inside = [str(p) for p in sorted(source.glob("*.pt")) if p.is_file()]
        raise FileNotFoundError(
            f"no checkpoint at {source}: it is a folder; give a checkpoint file"
            + (
                f", e.g. {inside[0]}"
                if inside
                else " (folders hold FSDP2 models' sharded checkpoints)"
            )
        )
    if not source.is_file():
        raise FileNotFoundError(f"no checkpoint at {source}")
    check_intact(source)  # a zip archive whose records have the CRC-32 they were written with
    try:
        payload = torch.load(source, map_location=map_location, weights_only=True)
    except Exception as error:  # damaged bytes fail deep in the unpickler, in many ways
        refused = _REFUSED_GLOBAL.search(str(error))
        if refused:
            raise CheckpointError(
                f"cannot read checkpoint {source}: it holds a {refused.group(1)} object, which "
                "weights_only loading refuses (unpickling it could run code): in extra, or a "
                "NumPy number in an optimizer or scheduler state, which older versions wrote as "
                "is (save_checkpoint now writes them as numbers and refuses anything else); "
                "load the file with torch.load(weights_only=False) only if you trust its source."
            ) from error
        raise CheckpointError(
            f"cannot read checkpoint {source}: it is truncated, corrupted or holds objects that "
            f"weights_only loading refuses ({one_line(error)})."
        ) from error
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise CheckpointError(f"{source} is not a gradaccum checkpoint.")
    if payload.get("version") != _VERSION:
        raise CheckpointError(
            f"{source} has checkpoint version {payload.get('version')!r}; this gradaccum reads "
            f"version {_VERSION}."
        )
    return payload


_ARCHITECTURE = "load it into the architecture it was saved from"


def _check_model_fits(
    source: Path, saved: dict[str, Any], current: dict[str, Any], resizable: set[str]
) -> dict[str, Any]:
    """The saved model state, refused if its keys or tensor shapes differ from the model's.

    The `resizable` keys (quantization observers' buffers, which their modules resize on load:
    a fresh per-channel range is empty) may differ in shape.

    Files saved from a wrapped model by an older gradaccum carry its prefix on every key (the
    `_orig_mod.` of `torch.compile`, the `module.` of DDP); it is taken off.
    """
    saved = strip_wrapper_prefixes(saved, current.keys())
    if saved.keys() != current.keys():
        extra, absent = sorted(saved.keys() - current.keys()), sorted(current.keys() - saved.keys())
        raise CheckpointError(
            f"{source} holds a different model: keys only in the file {extra[:5]}, keys only in "
            f"the model {absent[:5]}; {_ARCHITECTURE}."
        )
    for key, tensor in current.items():
        if not isinstance(tensor, torch.Tensor):
            continue  # e.g. a module's `_extra_state`: the module checks it
        value = saved[key]
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{source} holds {key} as {type(value).__name__}, the model has a tensor; "
                f"{_ARCHITECTURE}."
            )
        if tuple(value.shape) != tuple(tensor.shape) and key not in resizable:
            raise CheckpointError(
                f"{source} holds {key} of shape {tuple(value.shape)}, the model has "
                f"{tuple(tensor.shape)}; {_ARCHITECTURE}."
            )
    return saved


def _check_scheduler_fits(
    source: Path, payload: dict[str, Any], scheduler: Any, optimizer: torch.optim.Optimizer
) -> None:
    """Refuse a scheduler state of another class, or one this scheduler cannot load.

    The load is tried on a copy of the scheduler (sharing the optimizer, which it does not
    change), so nothing real changes.
    """
    kind = scheduler_kind(scheduler)
    check_class(source, payload.get("scheduler_class"), scheduler, "scheduler", kind)
    state = payload["scheduler"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{source} holds a damaged scheduler state (not a dict).")
    base_lrs = state.get("base_lrs")
    if isinstance(base_lrs, list) and len(base_lrs) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{source} holds a scheduler state for {len(base_lrs)} param groups, the optimizer "
            f"has {len(optimizer.param_groups)}; build the optimizer with the same param groups "
            "as the run that saved it."
        )
    try:
        trial = copy.deepcopy(scheduler, memo={id(optimizer): optimizer})
    except Exception:  # a scheduler holding objects that cannot be copied: no trial load
        return
    try:
        trial.load_state_dict(dict(state))
    except Exception as error:
        raise CheckpointError(
            f"{source} holds a scheduler state that this {type(scheduler).__name__} cannot load "
            f"({one_line(error)}); build the scheduler the run that "
            "saved it used."
        ) from error


def _checked_rng(source: Path, state: dict[str, Any]) -> RngStates:
    """The saved RNG states, each tried on a fresh generator (the global ones stay untouched)."""
    try:
        return checked_rng(state)
    except Exception as error:
        raise CheckpointError(
            f"{source} holds damaged RNG states ({one_line(error)}); "
            "load it with restore_rng=False to keep the current ones."
        ) from error
