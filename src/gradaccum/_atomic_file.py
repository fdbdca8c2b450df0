"""Atomic checkpoint writes: a temporary in the same folder, fsynced, renamed over the target.

A crash at any moment leaves either the old file or the new one under the target's name, never
half of one. A temporary is named `.NAME.tmp-HOST-PID.TOKEN` after its writer, with a random
token per save, so saves of one target that overlap in one process (a background thread's save,
a signal handler's save landing in the middle of the loop's own) each write their own file and
each rename installs a whole checkpoint; the last to finish wins. The next save of the same
target deletes the temporaries of writers on this host that are no longer alive (killed
mid-write). On a filesystem shared by several hosts, another host's writer may be alive under a
pid that is free here, so its temporaries are left alone (older versions named them
`.NAME.tmp-HOST-PID` and `.NAME.tmp-PID`: the latter are taken for this host's).

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> target = Path(tempfile.mkdtemp()) / "ckpt.pt"
    >>> write_atomically(target, {"weight": torch.ones(2)})
    >>> sorted(p.name for p in target.parent.iterdir())
    ['ckpt.pt']
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gradaccum._sharded_checkpoint import fsync_folder

__all__ = ["write_atomically"]

_HOST = socket.gethostname()
# What follows `.NAME.tmp-`: `HOST-PID.TOKEN`, or from older versions `HOST-PID` and `PID`.
_WRITER = re.compile(r"(?:(?P<host>.*)-)?(?P<pid>[0-9]+)(?:\.[0-9a-f]{8})?")


def write_atomically(
    target: Path, payload: Any, check: Callable[[Path], None] | None = None
) -> None:
    """`torch.save(payload)` to `target` through a fsynced temporary renamed over it.

    Args:
        target: The file to write.
        payload: What `torch.save` writes.
        check: Called with the written temporary before the rename; what it raises leaves
            `target` as it was.

    Raises:
        OSError: If writing fails (a full disk...); the previous `target` is left intact and
            the temporary removed.
    """
    _remove_stale_temporaries(target)
    # One name per save: two saves sharing one (threads, a signal handler) wrote into the same
    # file, and the first rename installed the mix of both under the target's name.
    token = secrets.token_hex(4)
    temporary = target.with_name(f".{target.name}.tmp-{_HOST}-{os.getpid()}.{token}")
    try:
        with open(temporary, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if check is not None:
            check(temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_folder(target.parent)


def _remove_stale_temporaries(target: Path) -> None:
    """Delete temporaries of `target` left by writers on this host that are no longer alive."""
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        writer = _WRITER.fullmatch(leftover.name.removeprefix(f".{target.name}.tmp-"))
        if writer is None or writer["host"] not in (None, _HOST):
            continue
        if not _process_alive(int(writer["pid"])):
            leftover.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True
