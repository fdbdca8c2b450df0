"""Smoke test of benchmarks/peers.py: `--quick` runs in a subprocess and its tables hold up.

Needs the `bench` extra (Hugging Face Accelerate and Lightning); skipped without it. No time is
asserted. What is checked: the run exits 0, prints its command line and both tables with a row
per model and contender; every contender takes the hand loop's step; gradaccum's two drives are
exact on ragged token micro-batches (gap < 1e-10, 3 optimizer steps) while a peer's per-micro-batch
token mean is not (so the comparison can fail); the memory figures are measurements.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "peers.py"
CONTENDERS = ("gradaccum step", "gradaccum micro_step", "hand", "accelerate", "fabric")
MISSING = [name for name in ("accelerate", "lightning") if importlib.util.find_spec(name) is None]

pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"needs the bench extra ({', '.join(MISSING)} not installed)"
)


@pytest.mark.timeout(420)
def test_peers_quick_prints_tables_and_gradaccum_is_exact(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("command: ")
    assert "--quick" in proc.stdout.splitlines()[0]
    assert "Table 1: time and memory" in proc.stdout
    assert "Table 2: exactness on ragged token micro-batches" in proc.stdout
    for model in ("cnn", "lm"):
        for name in CONTENDERS:
            row = rf"^{model}\s+{re.escape(name)}\s+\d+\.\d+\s+\d+\.\d+\s"
            assert re.search(row, proc.stdout, re.M), (model, name)
    assert re.search(r"^gradaccum step\s+LossSum.*\bexact$", proc.stdout, re.M)

    figures = json.loads(out.read_text())
    assert figures["settings"]["threads"] == 1
    for model, result in figures["results"].items():
        for name in CONTENDERS:
            row = result["contenders"][name]
            assert row["update_gap_vs_hand"] < 1e-10, (model, name)  # all take the same step
            assert row["step_s_median"] > 0
            assert row["tensor_peak_bytes"] > 0
            assert row["rss_growth_bytes"] is None or row["rss_growth_bytes"] > 0
    rows = figures["exactness"]["rows"]
    for name in ("gradaccum step", "gradaccum micro_step"):
        assert rows[name]["optimizer_steps"] == 3
        assert rows[name]["param_gap"] < 1e-10, rows[name]
        assert rows[name]["param_gap_worst_tensor"] < 1e-10, rows[name]
        assert rows[name]["grad_gap_window_1"] < 1e-10, rows[name]
    # Negative control: a per-micro-batch token mean over ragged micro-batches is visibly off.
    assert rows["accelerate, token mean"]["param_gap"] > 1e-6
    assert rows["fabric, token mean / 4"]["param_gap"] > 1e-6


def test_peers_rejects_bad_repeats() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--repeats" in proc.stderr
