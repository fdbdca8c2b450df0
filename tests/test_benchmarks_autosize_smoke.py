"""Smoke test of benchmarks/autosize.py: `--quick` runs in a subprocess and its figures hold up.

No time is asserted. What is checked: the run exits 0 and prints its three tables; each budget
really constrains the choice (1 < m < batch) and the plan fits it; the measured steady-state
tensor peak is close to the prediction and above the fixed part (parameters, gradients and
optimizer state alone), so the meter sees activations; the resident-memory subprocess reported a
positive growth. Bad options exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "autosize.py"


@pytest.mark.timeout(150)
def test_autosize_quick_runs_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "autosize.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for heading in (
        "| task | batch | budget | auto m | plan_micro_batch s |",
        "| task | auto m | budget | usable (less margin) | predicted | measured |",
        "| task | auto m | budget | predicted | RSS, threshold |",
        "| task | batch | auto m | samples/s auto |",
    ):
        assert heading in proc.stdout
    assert "chosen micro_batch_size =" in proc.stdout  # str(plan) is printed
    figures = json.loads(out.read_text())
    assert figures["settings"]["threads"] == 1
    results = figures["results"]
    assert set(results) == {"digits", "charlm"}
    for name, r in results.items():
        plan = r["plan"]
        assert 1 < r["m"] < r["batch_size"], name  # the budget constrains the choice
        fixed = sum(plan[f"{part}_bytes"] for part in ("parameters", "gradients", "optimizer"))
        fixed += plan["buffers_bytes"]
        assert r["predicted"] <= plan["memory_budget"] * (1 - plan["margin"])
        # The measured peak of a real step matches the plan, and it is far above what the
        # fixed part alone would read (so a meter missing the activations would fail here).
        assert abs(r["measured"] / r["predicted"] - 1) < 0.1, (name, r["measured"], r["predicted"])
        assert r["measured"] - fixed > 0.3 * r["measured"], name
        assert r["rss_threshold"] is None or r["rss_threshold"] > 0
        assert r["rss_auto_used"] in (None, r["m"])
        assert r["auto_used"] == r["m"]
        assert r["plan_s"] > 0
        assert r["samples_s_auto"] > 0
        assert r["samples_s_hand"] > 0


@pytest.mark.parametrize(
    ("option", "message"), [(["--tasks", "mnist"], "--tasks"), (["--repeats", "0"], "--repeats")]
)
def test_autosize_rejects_bad_options(option: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *option], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert message in proc.stderr
