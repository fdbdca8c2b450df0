"""Where the commands write their results, and what stays behind when a command stops early.

A command checks `--out` with `check_out_dir` before doing any work. Then:

- `compare` and `demo` write into the hidden staging folder of `staged_out_dir`, which takes the
  place of `--out` only when the command succeeds. On an error or an interrupt
  (`terminate_as_interrupt` turns SIGTERM into one) the staging folder is removed, so nothing
  half-written stays behind.
- `train` writes into `--out` itself (`resumable_out_dir`), because a stopped run must leave a
  folder that `--resume` can continue. `stop_on_signals` turns the first SIGTERM or SIGINT into a
  request to stop at the next micro-batch boundary (after writing a checkpoint); a second one
  raises KeyboardInterrupt at once. After an error or that second signal, the folder stays if it
  holds a checkpoint to resume from, and is removed otherwise.

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
    "StopRequest",
    "check_out_dir",
    "default_out_dir",
    "resolve_out_dir",
    "resumable_out_dir",
    "staged_out_dir",
    "stop_on_signals",
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
        _probe(path, f"--out {path}: cannot write in it")
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
    _probe(ancestor, f"--out {path}: cannot create it in {ancestor}")


def _probe(folder: Path, failure: str) -> None:
    """Create and remove an empty folder in `folder`; on failure raise `failure` and the reason.

    Permission bits do not tell everything (a root user in `/proc`, a read-only mount, a full
    disk): trying is the only sure check, and it leaves nothing behind.
    """
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gradaccum-probe-", dir=folder))
    except OSError as error:
        raise UsageError(f"{failure} ({error.strerror or error})") from None


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
        try:
            parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=parent))
        except OSError as error:  # what check_out_dir could not foresee
            raise UsageError(
                f"--out {path}: cannot create it ({error.strerror or error})"
            ) from None
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


class StopRequest:
    """Whether a stop was asked for: the name of the first signal received, or None."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def __bool__(self) -> bool:
        return self.signal is not None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Within the block, the first SIGTERM or SIGINT only sets the yielded `StopRequest`.

    The training loop polls it at every micro-batch boundary, writes a checkpoint and stops. A
    second signal (either one) raises KeyboardInterrupt at once, as Ctrl-C normally does. The
    previous handlers are restored afterwards. Only the main thread can install handlers;
    elsewhere the request is never set.
    """
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handle(signum: int, frame: object) -> None:
        if request.signal is not None:
            raise KeyboardInterrupt
        request.signal = signal.Signals(signum).name

    previous = {number: signal.signal(number, handle) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield request
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextlib.contextmanager
def resumable_out_dir(path: Path, *, keep_if: str) -> Iterator[Path]:
    """Create `path` (already checked with `check_out_dir`) and yield it; the run writes there.

    On any exception (including KeyboardInterrupt) the folder stays if it holds `keep_if` (a
    checkpoint the run can be resumed from). Otherwise everything created here is removed: the
    folder (or, if it existed empty, its contents) and the parent folders made for it.

    Args:
        path: The `--out` folder: new, or an existing empty folder.
        keep_if: Name of the file whose presence makes a stopped run worth keeping.
    """
    absolute = path.absolute()
    created = [folder for folder in (absolute, *absolute.parents) if not folder.exists()]
    try:
        absolute.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # what check_out_dir could not foresee
        raise UsageError(f"--out {path}: cannot create it ({error.strerror or error})") from None
    try:
        yield path
    except BaseException:
        if not (absolute / keep_if).exists():
            if absolute in created:
                shutil.rmtree(absolute, ignore_errors=True)
            else:
                for entry in absolute.iterdir():  # it was empty: everything in it is ours
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
            for folder in created[1:]:  # innermost first
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise


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
