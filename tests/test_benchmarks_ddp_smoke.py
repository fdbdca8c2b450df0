"""Smoke test of benchmarks/ddp.py: `--quick` on 2 real gloo ranks, in a subprocess with a timeout.

No time is asserted. The communication counts are: with the sync control (gradaccum, or the hand
loop with `no_sync`) one synchronizing backward per window; without it (the negative control) one
per micro-batch, carrying N times the bytes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "ddp.py"


# About 6 s on a quiet 2-core machine, but 27-31 s with two busy processes beside it (3 gloo
# processes share the cores, and every collective waits for the slowest rank): the timeouts
# only bound a hang, so they leave a loaded CI machine ample room.
@pytest.mark.timeout(300)
def test_ddp_benchmark_quick_runs_and_counts_reductions(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for n in (1, 4):
        for loop in ("gradaccum", "hand, no_sync", "hand, sync each"):
            assert re.search(rf"^\s*{n}\s+{re.escape(loop)}\s+\d+\.\d+", proc.stdout, re.M), loop
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"1", "4"}
    for n, entry in summary.items():
        rows = entry["rows"]
        ours, no_sync, each = rows["gradaccum"], rows["hand, no_sync"], rows["hand, sync each"]
        assert ours["syncs"] == no_sync["syncs"] == 1
        assert ours["allreduces"] >= 1
        assert no_sync["allreduces"] >= 1
        assert ours["allreduce_bytes"] == no_sync["allreduce_bytes"]  # every gradient once
        assert each["syncs"] == int(n)  # negative control: a reduction per micro-batch
        assert each["allreduce_bytes"] == int(n) * ours["allreduce_bytes"]
        # The window's counts, exchanged once; the step's agreement (an integer all-reduce), once.
        assert ours["other"] == {"all_gather": 1, "all_reduce": 1}, ours["other"]
        assert ours["ms_median"] > 0
        # The three loops take the same step (float32 rounding only).
        assert entry["update_gap"] < 1e-4
    assert (
        summary["4"]["rows"]["hand, sync each"]["allreduces"]
        > summary["4"]["rows"]["gradaccum"]["allreduces"]
    )


def test_ddp_benchmark_rejects_bad_repeats() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--repeats" in proc.stderr
