"""docs/reliability.md's table of `gradaccum train` option errors is what the command prints today.

Each row of the table is run (in-process, paths replaced by the table's `DIR` / `FILE`) and its one
line on stderr compared with the table's message; ` ...` in a message stands for torch's long
reason. A row this file cannot rebuild cheaply is listed in `NOT_RUN` with the test that covers it,
so a new row is either run here or named there.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from gradaccum.cli import main

ROOT = Path(__file__).resolve().parents[2]
HEADING = "### `gradaccum train` options"
_DIGITS = ["train", "--task", "digits"]


def _table() -> dict[str, str]:
    """The table's rows: input cell -> message cell, backslash escapes removed."""
    text = (ROOT / "docs/reliability.md").read_text(encoding="utf-8")
    rows: dict[str, str] = {}
    for line in text.split(HEADING, 1)[1].splitlines()[1:]:
        if not line.strip():
            if rows:
                break
            continue
        cells = [cell.strip().replace("\\`", "`") for cell in line.strip().strip("|").split(" | ")]
        if cells[0] in ("input", "---"):
            continue
        assert len(cells) == 2, line
        rows[cells[0]] = cells[1]
    return rows


ROWS = _table()


# input cell -> (tmp folder, finished run folder) -> argv; `DIR` and `FILE` are paths in tmp.
Setup = Callable[[Path, Path], list[str]]


def _copy_run(tmp: Path, run: Path) -> Path:
    shutil.copytree(run, tmp / "DIR")
    return tmp / "DIR"


def _damage_config(tmp: Path, run: Path) -> list[str]:
    folder = _copy_run(tmp, run)
    (folder / "config.json").write_text("{x")
    return ["train", "--resume", str(folder)]


