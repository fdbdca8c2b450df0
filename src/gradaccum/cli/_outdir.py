"""Where the commands write their results, and how they avoid leaving half-written ones.

A command checks `--out` with `check_out_dir` before doing any work, then writes into the hidden
staging folder of `staged_out_dir`, which takes the place of `--out` only when the command
succeeds. On an error or an interrupt (`terminate_as_interrupt` turns SIGTERM into one) the
staging folder is removed, so nothing half-written stays behind.

`--out` must be new or an empty folder. A command may also name the files it writes
(`replaceable`): a folder holding nothing else (its previous results) is then replaced as a whole,
once the new results are complete.

Example:
    >>> default_out_dir("train", "digits").name.startswith("train-digits-")
    True
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path

from gradaccum.cli import UsageError

__all__ = [
    "check_out_dir",
    "default_out_dir",
    "resolve_out_dir",
    "staged_out_dir",
    "terminate_as_interrupt",
]


def default_out_dir(command: str, task: str) -> Path:
    """`runs/<command>-<task>-<YYYYmmdd-HHMMSS>`, with a numeric suffix if that exists."""
    stem = Path("runs") / f"{command}-{task}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, suffix = stem, 1
    while os.path.lexists(candidate):
        suffix += 1
        candidate = stem.with_name(f"{stem.name}-{suffix}")
    return candidate


def resolve_out_dir(out: Path | None, command: str, task: str) -> Path:
    """`--out`, or `default_out_dir(command, task)` without it, checked with `check_out_dir`.

    Raises:
        UsageError: If the folder cannot be used (see `check_out_dir`).
    """
    path = default_out_dir(command, task) if out is None else out
    check_out_dir(path)
    return path


def check_out_dir(path: Path, *, replaceable: Collection[str] = ()) -> None:
    """Check that results can be written to `path`, without creating anything.

    `path` must be a folder that is empty or holds only `replaceable` entries, or not exist and
    have a writable folder as its nearest existing ancestor (missing folders in between are
    created later).

    Args:
        path: The `--out` folder.
        replaceable: Names of the entries the command writes; a folder holding only these is a
            previous run's results, which `staged_out_dir` replaces.

    Raises:
        UsageError: If `path` exists and is not a folder, holds other entries, or cannot be
            created or written.
    """
    if os.path.lexists(path):
        if not path.is_dir():
            raise UsageError(f"--out {path}: exists and is not a directory")
        foreign = sorted(entry.name for entry in path.iterdir() if entry.name not in replaceable)
        if foreign and not replaceable:
            raise UsageError(f"--out {path}: directory is not empty; choose a new folder")
        if foreign:
            raise UsageError(
                f"--out {path}: holds files this command did not write ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new folder"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"--out {path}: directory is not writable")
        parent = path.resolve().parent
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(
                f"--out {path}: its parent {parent} is not writable, so results cannot be "
                "moved into place"
            )
        return
    ancestor = path.absolute().parent
    while not os.path.lexists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"--out {path}: cannot create it, {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: cannot create it, {ancestor} is not writable")


@contextlib.contextmanager
def staged_out_dir(path: Path, *, replaceable: Collection[str] = ()) -> Iterator[Path]:
    """Yield a hidden staging folder next to `path`; on success it takes the place of `path`.

    On any exception (including KeyboardInterrupt) the staging folder and any parent folders
    created for it are removed, `path` is left as it was, and the exception propagates.

    Args:
        path: The final folder, already checked with `check_out_dir`.
        replaceable: As for `check_out_dir`: if `path` holds only these entries when the results
            are complete, it is moved aside and deleted once the staging folder is in its place.
            Any other non-empty `path` is never overwritten (the final rename fails instead).
    """
    parent = path.absolute().parent
    created = [folder for folder in (parent, *parent.parents) if not folder.exists()]
    staging: Path | None = None
    done = False
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=parent))
        staging.chmod(0o777 & ~_umask())  # mkdtemp made it private; give it a folder's usual mode
        yield staging
        _move_into_place(staging, path, replaceable)
        done = True
    finally:
        if not done:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            for folder in created:  # innermost first
                with contextlib.suppress(OSError):
                    folder.rmdir()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt, so cleanup code runs.

    Python's default SIGTERM ends the process at once, which would leave a staging folder
    behind. Only the main thread can install handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _move_into_place(staging: Path, path: Path, replaceable: Collection[str]) -> None:
    """Rename `staging` to `path`; previous results in `path` are moved aside, then deleted."""
    previous = (
        bool(replaceable)
        and path.is_dir()
        and any(path.iterdir())
        and all(entry.name in replaceable for entry in path.iterdir())
    )
    if not previous:
        os.replace(staging, path)  # also replaces an empty `path` folder, and nothing else
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=staging.parent))
    try:
        os.replace(path, aside / "results")
        try:
            os.replace(staging, path)
        except OSError:
            os.replace(aside / "results", path)
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
