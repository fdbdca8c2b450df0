"""`gradaccum demo` and the command-line entry point, run as a user would run them.

The demo is run once with its default settings in a subprocess; its printed figures, `report.md`,
plots and the digits checkpoints are then checked. The digits equality is recomputed here from
the checkpoints, not taken from the demo's output. The verdict's own negative control swaps the
`Accumulator` run for the naive loop and must turn the exit code to 1.
"""

from __future__ import annotations

import re
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from gradaccum.cli import main
from gradaccum.experiments import demo, folders
from gradaccum.experiments.report import CURVES_SIZE, MEMORY_SIZE, PEAK_MEMORY_NOTE
from tests.cli._helpers import DIGITS_TABLE_COLUMNS, run_cli

_TIMEOUT = 180
FLOAT32_RTOL = 1e-5
CONFIGS = ("32x1", "8x4", "8x1")
COMPARE_COLUMNS = DIGITS_TABLE_COLUMNS
# A small but complete run: uneven micro-batches (7 = 3 + 3 + 1), one digits epoch.
SMALL = ["--steps", "3", "--batch-size", "7", "--micro-batch-size", "3", "--epochs", "1"]


def _run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=cwd, timeout=_TIMEOUT)


def _cells(text: str, start: str) -> list[str]:
    """The cells (split on 2+ spaces) of the first table line that starts with `start`."""
    for line in text.splitlines():
        if line.strip().startswith(start):
            return re.split(r"\s{2,}", line.strip())
    raise AssertionError(f"no line starting with {start!r} in:\n{text}")


