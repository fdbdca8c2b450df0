"""Smoke tests of benchmarks/sweep.py and benchmarks/fsdp.py: they run and report their claims."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(180)
def test_sweep_marks_what_auto_chose_among_the_sizes(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    proc = _run("sweep.py", "--quick", "--tasks", "digits", "--json", str(out), timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (report,) = json.loads(out.read_text())
    auto = report["auto"]
    assert auto["chosen"] in report["sizes"]  # a power of two or the batch
    assert auto["sizing"].startswith(f"auto {auto['chosen']}: ")
    assert all(rate > 0 for rate in report["items_per_second"].values())
    assert "auto, fastest" in proc.stdout or "| auto |" in proc.stdout


@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not hasattr(importlib.import_module("torch.distributed.fsdp"), "FSDPModule"),
    reason="FSDP2 support needs torch 2.6 or later",
)
def test_fsdp_benchmark_counts_reduce_scatters_per_policy(tmp_path: Path) -> None:
    out = tmp_path / "fsdp.json"
    proc = _run("fsdp.py", "--quick", "--json", str(out), timeout=230)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    for n, result in results.items():
        groups = 3  # two blocks and the root
        assert result["calls"]["window"] == groups
        assert result["calls"]["micro"] == groups * int(n)
        assert result["gap"] < 1e-5  # the same step, up to float32 rounding
