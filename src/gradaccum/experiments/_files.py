"""The run folder's files: `metrics.jsonl` cut back to a checkpoint, and atomic text writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

__all__ = ["open_metrics", "truncate_metrics", "write_text_atomic"]


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the lines of `path` up to step `last_step`; drop later and torn lines.

    A run killed after its last checkpoint may have logged later steps, and a kill in the middle
    of a write leaves a torn last line; the resumed run logs those steps again. The file is
    rewritten atomically, and created empty if it is missing.

    Args:
        path: The run's `metrics.jsonl`.
        last_step: The checkpoint's completed optimizer steps.

    Returns:
        The number of lines kept.
    """
    kept: list[str] = []
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines(keepends=True):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # a torn line: only the last can be, and everything after it is later
        if not line.endswith("\n") or not isinstance(row, dict):
            break
        if isinstance(row.get("step"), int) and row["step"] <= last_step:
            kept.append(line)
    new_text = "".join(kept)
    if new_text != text or not path.exists():
        write_text_atomic(path, new_text)
    return len(kept)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file, fsync and rename."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def open_metrics(path: Path, *, resume_step: int | None) -> IO[str]:
    """Open `metrics.jsonl` line-buffered: new, or (resuming) cut to `resume_step` and appended."""
    if resume_step is None:
        return path.open("w", buffering=1)
    truncate_metrics(path, resume_step)
    return path.open("a", buffering=1)
