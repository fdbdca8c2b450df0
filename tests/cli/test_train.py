"""`gradaccum train`, run as a user runs it: files, one metrics row per step, exactness, bad input.

Stopping, checkpoints and `--resume` are tested in tests/cli/test_train_resume.py.

The exactness test trains through the command line with uneven micro-batches (48 = 32 + 16) and
compares the checkpoint with a plain full-batch PyTorch run written here (no gradaccum). Its
negative control is the hand-written "mean of micro-batch means" loop, which must land clearly
elsewhere. Both run in float32 with AdamW, so the comparison is a relative gap of the whole
parameter tensor (norm), 1e-5: AdamW divides by sqrt(v) + eps, and for a weight whose gradient is
near zero that turns float32 summation-order rounding into a visible change of that one weight,
so an element-wise test would measure AdamW, not accumulation.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gradaccum.cli import main
from gradaccum.experiments.progress import progress
from gradaccum.experiments.runner import StepLog
from gradaccum.experiments.tasks import get_task
from tests.cli._helpers import METRIC_COLUMNS, read_jsonl, run_cli

_TIMEOUT = 120
RUN_FILES = {"config.json", "metrics.jsonl", "validation.jsonl", "summary.json", "checkpoint.pt"}
FLOAT32_RTOL = 1e-5


def _run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=cwd, timeout=_TIMEOUT)


def _norm_gap(state: dict, reference: dict) -> float:
    """Largest over tensors of ||a - b|| / ||b||."""
    assert state.keys() == reference.keys()
    return max(
        float((state[k].float() - reference[k].float()).norm() / reference[k].float().norm())
        for k in reference
    )


def _reference_run(batch: int, micro: int, steps: int, *, naive: bool) -> dict:
    """Plain PyTorch, no gradaccum: AdamW on digits in the runner's documented data order.

    The order is the one `gradaccum.experiments.runner` documents: per epoch a permutation drawn
    from `seed * 1_000_003 + epoch`, cut into consecutive effective batches. With `naive`, each
    effective batch is split into micro-batches and each micro-batch's own mean loss is divided
    by the number of micro-batches: the common hand-written loop, wrong for uneven splits.
    """
    task = get_task("digits")
    images, labels = task.make_data(seed=0).train
    model = task.make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.default_lr)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        index = order[step * batch : (step + 1) * batch]
        x, y = images[index], labels[index]
        if naive:
            parts = range(0, batch, micro)
            for start in parts:
                part = F.cross_entropy(model(x[start : start + micro]), y[start : start + micro])
                (part / len(parts)).backward()
        else:
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One `train` run without --out: digits, batch 48 = micro-batches of 32 + 16, 3 steps."""
    root = tmp_path_factory.mktemp("train")
    proc = _run_cli(
        "train",
        "--task",
        "digits",
        "--batch-size",
        "48",
        "--micro-batch-size",
        "32",
        "--steps",
        "3",
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    (out,) = (root / "runs").iterdir()
    return out, proc


def test_train_writes_the_run_files_in_the_default_out_dir_and_nothing_else(trained):
    out, _ = trained
    assert {path.name for path in out.iterdir()} == RUN_FILES
    # The default is runs/train-<task>-<YYYYmmdd-HHMMSS>.
    assert out.name.startswith("train-digits-")
    time.strptime(out.name.removeprefix("train-digits-"), "%Y%m%d-%H%M%S")
    # Nothing else next to it (no temporary or staging files).
    assert [path.name for path in out.parent.parent.iterdir()] == ["runs"]
    assert [path.name for path in out.parent.iterdir()] == [out.name]


def test_metrics_have_one_row_per_optimizer_step_with_the_columns(trained):
    out, _ = trained
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert set(row) == METRIC_COLUMNS
        assert math.isfinite(row["loss"])
        assert row["grad_norm"] > 0
        assert row["micro_batches"] == 2  # 48 = 32 + 16
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["samples"] for row in rows] == [48, 96, 144]
    assert all(row["lr"] == pytest.approx(get_task("digits").default_lr) for row in rows)
    times = [row["time"] for row in rows]
    assert times == sorted(times)
    assert times[0] > 0


