"""Crash-safe checkpoints: atomic writes, loads that never run pickled code, RNG states included.

A checkpoint holds the model, optimizer, scheduler and `Accumulator` states (so a run resumes even
in the middle of a window), the user's `extra` (such as the data position) and the RNG states of
Python, NumPy and torch. It is written to a temporary file in the same folder, fsynced, renamed
over the target and the folder fsynced, so a crash at any moment leaves either the old file or
the new one under the real name, never half of one. Loading uses `torch.load(weights_only=True)`.

Example:
    >>> import tempfile, torch
    >>> from gradaccum import save_checkpoint, load_checkpoint
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> path = tempfile.mkdtemp() + "/ckpt.pt"
    >>> save_checkpoint(path, model=model, optimizer=opt, extra={"epoch": 3})
    >>> load_checkpoint(path, model=model, optimizer=opt)
    {'epoch': 3}
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradaccum.accumulator import Accumulator

__all__ = ["CheckpointError", "load_checkpoint", "load_model_weights", "save_checkpoint"]

_FORMAT = "gradaccum-checkpoint"
_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint file is missing pieces, damaged, or of another format or version."""


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

    Args:
        path: Target file; its folder must exist.
        model: The model (its `state_dict`).
        optimizer: The optimizer.
        accumulator: The `Accumulator`, for an exact resume mid-window.
        scheduler: The learning-rate scheduler.
        extra: Your own plain data (numbers, strings, lists, dicts, tensors).
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(
            f"cannot write checkpoint {target}: folder {target.parent} does not exist."
        )
    payload = {
        "format": _FORMAT,
        "version": _VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "accumulator": None if accumulator is None else accumulator.state_dict(),
        "extra": extra,
        "rng": _capture_rng(),
    }
    _remove_stale_temporaries(target)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_folder(target.parent)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    accumulator: Accumulator | None = None,
    scheduler: Any = None,
) -> dict[str, Any] | None:
    """Restore a checkpoint written by `save_checkpoint`, RNG states included.

    Args:
        path: The checkpoint file.
        model: Receives the model state.
        optimizer: Receives the optimizer state.
        accumulator: Receives the accumulator state (the checkpoint must hold one).
        scheduler: Receives the scheduler state (the checkpoint must hold one).

    Returns:
        The `extra` dict given to `save_checkpoint`.

    Raises:
        FileNotFoundError: If there is no file at `path`.
        CheckpointError: If the file is truncated, corrupted, not a gradaccum checkpoint, of an
            unknown version, holds pickled code, or lacks a requested state.
    """
    source = Path(path)
    payload = _read_payload(source)
    for name, wanted in (("accumulator", accumulator), ("scheduler", scheduler)):
        if wanted is not None and payload.get(name) is None:
            raise CheckpointError(f"{source} holds no {name} state; pass {name}=None.")
    missing = [
        key for key in ("model", "optimizer", "rng") if not isinstance(payload.get(key), dict)
    ]
    if missing:
        raise CheckpointError(f"{source} is incomplete: it lacks {', '.join(missing)}.")
    _check_model_fits(source, payload["model"], model.state_dict())
    # Everything is checked before anything is restored; the accumulator checks its own state.
    if accumulator is not None:
        accumulator.load_state_dict(payload["accumulator"])
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(payload["scheduler"])
    _restore_rng(payload["rng"])
    return payload.get("extra")


def load_model_weights(path: str | os.PathLike[str], model: torch.nn.Module) -> None:
    """Load only the model weights of a checkpoint, e.g. to fine-tune from it.

    The file is read and checked as `load_checkpoint` does; the model is unchanged on error.

    Raises:
        FileNotFoundError: If there is no file at `path`.
        CheckpointError: If the file is not a readable gradaccum checkpoint of this model.
    """
    source = Path(path)
    payload = _read_payload(source)
    if not isinstance(payload.get("model"), dict):
        raise CheckpointError(f"{source} is incomplete: it lacks model.")
    _check_model_fits(source, payload["model"], model.state_dict())
    model.load_state_dict(payload["model"])


def _read_payload(source: Path) -> dict[str, Any]:
    """The checked payload of a checkpoint file (format and version), never unpickling code."""
    if not source.is_file():
        raise FileNotFoundError(f"no checkpoint at {source}")
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as error:  # damaged bytes fail deep in the unpickler, in many ways
        raise CheckpointError(
            f"cannot read checkpoint {source}: it is truncated, corrupted or holds objects that "
            f"weights_only loading refuses ({type(error).__name__}: {str(error)[:200]})."
        ) from error
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise CheckpointError(f"{source} is not a gradaccum checkpoint.")
    if payload.get("version") != _VERSION:
        raise CheckpointError(
            f"{source} has checkpoint version {payload.get('version')!r}; this gradaccum reads "
            f"version {_VERSION}."
        )
    return payload


def _check_model_fits(
    source: Path, saved: dict[str, Any], current: dict[str, torch.Tensor]
) -> None:
    if saved.keys() != current.keys():
        extra, absent = sorted(saved.keys() - current.keys()), sorted(current.keys() - saved.keys())
        raise CheckpointError(
            f"{source} holds a different model: keys only in the file {extra[:5]}, keys only in "
            f"the model {absent[:5]}; load it into the architecture it was saved from."
        )
    for key, tensor in current.items():
        if tuple(saved[key].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{source} holds {key} of shape {tuple(saved[key].shape)}, the model has "
                f"{tuple(tensor.shape)}; load it into the architecture it was saved from."
            )


def _capture_rng() -> dict[str, Any]:
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["position"],
            numpy["has_gauss"],
            numpy["gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _remove_stale_temporaries(target: Path) -> None:
    """Delete temporaries left by writers of `target` that were killed mid-write."""
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_alive(int(pid)):
            leftover.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True


def _fsync_folder(folder: Path) -> None:
    # The rename is durable only once the folder's entry is on disk.
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
