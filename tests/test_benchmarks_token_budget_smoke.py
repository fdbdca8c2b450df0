"""Smoke test of benchmarks/token_budget.py: it runs, and its token budget pads less."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# About 4 s on a quiet 2-core machine, 45 s with two busy processes beside it: the timeouts only
# bound a hang and leave a loaded CI machine ample room.
@pytest.mark.timeout(270)
def test_token_budget_benchmark_runs_and_pads_less() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "token_budget.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    padding = [float(p) for p in re.findall(r"(\d+\.\d)%", proc.stdout)]
    assert len(padding) == 2
    assert padding[1] < padding[0]  # sorted and packed rows pad less than rows in data order
    assert re.search(r"speed-up of the token budget: \d+\.\d\dx", proc.stdout)