def test_summary_and_validation_are_parsed_and_agree(trained):
    out, _ = trained
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"] == "32x2"
    assert summary["effective_batch"] == 48
    assert summary["micro_batch_size"] == 32
    assert summary["accumulation_steps"] == 2
    assert summary["optimizer_steps"] == 3
    assert summary["samples_seen"] == 144
    assert summary["metric"] == "accuracy"
    assert summary["peak_memory_bytes"] > 0
    assert summary["wall_seconds"] > 0
    assert summary["samples_per_second"] > 0
    validation = read_jsonl(out / "validation.jsonl")
    # 3 steps are less than an epoch: one validation, after the last step.
    assert len(validation) == 1
    assert validation[0]["step"] == 3
    assert validation[0]["samples"] == 144
    assert 0.0 <= validation[0]["val_metric"] <= 1.0
    assert summary["final_metric"] == validation[-1]["val_metric"]
    assert summary["history"] == validation


def test_progress_on_stderr_and_summary_on_stdout(trained):
    out, proc = trained
    assert "step 3/3 (100%)" in proc.stderr
    assert "samples/s" in proc.stderr
    assert "ETA" in proc.stderr
    assert "done: 3 optimizer steps, 144 samples" in proc.stdout
    assert "validation accuracy: final" in proc.stdout
    assert "peak memory" in proc.stdout
    assert f"results in runs/{out.name}" in proc.stdout


def test_checkpoint_equals_plain_full_batch_training_and_naive_loop_does_not(trained):
    out, _ = trained
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    assert checkpoint["extra"]["step"] == 3
    assert checkpoint["extra"]["config"]["micro_batch_size"] == 32
    state = checkpoint["model"]
    reference = _reference_run(48, 32, 3, naive=False)
    naive = _reference_run(48, 32, 3, naive=True)
    exact_gap = _norm_gap(state, reference)
    naive_gap = _norm_gap(naive, reference)
    assert exact_gap < FLOAT32_RTOL, exact_gap
    # Negative control: the same comparison catches mean-of-means weighting of 32 + 16.
    assert naive_gap > 100 * FLOAT32_RTOL, naive_gap


def test_plain_progress_logs_first_and_last_step_with_rate_and_eta():
    stream = io.StringIO()
    with progress("digits 8x2", total_steps=4, stream=stream, interval=3600) as on_step:
        for step in range(1, 5):
            on_step(StepLog(step, 16 * step, 1.0 / step, 1e-3, 0.5, 0.5 * step))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2  # first and last step; the interval mutes the others
    assert lines[0].startswith("digits 8x2: step 1/4 (25%)")
    assert "32 samples/s" in lines[0]  # 16 samples in 0.5 s
    assert "ETA 0:00:02" in lines[0]  # 3 steps left at 0.5 s each, rounded
    assert lines[1].startswith("digits 8x2: step 4/4 (100%)")
    assert lines[1].endswith("ETA 0:00:00")


