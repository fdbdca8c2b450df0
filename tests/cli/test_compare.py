"""`gradaccum compare`, run as a user runs it: report, plots, per-config runs, exactness, bad input.

End-to-end exactness: on `digits` (no BatchNorm) `8x2` and `16x1` see the same batches in the
same order, so they must end with the same parameters; `8x1` (effective batch 8) is the negative
control and must end clearly elsewhere. They run in float32 with AdamW; the gap is measured per
tensor as ||a - b|| / ||b|| (see tests/cli/test_train.py for why not element-wise).
"""

from __future__ import annotations

import json
import math
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradaccum.cli import main
from gradaccum.experiments.report import CURVES_SIZE, MEMORY_SIZE, PEAK_MEMORY_NOTE
from tests.cli._helpers import DIGITS_TABLE_COLUMNS, METRIC_COLUMNS, read_jsonl, run_cli

_TIMEOUT = 120
CONFIGS = ("8x2", "16x1", "8x1")
STEPS = 20
FLOAT32_RTOL = 1e-5
COLUMNS = DIGITS_TABLE_COLUMNS
RUN_FILES = {"metrics.jsonl", "validation.jsonl", "summary.json", "checkpoint.pt"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=cwd, timeout=_TIMEOUT)


def _markdown_table(text: str) -> list[list[str]]:
    """The rows (header first, separator dropped) of the first markdown table in `text`."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    assert rows, text
    assert all(re.fullmatch(r"-+:?", cell) for cell in rows[1]), rows[1]
    return [rows[0], *rows[2:]]


def _norm_gap(state: dict, reference: dict) -> float:
    assert state.keys() == reference.keys()
    return max(
        float((state[k].float() - reference[k].float()).norm() / reference[k].float().norm())
        for k in reference
    )


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("compare") / "cmp"
    proc = _run_cli(
        "compare", "--task", "digits", "--configs", *CONFIGS, "--steps", str(STEPS),
        "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_compare_writes_report_plots_and_one_folder_per_config(compared):
    out, _ = compared
    assert {path.name for path in out.iterdir()} == {
        "report.md",
        "curves.png",
        "memory.png",
        *CONFIGS,
    }
    for config in CONFIGS:
        assert {path.name for path in (out / config).iterdir()} == RUN_FILES
    assert [path.name for path in out.parent.iterdir()] == ["cmp"]  # no staging left


def test_each_config_logs_one_metrics_row_per_step_and_a_summary(compared):
    out, _ = compared
    for config in CONFIGS:
        micro, steps = map(int, config.split("x"))
        rows = read_jsonl(out / config / "metrics.jsonl")
        assert len(rows) == STEPS
        assert all(set(row) == METRIC_COLUMNS for row in rows)
        assert all(row["micro_batches"] == steps for row in rows)
        assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
        assert rows[-1]["samples"] == STEPS * micro * steps
        summary = json.loads((out / config / "summary.json").read_text())
        assert summary["config"] == config
        assert summary["effective_batch"] == micro * steps
        assert summary["micro_batch_size"] == micro
        assert summary["optimizer_steps"] == STEPS


def test_report_md_has_the_columns_and_one_row_per_config(compared):
    out, _ = compared
    text = (out / "report.md").read_text()
    header, *rows = _markdown_table(text)
    assert header == COLUMNS
    assert [row[0] for row in rows] == list(CONFIGS)
    for row in rows:
        assert len(row) == len(COLUMNS)
        summary = json.loads((out / row[0] / "summary.json").read_text())
        assert int(row[1]) == summary["effective_batch"]
        assert int(row[2]) == summary["micro_batch_size"]
        assert int(row[3]) == STEPS
        assert float(row[4]) == pytest.approx(summary["best_metric"], abs=5e-5)
        assert float(row[5]) == pytest.approx(summary["final_metric"], abs=5e-5)
        assert re.fullmatch(r"[0-9.]+ (B|KiB|MiB|GiB)", row[6])
        assert float(row[7].replace(",", "")) > 0
        assert re.fullmatch(r"[0-9.]+ s|\d+m \d\ds|\d+h \d\dm", row[8])
    assert PEAK_MEMORY_NOTE in text
    assert "(curves.png)" in text
    assert "(memory.png)" in text


def test_peak_memory_depends_on_the_micro_batch_not_the_accumulation(compared):
    out, _ = compared
    peak = {
        config: json.loads((out / config / "summary.json").read_text())["peak_memory_bytes"]
        for config in CONFIGS
    }
    assert peak["8x2"] == peak["8x1"]
    assert peak["16x1"] > peak["8x2"]


@pytest.mark.parametrize(
    ("name", "size"), [("curves.png", CURVES_SIZE), ("memory.png", MEMORY_SIZE)]
)
def test_plots_are_valid_pngs_that_matplotlib_reads_back(compared, name, size):
    import matplotlib.image

    path = compared[0] / name
    assert path.stat().st_size > 10_000  # a drawn figure, not an empty canvas
    assert _png_size(path) == size
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (size[1], size[0])
    assert float(pixels[..., :3].std()) > 0.05  # not blank


def test_table_and_note_are_printed(compared):
    _, proc = compared
    lines = proc.stdout.splitlines()
    for config in CONFIGS:
        assert any(re.search(rf"\b{config}\b.*\b{STEPS}\b", line) for line in lines), config
    assert "effective batch" in proc.stdout
    assert PEAK_MEMORY_NOTE in proc.stdout
    assert "[3/3] 8x1: step 20/20 (100%)" in proc.stderr


def test_same_effective_batch_sees_the_same_batches_and_ends_with_equal_parameters(compared):
    out, _ = compared
    rows = {config: read_jsonl(out / config / "metrics.jsonl") for config in CONFIGS}
    # Same data order: the step losses of 8x2 and 16x1 agree to float32 rounding.
    for a, b in zip(rows["8x2"], rows["16x1"], strict=True):
        assert a["samples"] == b["samples"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=FLOAT32_RTOL)
    models = {
        config: torch.load(out / config / "checkpoint.pt", weights_only=True)["model"]
        for config in CONFIGS
    }
    exact_gap = _norm_gap(models["8x2"], models["16x1"])
    control_gap = _norm_gap(models["8x1"], models["16x1"])
    assert exact_gap < FLOAT32_RTOL, exact_gap
    # Negative control: effective batch 8 instead of 16 is caught by the same comparison.
    assert control_gap > 1000 * FLOAT32_RTOL, control_gap


# --- bad usage and input: exit 2, one line on stderr, nothing written --------------------------


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        (["8x"], "malformed config '8x'"),
        (["0x2"], "malformed config '0x2'"),
        (["ax2"], "malformed config 'ax2'"),
    ],
)
def test_malformed_configs_exit_2_and_write_nothing_subprocess(tmp_path, configs, message):
    # No --out: the default runs/compare-... folder must not appear either.
    proc = _run_cli("compare", "--task", "digits", "--configs", *configs, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "mnist", "--configs", "8x2"], "invalid choice: 'mnist'"),
        (["--task", "digits", "--configs", "8x0"], "malformed config '8x0'"),
        (["--task", "digits", "--configs", "8x2", "16"], "malformed config '16'"),
        (["--task", "digits", "--configs", "8X2"], "malformed config '8X2'"),
        (["--task", "digits", "--configs", "8x2", "8x2"], "given twice"),
        (["--task", "digits", "--configs", "8x2", "--batch-size", "16"], "--batch-size is not"),
        (["--task", "digits", "--configs", "8x2", "--micro-batch-size", "8"], "--micro-batch"),
        (["--task", "digits", "--configs", "8x2", "--memory-budget", "1GiB"], "--memory-budget"),
        (["--task", "digits", "--configs", "8x2", "--epochs", "1", "--steps", "2"], "not allowed"),
        (["--task", "digits", "--configs", "8x2", "--norm", "group"], "not available for"),
        (["--task", "digits"], "the following arguments are required: --configs"),
    ],
)
def test_bad_options_exit_2_and_write_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "new" / "cmp"
    code = main(["compare", *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_out_under_a_regular_file_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    code = main(["compare", "--task", "digits", "--configs", "8x2", "--out", str(blocker / "c")])
    assert code == 2
    assert "is not a directory" in capsys.readouterr().err
    assert [path.name for path in tmp_path.iterdir()] == ["file.txt"]


@pytest.mark.timeout(_TIMEOUT)
def test_terminated_compare_removes_finished_config_folders_too(tmp_path):
    """SIGTERM during the second config: exit 130; the first config's results go as well."""
    out = tmp_path / "cmp"
    args = ["compare", "--task", "digits", "--configs", "512x1", "1x1", "--epochs", "20"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradaccum.cli", *args, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("[2/2] 1x1: step 1/"):
                break
        assert seen, "no progress on stderr"
        assert seen[-1].startswith("[2/2]"), "".join(seen)
        (staging,) = tmp_path.iterdir()
        assert staging.name.startswith(".cmp.partial-")
        assert (staging / "512x1" / "summary.json").exists()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert list(tmp_path.iterdir()) == []


def test_compare_passes_bn_to_every_config(tmp_path):
    """`--bn pooled`: one running-statistics update per step in every config's BatchNorm."""
    out = tmp_path / "bn"
    proc = _run_cli(
        "compare", "--task", "shapes", "--configs", "8x2", "16x1", "--steps", "1",
        "--bn", "pooled", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for config in ("8x2", "16x1"):
        model = torch.load(out / config / "checkpoint.pt", weights_only=True)["model"]
        assert int(model["enc1.1.num_batches_tracked"]) == 1, config  # "micro": 2 for 8x2
    assert "pooled" in (out / "report.md").read_text()
