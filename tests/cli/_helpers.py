"""Shared helpers of the command-line tests: run `gradaccum` in a subprocess, read its files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The columns of every metrics.jsonl row (one per optimizer step).
METRIC_COLUMNS = {
    "step",
    "samples",
    "loss",
    "lr",
    "grad_norm",
    "time",
    "micro_batches",
    "noise_scale",
}


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run `python -m gradaccum.cli ARGS` and return the finished process (never raises on exit)."""
    return subprocess.run(
        [sys.executable, "-m", "gradaccum.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
    )


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra`, with the repository root first on PYTHONPATH.

    `python -m tests.cli.signal_at` finds the `tests` package through the working directory only
    when pytest runs from the repository root; with the root on PYTHONPATH it does from anywhere.
    """
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(paths)}


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file, blank lines skipped."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# The columns of a compare table on digits, as the user reads them (not taken from the code).
DIGITS_TABLE_COLUMNS = [
    "config",
    "effective batch",
    "micro-batch",
    "steps",
    "best accuracy",
    "final accuracy",
    "peak memory",
    "samples/s",
    "wall time",
]
