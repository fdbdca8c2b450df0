"""`gradaccum demo` and the command-line entry point, run as a user would run them."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from gradaccum.cli import demo, main

_TIMEOUT = 180


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradaccum.cli", *args],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
        check=False,
    )


def _gap(stdout: str, row: str) -> float:
    """The last number on the results-table row that starts with `row`."""
    match = re.search(rf"^\s*{re.escape(row)}.*\s(\S+)\s*$", stdout, re.MULTILINE)
    assert match, f"no row {row!r} in:\n{stdout}"
    return float(match.group(1))


def _memory_ratio(stdout: str) -> float:
    match = re.search(r"^\s*ratio full / micro\s+([0-9.]+)x\s*$", stdout, re.MULTILINE)
    assert match, f"no memory ratio in:\n{stdout}"
    return float(match.group(1))


def _bytes(stdout: str, row: str) -> int:
    match = re.search(rf"^\s*{re.escape(row)}.*\(([0-9,]+) bytes\)\s*$", stdout, re.MULTILINE)
    assert match, f"no byte count on row {row!r} in:\n{stdout}"
    return int(match.group(1).replace(",", ""))


@pytest.mark.timeout(_TIMEOUT + 20)
def test_demo_subprocess_prints_exact_match_and_memory_saving():
    proc = _run_cli("demo")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    acc_gap = _gap(out, "gradaccum.Accumulator")
    naive_gap = _gap(out, "naive:")
    assert acc_gap < 1e-10
    assert "verdict: EXACT" in out
    # The demo's own negative control: the same comparison flags the naive loop loudly.
    assert naive_gap > 1e-3
    ratio = _memory_ratio(out)
    assert ratio > 1
    # Default: 4 micro-batches padded to the batch's width, so about 4x; bytes agree with ratio.
    assert 3.0 < ratio < 4.5
    full = _bytes(out, "full batch (32 sequences)")
    micro = _bytes(out, "largest micro-batch (8 sequences)")
    assert f"{full / micro:.2f}" == f"{ratio:.2f}"


def test_demo_in_process_small_ragged_split(capsys):
    # 7 sequences in micro-batches of 3: the last micro-batch holds one sequence.
    code = main(["demo", "--steps", "3", "--batch-size", "7", "--micro-batch-size", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert _gap(out, "gradaccum.Accumulator") < 1e-10
    assert _gap(out, "naive:") > 1e-6
    assert _memory_ratio(out) > 1


def test_demo_reports_mismatch_and_exits_1_when_runs_differ(capsys, monkeypatch):
    # Negative control for the verdict: swap the Accumulator run for the naive loop.
    monkeypatch.setattr(demo, "train_accumulated", demo.train_naive)
    code = main(["demo", "--steps", "3", "--batch-size", "8", "--micro-batch-size", "2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "verdict: MISMATCH" in out
    assert _gap(out, "gradaccum.Accumulator") > 1e-6


def test_unknown_subcommand_exits_2_with_one_line_on_stderr():
    proc = _run_cli("frobnicate")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "frobnicate" in lines[0]
    assert "demo" in lines[0]  # names the valid choices


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["demo", "--steps", "0"],
        ["demo", "--batch-size", "many"],
        ["demo", "--no-such-option"],
    ],
)
def test_usage_errors_exit_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("gradaccum")
    assert "error" in lines[0]


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0
    assert "--micro-batch-size" in capsys.readouterr().out