def _verdict_cells(text: str, config: str) -> list[str]:
    """The cells of `config`'s row in the digits equal-parameters table."""
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == config and cells[-1] in {"equal", "NOT EQUAL", "differs", "SAME"}:
            return cells
    raise AssertionError(f"no equal-parameters row for {config} in:\n{text}")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _norm_gap(state: dict, reference: dict) -> float:
    """Largest over tensors of ||a - b|| / ||b||, computed here, independently of the demo."""
    assert state.keys() == reference.keys()
    return max(
        float((state[k].double() - reference[k].double()).norm() / reference[k].double().norm())
        for k in reference
    )


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("demo") / "nested" / "results"
    proc = _run_cli("demo", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.mark.timeout(_TIMEOUT + 20)
def test_exactness_and_negative_control_on_charlm(demo_run):
    out = demo_run[1].stdout
    reference = _cells(out, "(a) full batch")
    accumulated = _cells(out, "(b) gradaccum.Accumulator")
    naive = _cells(out, "(c) naive")
    assert float(accumulated[3]) < 1e-10
    assert "verdict: EXACT" in out
    # Same objective at step 1 and at the last step, to the 6 printed decimals.
    assert accumulated[1:3] == reference[1:3]
    # The demo's negative control: the same comparison flags the naive loop loudly.
    assert float(naive[3]) > 1e-3
    assert "verdict: CAUGHT" in out
    assert naive[1] != reference[1]  # mean of means is another objective at the same weights


def test_memory_saving_is_measured_and_consistent(demo_run):
    out = demo_run[1].stdout
    full = int(_cells(out, "full batch (32 lines)")[1].replace(",", ""))
    micro = int(_cells(out, "largest micro-batch (8 lines)")[1].replace(",", ""))
    ratio = float(_cells(out, "ratio full / micro")[1].rstrip("x"))
    assert ratio > 1
    assert micro < full
    assert f"{full / micro:.2f}" == f"{ratio:.2f}"


def test_digits_same_effective_batch_ends_with_equal_parameters(demo_run):
    out, proc = demo_run
    states = {
        config: torch.load(out / "runs" / config / "checkpoint.pt", weights_only=True)["model"]
        for config in CONFIGS
    }
    exact_gap = _norm_gap(states["8x4"], states["32x1"])
    control_gap = _norm_gap(states["8x1"], states["32x1"])
    assert exact_gap < FLOAT32_RTOL, exact_gap
    assert control_gap > 1000 * FLOAT32_RTOL, control_gap  # effective batch 8, not 32
    # The demo prints what the checkpoints hold.
    assert _verdict_cells(proc.stdout, "8x4")[2:] == [f"{exact_gap:.1e}", "equal"]
    assert _verdict_cells(proc.stdout, "8x1")[2:] == [f"{control_gap:.1e}", "differs"]


def test_report_holds_every_section_and_the_compare_table(demo_run):
    out, proc = demo_run
    assert sorted(path.name for path in out.iterdir()) == [
        "curves.png",
        "memory.png",
        "report.md",
        "runs",
    ]
    report = (out / "report.md").read_text()
    for number in range(1, 5):
        assert re.search(rf"^## {number}\. ", report, re.MULTILINE), number
    header = "| " + " | ".join(COMPARE_COLUMNS) + " |"
    assert header in report
    compare_row = re.compile(r"\| (32x1|8x4|8x1) \| (\d+) \| (\d+) \| (\d+) \| ")
    rows = {m[1]: m.groups()[1:] for m in map(compare_row.match, report.splitlines()) if m}
    # config: (effective batch, micro-batch, steps); 8x1 takes 4x the steps of batch 32.
    assert rows["32x1"] == ("32", "32", rows["8x4"][2])
    assert rows["8x4"][:2] == ("32", "8")
    assert rows["8x1"] == ("8", "8", str(4 * int(rows["32x1"][2])))
    assert PEAK_MEMORY_NOTE in report
    assert re.search(r"!\[[^]]+\]\(curves\.png\)", report)
    assert re.search(r"!\[[^]]+\]\(memory\.png\)", report)
    # The figures of sections 1-3 in the report are those printed.
    for start in ("(b) gradaccum.Accumulator", "(c) naive", "full batch (32 lines)"):
        cells = _cells(proc.stdout, start)
        assert "| " + " | ".join(cells) + " |" in report, start
    assert "verdict: EXACT" in report
    assert "verdict: CAUGHT" in report


@pytest.mark.parametrize(
    ("name", "size"), [("curves.png", CURVES_SIZE), ("memory.png", MEMORY_SIZE)]
)
def test_plots_are_valid_non_blank_pngs(demo_run, name, size):
    import matplotlib.image

    path = demo_run[0] / name
    assert path.stat().st_size > 10_000
    assert _png_size(path) == size
    pixels = matplotlib.image.imread(path)
    assert float(pixels[..., :3].std()) > 0.05


def test_prints_total_time_and_where_results_are(demo_run):
    out, proc = demo_run
    assert re.search(r"^done in \d+\.\d s$", proc.stdout, re.MULTILINE)
    assert "checks: all 4 hold" in proc.stdout
    assert f"results in {out}" in proc.stdout
    assert not any(p.name.startswith(".") for p in out.parent.iterdir())  # no staging left


def test_rerun_replaces_results_and_a_failed_check_exits_1(tmp_path, capsys, monkeypatch):
    out = tmp_path / "demo"
    threads = torch.get_num_threads()
    assert main(["demo", *SMALL, "--out", str(out)]) == 0
    first = capsys.readouterr().out
    assert float(_cells(first, "(b) gradaccum.Accumulator")[3]) < 1e-10
    assert float(_cells(first, "(c) naive")[3]) > 1e-6
    assert torch.get_num_threads() == threads  # --threads 1 is undone at the end
    # Negative control of the verdict: the Accumulator run replaced by the naive loop.
    monkeypatch.setattr(demo, "_train_accumulated", demo._train_naive)
    assert main(["demo", *SMALL, "--out", str(out)]) == 1
    second = capsys.readouterr().out
    assert "verdict: MISMATCH" in second
    assert "checks: FAILED: (b) exact" in second
    assert float(_cells(second, "(b) gradaccum.Accumulator")[3]) > 1e-6
    # The previous demo's folder was replaced as a whole, with nothing left beside it.
    assert "verdict: MISMATCH" in (out / "report.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


@pytest.mark.parametrize("case", ["file", "under_file", "foreign_files"])
def test_unusable_out_exits_2_before_any_work(tmp_path, capsys, case):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    out = {"file": blocker, "under_file": blocker / "out", "foreign_files": folder}[case]
    assert main(["demo", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("gradaccum demo: error: --out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "mine"]
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_unusable_out_exits_2_subprocess(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    proc = _run_cli("demo", "--out", str(blocker / "out"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "not a directory" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]


def test_micro_batch_not_smaller_than_batch_exits_2(tmp_path, capsys):
    code = main(
        ["demo", "--batch-size", "8", "--micro-batch-size", "8", "--out", str(tmp_path / "o")]
    )
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--micro-batch-size 8 must be less than --batch-size 8" in captured.err
    assert not (tmp_path / "o").exists()


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
        ["demo", "--threads", "0"],
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
    help_text = capsys.readouterr().out
    for option in ("--micro-batch-size", "--out", "--threads", "--epochs"):
        assert option in help_text


def test_a_folder_of_train_runs_is_not_taken_for_a_previous_demo(tmp_path, capsys):
    """`gradaccum demo --out proj`, proj holding only the `runs/` that `gradaccum train` writes by
    default: `runs` is a name the demo writes, so proj passed for a previous demo and the demo
    replaced it whole, deleting the user's training runs."""
    project = tmp_path / "proj"
    (project / "runs" / "train-digits-1").mkdir(parents=True)
    (project / "runs" / "train-digits-1" / "checkpoint.pt").write_text("a week of training")
    assert main(["demo", *SMALL, "--out", str(project)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f"gradaccum demo: error: --out {project}: directory is not empty (runs); choose a new or "
        "empty folder"
    )
    assert (
        project / "runs" / "train-digits-1" / "checkpoint.pt"
    ).read_text() == "a week of training"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj"]
    # Negative control: a folder holding exactly what a demo writes is a previous demo.
    for name in ("report.md", "curves.png", "memory.png"):
        (project / name).write_text("")
    folders.check_out_dir(project, replaceable=demo.OUT_NAMES)


@pytest.mark.parametrize(("where", "out"), [("", "."), ("sub", ".."), ("", "prev")])
def test_out_holding_the_current_directory_exits_2_before_any_work(
    tmp_path, capsys, monkeypatch, where, out
):
    """`gradaccum demo --out .` ran the whole demo, then failed to rename "." with a traceback
    (exit 1), leaving a `..old-*` folder in the parent when "." held a previous demo."""
    base = tmp_path / "base"
    (base / where).mkdir(parents=True)
    if out == "prev":  # a previous demo the user stands in
        for name in demo.OUT_NAMES:
            (base / name).mkdir()
        base, out, where = base, str(base), "runs"
    monkeypatch.chdir(base / where)
    assert main(["demo", *SMALL, "--out", out]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    assert captured.err.strip().endswith(
        "the results replace this folder whole, and it holds the current directory; choose a new "
        "folder, e.g. a sub-folder"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_a_failed_replacement_puts_the_previous_result_back(tmp_path, monkeypatch):
    """The staged result could not take the place of the previous one: the previous demo is
    put back, nothing is left beside it, and the error is a one-line FolderError."""
    out = tmp_path / "demo"
    out.mkdir()
    (out / "report.md").write_text("previous")
    rename = folders.os.replace

    def failing(source, target):
        if ".partial-" in Path(source).name:  # the staged result, not the previous one
            raise OSError(16, "Device or resource busy")
        rename(source, target)

    monkeypatch.setattr(folders.os, "replace", failing)
    busy = pytest.raises(folders.FolderError, match="Device or resource busy")
    with busy, folders.staged_out_dir(out) as staging:
        (staging / "report.md").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]
    assert (out / "report.md").read_text() == "previous"


def test_a_batch_of_many_micro_batches_keeps_the_negative_control_short(tmp_path, capsys):
    """`gradaccum demo --batch-size 5000` printed the negative control's table with one row per
    micro-batch: 625 rows, 690 lines of output. Now the first rows, an ellipsis and the last."""
    argv = ["--steps", "1", "--batch-size", "60", "--micro-batch-size", "2", "--epochs", "1"]
    assert main(["demo", *argv, "--out", str(tmp_path / "demo")]) == 0
    printed = capsys.readouterr().out
    section = printed.split("2. Negative control")[1].split("3. Memory saving")[0]
    assert "Step 1 (30 micro-batches; the first 10 and the last):" in " ".join(section.split())
    rows = [
        line.split() for line in section.splitlines() if re.match(r"\s+(\d+|\.\.\.)(\s|$)", line)
    ]
    assert [row[0] for row in rows] == [*map(str, range(1, 11)), "...", "30"]
    # Control: a split of few micro-batches is shown whole (the README's 4 rows).
    assert main(["demo", *SMALL, "--out", str(tmp_path / "small")]) == 0
    section = capsys.readouterr().out.split("2. Negative control")[1].split("3. Memory")[0]
    assert "Step 1:" in section