def _edit_config(tmp: Path, run: Path) -> list[str]:
    folder = _copy_run(tmp, run)
    config = json.loads((folder / "config.json").read_text())
    config["config"]["lr"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    return ["train", "--resume", str(folder), "--steps", "2"]


def _drop(name: str) -> Setup:
    def setup(tmp: Path, run: Path) -> list[str]:
        folder = _copy_run(tmp, run)
        (folder / name).unlink()
        return ["train", "--resume", str(folder), "--steps", "2"]

    return setup


def _truncate_checkpoint(tmp: Path, run: Path) -> list[str]:
    folder = _copy_run(tmp, run)
    checkpoint = folder / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    return ["train", "--resume", str(folder), "--steps", "2"]


def _not_empty(tmp: Path, run: Path) -> list[str]:
    (tmp / "DIR").mkdir()
    (tmp / "DIR" / "x").write_text("")
    return [*_DIGITS, "--steps", "1", "--out", str(tmp / "DIR")]


def _empty(tmp: Path, run: Path) -> list[str]:
    (tmp / "DIR").mkdir()
    return ["train", "--resume", str(tmp / "DIR")]


def _file(tmp: Path, suffix: str, *argv: str) -> list[str]:
    (tmp / "FILE").write_text("")
    return [*argv, str(tmp / "FILE") + suffix]


def _options(*argv: str) -> Setup:
    """A row about options alone: its --out must stay unwritten (checked by the test)."""
    return lambda tmp, run: [*argv, "--out", str(tmp / "new")]


SETUPS: dict[str, Setup] = {
    "`--task nope`": _options("train", "--task", "nope"),
    "no `--task` and no `--resume`": _options("train"),
    "`--epochs 1 --steps 2`": _options(*_DIGITS, "--epochs", "1", "--steps", "2"),
    "`--batch-size 0` (likewise `--steps 0`, `--threads 0`)": _options(
        *_DIGITS, "--batch-size", "0"
    ),
    "`--batch-size 8 --micro-batch-size 16`": _options(
        *_DIGITS, "--batch-size", "8", "--micro-batch-size", "16"
    ),
    "`--micro-batch-size x`": _options(*_DIGITS, "--micro-batch-size", "x"),
    "`--micro-batch-size auto` without `--memory-budget`": _options(
        *_DIGITS, "--micro-batch-size", "auto"
    ),
    "`--micro-batch-size auto --memory-budget 1KiB` (digits)": _options(
        *_DIGITS, "--micro-batch-size", "auto", "--memory-budget", "1KiB"
    ),
    "`--bn pooled --norm group`": _options(
        "train", "--task", "shapes", "--bn", "pooled", "--norm", "group"
    ),
    "`--init-from FILE` (missing)": lambda tmp, run: [
        *_DIGITS,
        "--init-from",
        str(tmp / "FILE"),
        "--out",
        str(tmp / "new"),
    ],
    "`--memory-budget 2GiB --micro-batch-size 8`": _options(
        *_DIGITS, "--memory-budget", "2GiB", "--micro-batch-size", "8"
    ),
    "`--norm group` on digits": _options(*_DIGITS, "--norm", "group"),
    "`--bn pooled` (or `frozen`) on digits or charlm, which have no BatchNorm (`compare` too)": (
        _options(*_DIGITS, "--bn", "pooled")
    ),
    "`--recalibrate 5` on digits or charlm (`compare` too)": _options(
        *_DIGITS, "--recalibrate", "5"
    ),
    "`--micro-batch-size auto --memory-budget -5MiB` (`plan` too; a value starting with `-` "
    "reaches the option's own check)": _options(
        *_DIGITS, "--micro-batch-size", "auto", "--memory-budget", "-5MiB"
    ),
    "`--warmup -1`": _options(*_DIGITS, "--warmup", "-1"),
    "`--lr nan`": _options(*_DIGITS, "--lr", "nan"),
    "`--init-from ''` (likewise `--out ''` and `--resume ''`, which took the current folder; "
    "`compare`, `demo` too)": _options(*_DIGITS, "--init-from", ""),
    "`--seed -1` (likewise `2**62`, which overflowed the data order mid-run; every command)": (
        _options(*_DIGITS, "--seed", "-1")
    ),
    "`--checkpoint-every 0` (likewise `5m`, `2.5`)": _options(*_DIGITS, "--checkpoint-every", "0"),
    "`--out DIR`, DIR not empty (it holds `x`)": _not_empty,
    "`--out DIR`, DIR holds a run": lambda tmp, run: [
        *_DIGITS,
        "--steps",
        "1",
        "--out",
        str(_copy_run(tmp, run)),
    ],
    "`--out FILE/run`": lambda tmp, run: _file(tmp, "/run", *_DIGITS, "--steps", "1", "--out"),
    "`--out /proc/x` (permission bits say writable; creating fails) (`compare`, `demo` too)": (
        lambda tmp, run: [*_DIGITS, "--steps", "1", "--out", "/proc/x"]
    ),
    "`--resume DIR`, no such folder": lambda tmp, run: ["train", "--resume", str(tmp / "DIR")],
    "`--resume FILE`": lambda tmp, run: _file(tmp, "", "train", "--resume"),
    "`--resume DIR` without `config.json`": _empty,
    "`--resume DIR`, `config.json` damaged": _damage_config,
    "`--resume DIR`, `config.json` edited": _edit_config,
    "`--resume DIR` without `checkpoint.pt`": _drop("checkpoint.pt"),
    "`--resume DIR`, checkpoint truncated": _truncate_checkpoint,
    "`--resume DIR` of a finished run": lambda tmp, run: [
        "train",
        "--resume",
        str(_copy_run(tmp, run)),
    ],
    "`--resume DIR --lr 0.1`": lambda tmp, run: [
        "train",
        "--resume",
        str(_copy_run(tmp, run)),
        "--lr",
        "0.1",
    ],
    "`--resume DIR --task digits --lr 0.1`": lambda tmp, run: [
        "train",
        "--resume",
        str(_copy_run(tmp, run)),
        "--task",
        "digits",
        "--lr",
        "0.1",
    ],
}

# Rows that need a run stopped at a crafted position: covered where that run is built.
NOT_RUN = {
    "`--threads 100000` on 2 CPUs (every command; thousands of threads crashed OpenBLAS or "
    "libgomp)": "tests/cli/test_bad_inputs.py::"
    "test_the_threads_message_is_the_documented_one (the CPUs vary by machine)",
    "`--resume DIR`, position disagrees with the Accumulator state": (
        "tests/cli/test_train_resume.py::test_unusable_resume_folder_exits_2_and_changes_nothing"
    ),
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-step digits run, copied by the rows that need a run folder."""
    run = tmp_path_factory.mktemp("base") / "run"
    assert main([*_DIGITS, "--steps", "1", "--out", str(run)]) == 0
    return run


def test_every_row_is_run_or_named() -> None:
    assert len(ROWS) >= 30  # the parser found the table
    assert set(ROWS) == set(SETUPS) | set(NOT_RUN), set(ROWS) ^ (set(SETUPS) | set(NOT_RUN))


@pytest.mark.parametrize("row", list(SETUPS))
def test_the_documented_message_is_the_printed_one(
    row: str, tmp_path: Path, finished_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = SETUPS[row](tmp_path, finished_run)
    capsys.readouterr()  # the fixture's training output
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    prefix = "gradaccum train: error: "
    assert lines[0].startswith(prefix), lines[0]
    printed = lines[0][len(prefix) :].replace(str(tmp_path / "DIR"), "DIR")
    printed = printed.replace(str(tmp_path / "FILE"), "FILE")
    expected = re.escape(ROWS[row]).replace(re.escape(" ..."), " .*")
    assert re.fullmatch(expected, printed), (
        f"docs/reliability.md says\n{ROWS[row]}\nprinted\n{printed}"
    )
    assert not (tmp_path / "new").exists()
