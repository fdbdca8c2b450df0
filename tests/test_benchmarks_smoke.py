"""Smoke test of benchmarks/overhead.py and checks of its measuring tools (benchmarks/_measure.py).

The benchmark runs with `--quick` in a subprocess: it must exit 0, print the ratio lines and
write its JSON. No timing is asserted. The memory meter is checked against allocations of known
sizes, each with a control that a wrong meter (one summing allocations, or one counting frees
of older blocks) would fail.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
MIB = 1 << 20


def _load_measure() -> ModuleType:
    name = "gradaccum_benchmarks_measure"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / "_measure.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


measure = _load_measure()


# The timeouts only bound a hang. `--quick` takes about 8 s on a quiet 2-core machine but was
# measured at 51 s with two busy processes beside it, and `--processes 3` at 108 s (it starts
# three more Pythons): a loaded CI machine must not fail them.
@pytest.mark.timeout(270)
def test_overhead_quick_runs_and_prints_ratios(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "overhead.py"), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for model in ("cnn", "lm"):
        assert re.search(rf"^{model} step-time ratio \(ours/hand\): \d+\.\d+", proc.stdout, re.M)
        assert re.search(rf"^{model} peak-memory ratio \(ours/hand\): \d+\.\d+", proc.stdout, re.M)
    assert "profiler_start" not in proc.stderr  # the profiler's chatter is filtered
    figures = json.loads(out.read_text())
    assert figures["settings"]["threads"] == 1
    for model in ("cnn", "lm"):
        result = figures["results"][model]
        assert result["time_ratio_median"] > 0
        assert result["peak_bytes_ours"] > 0
        assert result["peak_bytes_hand"] > 0
        assert math.isclose(
            result["memory_ratio"], result["peak_bytes_ours"] / result["peak_bytes_hand"]
        )
        # The hand loop and the library take the same step (float64, one SGD step).
        assert result["update_gap_rel"] < 1e-10
        # The meter sees activations: the whole batch at once needs far more than a micro-batch.
        assert result["peak_bytes_whole_batch"] > 2 * result["peak_bytes_hand"]
        assert result["peak_bytes_hand"] >= result["saved_activation_bytes_micro"]


@pytest.mark.timeout(450)
def test_overhead_times_in_fresh_processes_and_reports_their_median(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    command = [sys.executable, str(BENCH / "overhead.py"), "--quick", "--processes", "3"]
    proc = subprocess.run(
        [*command, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "timed in 3 fresh processes" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["settings"]["processes"] == 3
    for model in ("cnn", "lm"):
        result = figures["results"][model]
        ratios = result["process_ratios"]
        assert len(ratios) == 3
        assert result["time_ratio_median"] == sorted(ratios)[1]  # the median, not the mean
        assert re.search(rf"^{model} step-time ratio per process: ", proc.stdout, re.M)


def test_overhead_rejects_bad_repeats() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "overhead.py"), "--repeats", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--repeats" in proc.stderr


# --------------------------------------------------------------------------------------------
# peak_allocated_bytes against allocations of known size
# --------------------------------------------------------------------------------------------


def test_peak_counts_blocks_alive_at_once() -> None:
    def two_live() -> None:
        a = torch.empty(MIB, dtype=torch.uint8)
        b = torch.empty(MIB, dtype=torch.uint8)
        del a, b

    peak = measure.peak_allocated_bytes(two_live)
    assert 2 * MIB <= peak.peak_bytes < 2 * MIB + 64 * 1024
    assert peak.end_bytes == 0


def test_peak_is_not_the_sum_of_allocations() -> None:
    def one_at_a_time() -> None:
        for _ in range(4):
            block = torch.empty(MIB, dtype=torch.uint8)
            del block

    peak = measure.peak_allocated_bytes(one_at_a_time)
    assert MIB <= peak.peak_bytes < MIB + 64 * 1024
    # Control: the churn is four blocks, so a meter summing allocations would read 4 MiB.
    assert peak.allocated_bytes >= 4 * MIB
    assert peak.allocations >= 4


def test_peak_scales_with_size() -> None:
    small = measure.peak_allocated_bytes(lambda: torch.ones(MIB // 4)).peak_bytes
    large = measure.peak_allocated_bytes(lambda: torch.ones(MIB)).peak_bytes
    assert small >= MIB  # 2**18 float32
    assert math.isclose(large / small, 4.0, rel_tol=0.05)


def test_peak_ignores_blocks_from_before_the_call() -> None:
    held: list[torch.Tensor] = []
    # Allocated under an earlier profiler session, so the profiler does report its free later.
    measure.peak_allocated_bytes(lambda: held.append(torch.empty(2 * MIB, dtype=torch.uint8)))

    def free_old_then_allocate() -> torch.Tensor:
        held.clear()  # frees 2 MiB allocated before the call
        return torch.empty(MIB, dtype=torch.uint8)

    peak = measure.peak_allocated_bytes(free_old_then_allocate)
    # A running sum of all events would go to -2 MiB first and report a peak of 0.
    assert MIB <= peak.peak_bytes < MIB + 64 * 1024


def test_saved_for_backward_bytes_counts_activations_not_parameters() -> None:
    layer = torch.nn.Linear(256, 256, bias=False)  # 256 KiB weight; a view of it is saved
    x = torch.randn(64, 256, requires_grad=True)  # 64 KiB input, saved for backward
    saved = measure.saved_for_backward_bytes(lambda: layer(x), layer.parameters())
    assert saved == x.numel() * 4
    # Control: without the exclusion the weight's storage is counted too.
    assert measure.saved_for_backward_bytes(lambda: layer(x)) == saved + 256 * 256 * 4
    deeper = torch.nn.Sequential(layer, torch.nn.Tanh())
    # Tanh saves its 64 KiB output as well: the count grows with the activations kept.
    assert measure.saved_for_backward_bytes(lambda: deeper(x), layer.parameters()) == 2 * saved


# --------------------------------------------------------------------------------------------
# attributed_time: bookkeeping (no timing asserted)
# --------------------------------------------------------------------------------------------


class _Base:
    def inherited(self) -> int:
        return 1


class _Child(_Base):
    def own(self) -> int:
        return self.inherited() + 1


def test_attributed_time_counts_calls_and_restores_everything() -> None:
    holder = SimpleNamespace(fn=lambda x: x * 2)
    original_own = _Child.own
    targets = [
        (_Child, "own", "own"),
        (_Child, "inherited", "inherited"),
        (holder, "fn", "fn"),
        (_Child, "absent", "absent"),
    ]
    with measure.attributed_time(targets) as calls:
        child = _Child()
        assert [child.own() for _ in range(3)] == [2, 2, 2]
        assert holder.fn(5) == 10
    assert calls.calls == {"own": 3, "inherited": 3, "fn": 1}
    assert set(calls.seconds) == {"own", "inherited", "fn"}
    assert all(seconds >= 0 for seconds in calls.seconds.values())
    assert calls.missing == ["_Child.absent"]
    assert _Child.own is original_own
    assert "inherited" not in vars(_Child)  # the inherited method was not left behind
    assert _Child().own() == 2
