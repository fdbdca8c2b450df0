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
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradaccum.cli import main
from gradaccum.experiments.report import CURVES_SIZE, MEMORY_SIZE, PEAK_MEMORY_NOTE
from tests.cli._helpers import (
    DIGITS_TABLE_COLUMNS,
    METRIC_COLUMNS,
    read_jsonl,
    run_cli,
    subprocess_env,
)
from tests.cli.signal_at import HOOK
from tests.state import assert_bitwise

_TIMEOUT = 120
CONFIGS = ("8x2", "16x1", "8x1")
STEPS = 20
FLOAT32_RTOL = 1e-5
COLUMNS = DIGITS_TABLE_COLUMNS
RUN_FILES = {"config.json", "metrics.jsonl", "validation.jsonl", "summary.json", "checkpoint.pt"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=cwd, timeout=_TIMEOUT)


def _markdown_table(text: str) -> list[list[str]]:
    """The rows (header first, separator dropped) of the first markdown table in `text`."""
    lines = text.split("\n\n|", 1)[1].split("\n\n")[0].splitlines()
    lines = [line for line in ("|" + lines[0], *lines[1:]) if line.startswith("|")]
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
        "compare.json",
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
        (["--task", "digits"], "--task and --configs are required"),
        (
            ["--task", "digits", "--configs", "8x1", "500x4"],
            "config '500x4': its batch of 2000 is larger than digits's training set (1438 items); "
            "give configs of at most 1438 items per step",
        ),
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


def _signalled(args: list[str], hook: str) -> subprocess.CompletedProcess[str]:
    """Run `gradaccum ARGS` with the test hook of `tests.cli.signal_at` set to `hook`."""
    env = subprocess_env(**{HOOK: hook})
    return subprocess.run(
        [sys.executable, "-m", "tests.cli.signal_at", *args],
        capture_output=True, text=True, env=env, timeout=_TIMEOUT, check=False,
    )  # fmt: skip


# 16x1 never reaches micro-batch 2 of a window, so the hook "3:2:..." stops the second config only.
STOPPED = ["compare", "--task", "digits", "--configs", "16x1", "4x4", "--steps", "6"]


@pytest.mark.timeout(3 * _TIMEOUT)
def test_a_stopped_compare_keeps_finished_configs_and_resumes_to_the_same_weights(tmp_path):
    """SIGTERM in the second config: the first stays finished, the second resumes bitwise."""
    reference, out = tmp_path / "reference", tmp_path / "cmp"
    assert run_cli(*STOPPED, "--out", str(reference)).returncode == 0
    stopped = _signalled([*STOPPED, "--out", str(out)], "3:2:TERM")
    assert stopped.returncode == 0, stopped.stderr
    assert (
        "stopped config [2/2] 4x4 after step 3 of 6 and 2 of the 4 micro-batches" in stopped.stderr
    )
    assert f"resume with: gradaccum compare --resume {out}" in stopped.stderr
    assert (out / "16x1" / "summary.json").is_file()  # finished: kept
    assert (out / "4x4" / "checkpoint.pt").is_file()
    assert not (out / "4x4" / "summary.json").exists()
    assert not (out / "report.md").exists()
    resumed = run_cli("compare", "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert "16x1: done" in resumed.stdout
    assert re.search(r"4x4\s+16\s+\S+\s+equal", resumed.stdout), resumed.stdout  # the gap table
    assert [row["step"] for row in read_jsonl(out / "4x4" / "metrics.jsonl")] == list(range(1, 7))
    for config in ("16x1", "4x4"):
        final = torch.load(out / config / "checkpoint.pt", weights_only=True)
        expected = torch.load(reference / config / "checkpoint.pt", weights_only=True)
        assert_bitwise(final["model"], expected["model"])
        assert_bitwise(final["optimizer"], expected["optimizer"])
    other = torch.load(out / "16x1" / "checkpoint.pt", weights_only=True)["model"]
    split = torch.load(out / "4x4" / "checkpoint.pt", weights_only=True)["model"]
    with pytest.raises(AssertionError):  # negative control: the other split is not bitwise equal
        assert_bitwise(other, split)


@pytest.mark.timeout(2 * _TIMEOUT)
def test_a_second_signal_exits_130_and_keeps_only_finished_configs(tmp_path):
    out = tmp_path / "cmp"
    stopped = _signalled([*STOPPED, "--out", str(out)], "3:2:TERM+TERM")
    assert stopped.returncode == 130, stopped.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "16x1",
        "compare.json",
    ]  # 4x4 had no checkpoint
    resumed = run_cli("compare", "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert (out / "4x4" / "summary.json").is_file()
    assert (out / "report.md").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resume", "{out}", "--lr", "0.1"], "--lr cannot be combined with --resume"),
        (["--resume", "{out}", "--configs", "8x1"], "--configs cannot be combined with --resume"),
        (["--resume", "{out}"], "holds no compare.json"),
        (["--resume", "{missing}"], "{missing}: no such directory"),  # as train --resume says
        (["--resume", "{out}", "--lr", "0.1", "--seed", "1"], "--seed cannot be combined with "),
    ],
)
def test_bad_compare_resume_exits_2(tmp_path, capsys, args, message):
    names = {"out": tmp_path, "missing": tmp_path / "missing"}
    assert main(["compare", *(arg.format(**names) for arg in args)]) == 2
    assert message.format(**names) in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_compare_resume_of_a_file_and_out_of_a_compare_point_to_the_fix(tmp_path, capsys):
    """`--out` of a compare folder said only "directory is not empty" (train points to
    --resume); `--resume FILE` said the file "holds no compare.json"."""
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "compare.json").write_text("{}")
    (tmp_path / "cmp" / "8x1").mkdir()
    before = sorted(p.name for p in (tmp_path / "cmp").iterdir())
    argv = ["compare", "--task", "digits", "--configs", "8x1", "--steps", "1"]
    assert main([*argv, "--out", str(tmp_path / "cmp")]) == 2
    assert (
        f"--out {tmp_path / 'cmp'}: holds a compare of `gradaccum compare`; continue it with: "
        f"gradaccum compare --resume {tmp_path / 'cmp'}"
    ) in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == before
    assert main(["compare", "--resume", str(tmp_path / "cmp" / "compare.json")]) == 2
    assert "compare.json: not a directory" in capsys.readouterr().err
    # Control: --resume with one setting says "drop it".
    assert main(["compare", "--resume", str(tmp_path / "cmp"), "--lr", "0.1"]) == 2
    assert "keeps its settings; drop it\n" in capsys.readouterr().err


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