# --- bad usage and input: exit 2, one line on stderr, nothing written --------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "nope"], "invalid choice: 'nope'"),
        (["--task", "digits", "--epochs", "1", "--steps", "2"], "not allowed with"),
        (["--task", "digits", "--micro-batch-size", "auto"], "needs --memory-budget"),
        (["--steps", "2"], "--task is required (or --resume DIR"),
    ],
)
def test_bad_input_subprocess_exits_2_with_one_line_and_writes_nothing(tmp_path, args, message):
    # No --out: the default runs/... folder must not be created either.
    proc = _run_cli("train", *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


def _main_exit(capsys, *args: str) -> tuple[int, str]:
    code = main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "0"], "must be a positive integer"),
        (["--batch-size", "8", "--micro-batch-size", "16"], "larger than --batch-size"),
        (["--micro-batch-size", "x"], "neither a positive integer nor 'auto'"),
        (["--norm", "group"], "not available for the 'digits' task"),
        (["--norm", "layer"], "invalid choice: 'layer'"),
        (["--threads", "0"], "must be a positive integer"),
        (["--steps", "0"], "must be a positive integer"),
        (["--warmup", "-1"], "must be >= 0"),
        (["--lr", "nan"], "must be a finite number > 0"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--accum-dtype", "int8"], "invalid choice: 'int8'"),
        (["--lr-scaling", "cubic"], "invalid choice: 'cubic'"),
        (["--memory-budget", "lots"], "is not a byte count"),
        (["--memory-budget", "2GiB", "--micro-batch-size", "8"], "only applies with"),
        (["--memory-budget", "1KiB", "--micro-batch-size", "auto"], "even micro_batch_size=1"),
        (["--bn", "pooled", "--norm", "group"], "--norm group builds none"),
        (["--bn", "ghost"], "invalid choice: 'ghost'"),
        (["--checkpoint-every", "0"], "'0' is not N, Nstep or Nmicro with N >= 1"),
        (["--checkpoint-every", "5m"], "'5m' is not N, Nstep or Nmicro"),
        (["--checkpoint-every", "2.5"], "'2.5' is not N, Nstep or Nmicro"),
    ],
)
def test_bad_options_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "deep" / "out"
    code, err = _main_exit(capsys, "--task", "digits", *args, "--out", str(out))
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_out_under_a_regular_file_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    code, err = _main_exit(capsys, "--task", "digits", "--out", str(blocker / "run"))
    assert code == 2
    assert "is not a directory" in err
    assert [path.name for path in tmp_path.iterdir()] == ["file.txt"]
    assert blocker.read_text() == "not a folder"


def test_non_empty_out_dir_exits_2_and_is_left_alone(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier results")
    code, err = _main_exit(capsys, "--task", "digits", "--out", str(out))
    assert code == 2
    assert "not empty" in err
    assert [path.name for path in out.iterdir()] == ["keep.txt"]
    assert [path.name for path in tmp_path.iterdir()] == ["out"]


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0,
    reason="root may write into read-only folders",
)
def test_read_only_parent_exits_2(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code, err = _main_exit(capsys, "--task", "digits", "--out", str(locked / "run"))
    finally:
        locked.chmod(0o755)
    assert code == 2
    assert "not writable" in err
    assert list(locked.iterdir()) == []


def test_tensorboard_gets_the_metrics_rows_and_the_validation_metric(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    argv = ["train", "--task", "digits", "--batch-size", "64", "--micro-batch-size", "16"]
    assert main([*argv, "--steps", "3", "--out", str(out), "--tensorboard"]) == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [(event.step, event.value) for event in events.Scalars("train/loss")]
    assert losses == [(row["step"], pytest.approx(row["loss"], rel=1e-6)) for row in rows]
    (validation,) = events.Scalars("validation/accuracy")
    summary = json.loads((out / "summary.json").read_text())
    assert (validation.step, validation.value) == (3, pytest.approx(summary["final_metric"]))


def test_a_resumed_run_goes_on_writing_tensorboard_events(tmp_path, capsys):
    """`train --resume DIR` (the command printed at a stop) on a run started with --tensorboard
    logged nothing more to TensorBoard: the choice was not saved, so the events silently ended
    where the run was stopped."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def steps(folder: Path) -> list[int]:
        events = EventAccumulator(str(folder / "tensorboard"))
        events.Reload()
        return sorted({event.step for event in events.Scalars("train/loss")})

    out, plain = tmp_path / "run", tmp_path / "plain"
    argv = ["train", "--task", "digits", "--batch-size", "64", "--steps"]
    assert main([*argv, "2", "--out", str(out), "--tensorboard"]) == 0
    assert main(["train", "--resume", str(out), "--steps", "4"]) == 0
    assert steps(out) == [1, 2, 3, 4]
    assert json.loads((out / "config.json").read_text())["tensorboard"] is True
    # Control: a run started without --tensorboard writes no events when resumed.
    assert main([*argv, "2", "--out", str(plain)]) == 0
    assert main(["train", "--resume", str(plain), "--steps", "3"]) == 0
    assert not (plain / "tensorboard").exists()


def test_tensorboard_without_the_package_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    argv = ["train", "--task", "digits", "--steps", "1", "--out", str(tmp_path / "run")]
    assert main([*argv, "--tensorboard"]) == 2
    assert "pip install 'gradaccum[tensorboard]'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
