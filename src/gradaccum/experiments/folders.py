"""Run folders: where results are written, and what stays behind when a run stops early.

A folder is checked before any work (`check_out_dir`): new or empty, or holding only a previous
result that may be replaced. `gradaccum train` and `compare` write into it (`run_folder`: after an
error it stays only if it holds a checkpoint to resume from; `stop_on_signals` turns the first
SIGTERM or SIGINT into a request the runner polls at every micro-batch, to stop with a
checkpoint). `gradaccum demo` writes into a staging folder that replaces it only when complete
(`staged_out_dir`). The errors are `FolderError`, one line naming the folder as `--out`.

Example:
    >>> default_out_dir("train", "digits").name.startswith("train-digits-")
    True
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path


class FolderError(ValueError):
    """A results folder cannot be used; the message says why (the command line exits 2)."""


def default_out_dir(command: str, task: str) -> Path:
    """`runs/<command>-<task>-<YYYYmmdd-HHMMSS>`, with a numeric suffix if that exists."""
    stem = Path("runs") / f"{command}-{task}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, suffix = stem, 1
    while os.path.lexists(candidate):
        suffix += 1
        candidate = stem.with_name(f"{stem.name}-{suffix}")
    return candidate


def check_out_dir(path: Path, *, replaceable: Collection[str] = ()) -> None:
    """Check that results can be written to `path`, creating nothing.

    Args:
        path: The `--out` folder: new, empty, or holding a previous result.
        replaceable: The names the command writes, when its result replaces the folder whole
            (`staged_out_dir`): a folder of exactly these, all of them, is a previous result. A
            folder holding some only (a `runs/` of `gradaccum train` runs) is someone else's.

    Raises:
        FolderError: If `path` is not a folder, holds other entries, cannot be written, or is to
            be replaced whole while it holds the current directory.
    """
    here = Path.cwd()
    if replaceable and path.resolve() in (here, *here.parents):  # no rename of "." or above it
        raise FolderError(
            f"--out {path}: the results replace this folder whole, and it holds the current "
            "directory; choose a new folder, e.g. a sub-folder"
        )
    if os.path.lexists(path):
        if not path.is_dir():
            raise FolderError(f"--out {path}: exists and is not a directory")
        entries = sorted(entry.name for entry in path.iterdir())
        foreign = [name for name in entries if name not in replaceable]
        if foreign or (entries and set(entries) != set(replaceable)):
            shown = foreign or entries
            raise FolderError(
                f"--out {path}: directory is not empty ({', '.join(shown[:3])}"
                f"{', ...' if len(shown) > 3 else ''}); choose a new or empty folder"
            )
        _probe(path, f"--out {path}: directory is not writable")
        if replaceable:
            _probe(path.resolve().parent, f"--out {path}: its parent is not writable")
        return
    ancestor = path.absolute().parent
    while not os.path.lexists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise FolderError(f"--out {path}: cannot create it, {ancestor} is not a directory")
    _probe(ancestor, f"--out {path}: cannot create it in {ancestor}")


def check_not_resumable(out: Path | None, marker: str, command: str, what: str) -> None:
    """Refuse an `--out` that holds `what` of `gradaccum COMMAND` (its `marker` file): resume it.

    Raises:
        FolderError: Naming `gradaccum COMMAND --resume OUT`.
    """
    if out is not None and (out / marker).is_file():
        raise FolderError(
            f"--out {out}: holds {what} of `gradaccum {command}`; continue it with: gradaccum "
            f"{command} --resume {shlex.quote(str(out))} (or choose a new folder)"
        )


def check_resume_dir(folder: Path) -> None:
    """Refuse a `--resume` that is not a folder, saying whether it is missing or a file."""
    if not folder.is_dir():
        raise FolderError(
            f"--resume {folder}: {'not a' if folder.exists() else 'no such'} directory"
        )


def _probe(folder: Path, failure: str) -> None:
    """Create and remove a folder in `folder`: permission bits miss `/proc`, read-only mounts."""
    try:
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
        os.rmdir(tempfile.mkdtemp(prefix=".gradaccum-probe-", dir=folder))
    except OSError as error:
        raise FolderError(f"{failure} ({error.strerror or error})") from None


def _created_by(path: Path) -> list[Path]:
    """The folders that creating `path` will create, innermost first."""
    absolute = path.absolute()
    return [folder for folder in (absolute, *absolute.parents) if not folder.exists()]


@contextlib.contextmanager
def _usage_error(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as error:
        raise FolderError(f"--out {path}: cannot create it ({error.strerror or error})") from None


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


@contextlib.contextmanager
def staged_out_dir(path: Path, *, replaceable: Collection[str] = ()) -> Iterator[Path]:
    """Yield a hidden staging folder; when the block succeeds it takes the place of `path`.

    On any exception (KeyboardInterrupt too) the staging folder and the parents made for it are
    removed and `path` is left as it was. A `path` holding only `replaceable` entries is replaced.
    """
    parent = path.absolute().parent
    created = _created_by(parent)
    staging: Path | None = None
    try:
        with _usage_error(path):  # what check_out_dir could not foresee
            parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=parent))
        mask = os.umask(0)
        os.umask(mask)
        staging.chmod(0o777 & ~mask)  # mkdtemp made it private; give it a folder's usual mode
        yield staging
        with _usage_error(path):  # a failed rename leaves `path` as it was, and nothing beside
            if path.is_dir() and any(path.iterdir()):  # a previous result check_out_dir allowed
                aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=staging.parent))
                previous = aside / "previous"
                try:
                    os.replace(path, previous)
                    try:
                        os.replace(staging, path)
                    except OSError:
                        os.replace(previous, path)
                        raise
                except OSError:
                    if not os.path.lexists(previous):  # else it could not be put back: kept
                        aside.rmdir()
                    raise
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(staging, path)
        staging = None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
            _remove_empty(created)


@contextlib.contextmanager
def run_folder(path: Path, *, keep_if: str) -> Iterator[Path]:
    """Create `path` (checked by `check_out_dir`, or a run's own folder) and yield it.

    On any exception the folder stays if a file named `keep_if` is anywhere in it (a checkpoint
    to resume from); otherwise what was created here is removed.
    """
    created = _created_by(path)
    with _usage_error(path):  # what check_out_dir could not foresee
        path.mkdir(parents=True, exist_ok=True)
    existing = {entry.name for entry in path.iterdir()}
    try:
        yield path
    except BaseException:
        if not any(path.rglob(keep_if)):
            for entry in path.iterdir():
                if entry.name in existing:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            _remove_empty(created)
        raise


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt, so cleanup code runs (main thread)."""
    if not _main_thread():
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

    The run polls it at every micro-batch boundary. A second signal raises KeyboardInterrupt at
    once. The previous handlers are restored afterwards (main thread only; elsewhere a no-op).
    """
    request = StopRequest()
    if not _main_thread():
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