@pytest.mark.parametrize(
    "configs",
    [["8x1", "500x4"], ["8x1", "2000@4096t"], ["8x8", "64@50t"]],
)
def test_a_config_the_task_cannot_run_names_the_config_not_an_option_compare_lacks(
    tmp_path, capsys, configs
):
    """`compare --configs 500x4` on digits once said `--batch-size=2000 is larger than digits's
    training set ...; pass --batch-size 1438 or less`, and `64@50t` said `give --max-tokens 85 or
    more`: options compare refuses. The message names the config and asks for another."""
    task = "digits" if configs[1] == "500x4" else "charlm"
    out = tmp_path / "cmp"
    assert main(["compare", "--task", task, "--configs", *configs, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gradaccum compare: error: config '{configs[1]}': ")
    assert "--batch-size" not in err
    assert "--max-tokens" not in err
    assert len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_configs_given_twice_as_an_option_are_all_compared(tmp_path, capsys):
    """`--configs 8x1 --configs 4x2` compared 4x2 alone: the first list was dropped, silently."""
    out = tmp_path / "cmp"
    argv = ["compare", "--task", "digits", "--configs", "8x1", "--configs", "4x2", "--steps", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gradaccum compare: digits, 2 configs, seed 0" in printed
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["4x2", "8x1"]
    assert "and one folder per config: 8x1, 4x2" in printed
    # Control: one config is counted as one (it once read "1 configs").
    assert main([*argv[:5], "--steps", "1", "--out", str(tmp_path / "one")]) == 0
    assert "gradaccum compare: digits, 1 config, seed 0" in capsys.readouterr().out


def test_a_config_extended_by_train_is_refused_on_resume_not_compared(tmp_path, capsys):
    """`gradaccum train --resume OUT/8x1 --steps 3` on a finished 2-step compare, then `compare
    --resume OUT`: the report compared a 3-step run with a 2-step one, called 4x2 'differs' and
    blamed float32 rounding grown over a long run."""
    out = tmp_path / "cmp"
    argv = ["compare", "--task", "digits", "--configs", "8x1", "4x2", "--steps", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    assert main(["train", "--resume", str(out / "8x1"), "--steps", "3"]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["compare", "--resume", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f"gradaccum compare: error: --resume {out}: config 8x1 no longer holds the compare's run "
        "(its config.json differs in: steps; was it extended by `gradaccum train --resume`?); "
        f"remove {out / '8x1'} to train it again"
    )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # Control: as the message says, the removed config is trained again, equal to 4x2.
    shutil.rmtree(out / "8x1")
    assert main(["compare", "--resume", str(out)]) == 0
    assert re.search(r"^4x2\s+8\s+\S+\s+equal", capsys.readouterr().out, re.MULTILINE)
