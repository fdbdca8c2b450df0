"""`gradaccum train`: checkpoints, stopping by signal and `--resume`, run as a user runs them.

Every run trains `digits` with batch 64 in micro-batches of 4 (16 per window) for 26 steps: step
23 is the epoch's shorter last batch (30 items, 8 micro-batches, settled by `flush()`) and the
run validates after it. A run stopped (by SIGTERM, or killed by SIGKILL) and resumed in a fresh
process must end with model, optimizer, scheduler and Accumulator states bitwise equal to the
uninterrupted run, and with each step logged once. The negative control for "bitwise" is the same
training with micro-batches of 32: mathematically the same steps and equal to float32 rounding,
but not bitwise, so the comparison cannot be passed by an exact-in-math but different path.

Most stops use the test hook `GRADACCUM_TEST_SIGNAL_AT=STEP:MICRO:SIG` of `tests.cli.signal_at`
(the run sends itself the signal at that exact position; the hook is a patch of the tests, not
part of the library), so a stop lands mid-window deterministically. One test
sends a real SIGTERM from outside while the run is going, wherever it lands. Independent
subprocesses of a test run concurrently to keep the file fast.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gradaccum.cli import main
from gradaccum.experiments.folders import run_folder, stop_on_signals
from tests.cli._helpers import read_jsonl, subprocess_env
from tests.cli.signal_at import HOOK
from tests.state import assert_bitwise

_TIMEOUT = 120
STEPS = 26
TRAIN = ["train", "--task", "digits", "--batch-size", "64", "--micro-batch-size", "4"]
TRAIN += ["--steps", str(STEPS)]
STATES = ("model", "optimizer", "scheduler", "accumulator")


def _start(args: list[str], hook: str | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in subprocess_env().items() if k != HOOK}
    if hook is not None:
        env[HOOK] = hook
    return subprocess.Popen(
        [sys.executable, "-m", "tests.cli.signal_at", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(procs: list[subprocess.Popen[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Wait for every process; none outlives the test."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=_TIMEOUT)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def _run_all(jobs: list[tuple[list[str], str | None]]) -> list[subprocess.CompletedProcess[str]]:
    """Run several `gradaccum` command lines at once, each with its test hook (or none)."""
    return _finish([_start(args, hook) for args, hook in jobs])


def _checkpoint(folder: Path) -> dict[str, Any]:
    return torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=True)


def _without_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "time"} for row in rows]


def _assert_same_run(folder: Path, reference: Path, steps: int = STEPS) -> None:
    """Final states bitwise equal; metrics (but the clock) and validation rows equal."""
    final, expected = _checkpoint(folder), _checkpoint(reference)
    assert final["extra"]["finished"] is True
    assert_bitwise({k: final[k] for k in STATES}, {k: expected[k] for k in STATES})
    rows = read_jsonl(folder / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))  # each step once
    assert _without_time(rows) == _without_time(read_jsonl(reference / "metrics.jsonl"))
    assert read_jsonl(folder / "validation.jsonl") == read_jsonl(reference / "validation.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted run, and the control: the same steps with micro-batches of 32."""
    root = tmp_path_factory.mktemp("reference")
    control_args = [*TRAIN, "--micro-batch-size", "32", "--out", str(root / "control")]
    done = _run_all([([*TRAIN, "--out", str(root / "reference")], None), (control_args, None)])
    for result in done:
        assert result.returncode == 0, result.stderr
    return {"reference": root / "reference", "control": root / "control"}


def test_control_is_equal_to_rounding_but_not_bitwise(runs):
    """Negative control: the bitwise comparison fails for an exact-in-math but different split."""
    reference, control = _checkpoint(runs["reference"]), _checkpoint(runs["control"])
    gaps = [
        float((control["model"][k] - v).norm() / v.norm()) for k, v in reference["model"].items()
    ]
    assert max(gaps) < 1e-5  # the same training, to float32 rounding
    with pytest.raises(AssertionError):
        assert_bitwise(control["model"], reference["model"])


# Stop positions (steps done, micro-batches of the next window): mid-window. (The mid-window stop
# in the epoch's shorter last batch is in the SIGKILL test.)
STOPS = [(5, 7)]


@pytest.mark.timeout(_TIMEOUT)
def test_sigterm_mid_window_then_resume_is_bitwise_equal_to_uninterrupted(tmp_path, runs):
    folders = {stop: tmp_path / f"stop-{stop[0]}-{stop[1]}" for stop in STOPS}
    stopped = _run_all([([*TRAIN, "--out", str(folders[s])], f"{s[0]}:{s[1]}:TERM") for s in STOPS])
    for (step, micro), result in zip(STOPS, stopped, strict=True):
        folder = folders[(step, micro)]
        assert result.returncode == 0, result.stderr
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith(f"gradaccum train: SIGTERM received; stopped after step {step} ")
        assert f"and {micro} of the " in line
        assert line.endswith(f"resume with: gradaccum train --resume {folder}")
        assert "done:" not in result.stdout
        assert {p.name for p in folder.iterdir()} == {
            "config.json",
            "metrics.jsonl",
            "checkpoint.pt",
        }
        extra = _checkpoint(folder)["extra"]
        assert (extra["step"], extra["micro"], extra["finished"]) == (step, micro, False)
        assert len(read_jsonl(folder / "metrics.jsonl")) == step
    resumed = _run_all([(["train", "--resume", str(folders[s])], None) for s in STOPS])
    for stop, result in zip(STOPS, resumed, strict=True):
        assert result.returncode == 0, result.stderr
        assert f"resuming at step {stop[0]} (+{stop[1]} micro-batches)" in result.stdout
        assert f"done: {STEPS} optimizer steps" in result.stdout
        _assert_same_run(folders[stop], runs["reference"])


# A token budget: charlm, batches of 96 lines packed by 512 tokens (9 or 10 micro-batches a window;
# step 6, the epoch's last batch of 28 lines, 3), 7 steps. The control packs by 1024 instead.
TOKEN_STEPS = 7
TOKENS = ["train", "--task", "charlm", "--batch-size", "96", "--steps", str(TOKEN_STEPS)]
TOKEN_STOPS = [(2, 3), (5, 1)]  # mid-window, and in the epoch's shorter last batch


@pytest.fixture(scope="module")
def token_runs(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted token-budget run, and its control: the same batches packed by 1024."""
    root = tmp_path_factory.mktemp("tokens")
    done = _run_all(
        [
            ([*TOKENS, "--max-tokens", str(budget), "--out", str(root / name)], None)
            for name, budget in (("reference", 512), ("control", 1024))
        ]
    )
    for result in done:
        assert result.returncode == 0, result.stderr
    return {"reference": root / "reference", "control": root / "control"}


@pytest.mark.timeout(_TIMEOUT)
def test_token_budget_sigterm_mid_window_then_resume_is_bitwise_equal(
    tmp_path, capsys, monkeypatch, token_runs
):
    """`--max-tokens`: stopped mid-window (in this process, for speed), resumed in a fresh one."""
    reference, control = _checkpoint(token_runs["reference"]), _checkpoint(token_runs["control"])
    with pytest.raises(AssertionError):  # negative control: another packing is not bitwise equal
        assert_bitwise(control["model"], reference["model"])
    parts = [row["micro_batches"] for row in read_jsonl(token_runs["reference"] / "metrics.jsonl")]
    assert parts[5] < parts[0]  # the epoch's last, shorter batch packs into fewer micro-batches
    folders = {stop: tmp_path / f"stop-{stop[0]}-{stop[1]}" for stop in TOKEN_STOPS}
    for (step, micro), folder in folders.items():
        monkeypatch.setenv(HOOK, f"{step}:{micro}:TERM")
        assert main([*TOKENS, "--max-tokens", "512", "--out", str(folder)]) == 0
        monkeypatch.delenv(HOOK)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"stopped after step {step} of {TOKEN_STEPS} and {micro} of the {parts[step]} " in (
            line
        )
        extra = _checkpoint(folder)["extra"]
        assert (extra["step"], extra["micro"], extra["finished"]) == (step, micro, False)
    resumed = _run_all([(["train", "--resume", str(folders[s])], None) for s in TOKEN_STOPS])
    for stop, result in zip(TOKEN_STOPS, resumed, strict=True):
        assert result.returncode == 0, result.stderr
        assert "charlm 96@512t: batch 96 = micro-batches packed by length" in result.stdout
        assert f"resuming at step {stop[0]} (+{stop[1]} micro-batches)" in result.stdout
        _assert_same_run(folders[stop], token_runs["reference"], TOKEN_STEPS)


def _run_and_send_sigterm(out: Path) -> subprocess.CompletedProcess[str]:
    """Start a training into `out`; SIGTERM it from here once it has logged 2 steps."""
    proc = _start([*TRAIN, "--out", str(out)])
    try:
        deadline = time.monotonic() + _TIMEOUT
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
    finally:
        (result,) = _finish([proc])
    return result


@pytest.mark.timeout(3 * _TIMEOUT)
def test_external_sigterm_leaves_a_checkpoint_and_the_resume_is_bitwise_equal(tmp_path, runs):
    """A real `kill -TERM` from outside while the run trains, wherever it lands."""
    # The signal is sent once 2 of the 26 steps are logged; the other 24 take about 3 s. If this
    # process is starved that long on a loaded machine, the run ends before the signal comes (or
    # exits by it after its last step): nothing was interrupted, so run again in a new folder.
    for attempt in range(3):
        out = tmp_path / f"run-{attempt}"
        result = _run_and_send_sigterm(out)
        finished = (out / "checkpoint.pt").exists() and _checkpoint(out)["extra"]["finished"]
        if not finished or "SIGTERM received" in result.stderr:
            break
    assert result.returncode == 0, result.stderr
    assert "SIGTERM received; stopped after step" in result.stderr
    extra = _checkpoint(out)["extra"]
    assert extra["finished"] is False, "the run ended before the signal came"
    assert 2 <= extra["step"] < STEPS
    (resumed,) = _run_all([(["train", "--resume", str(out)], None)])
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_run(out, runs["reference"])


# (--checkpoint-every, where the run is killed, the last checkpoint's position before it). With
# 7micro, the last checkpoint falls after 5 of the 8 micro-batches of step 23, the epoch's last.
KILLS = [("5", (7, 3), (5, 0)), ("7micro", (22, 7), (22, 5))]


@pytest.mark.timeout(_TIMEOUT)
def test_sigkill_after_a_checkpoint_then_resume_logs_each_step_once(tmp_path, runs):
    folders = [tmp_path / f"every-{every}" for every, _, _ in KILLS]
    killed = _run_all(
        [
            ([*TRAIN, "--checkpoint-every", every, "--out", str(folder)], f"{at[0]}:{at[1]}:KILL")
            for (every, at, _), folder in zip(KILLS, folders, strict=True)
        ]
    )
    for (_, at, saved), folder, result in zip(KILLS, folders, killed, strict=True):
        assert result.returncode == -signal.SIGKILL, result.stderr
        extra = _checkpoint(folder)["extra"]
        assert (extra["step"], extra["micro"]) == saved
        # Steps logged after the last checkpoint (if any): the resume drops them, not repeats them.
        assert len(read_jsonl(folder / "metrics.jsonl")) == at[0]
    resumed = _run_all([(["train", "--resume", str(folder)], None) for folder in folders])
    for folder, result in zip(folders, resumed, strict=True):
        assert result.returncode == 0, result.stderr
        _assert_same_run(folder, runs["reference"])


@pytest.mark.timeout(_TIMEOUT)
def test_second_signal_exits_at_once_without_waiting_for_the_boundary(tmp_path):
    """SIGTERM then SIGINT at one position: exit 130 at once, without the stop's checkpoint.

    The folder stays with its last periodic checkpoint (step 2), not one at the stop position.
    (Without any checkpoint the folder is removed: see the crash test below.)
    """
    out = tmp_path / "run"
    (result,) = _run_all([([*TRAIN, "--checkpoint-every", "2", "--out", str(out)], "3:5:TERM+INT")])
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "gradaccum train: interrupted"
    assert "stopped after" not in result.stderr
    extra = _checkpoint(out)["extra"]
    assert (extra["step"], extra["micro"]) == (2, 0)
    assert len(read_jsonl(out / "metrics.jsonl")) == 3


# ----- bad --resume folders and flags: exit 2, one line, the folder left as it was --------------


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A run stopped by SIGTERM at step 1, micro-batch 3 (in this process, for speed)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    os.environ[HOOK] = "1:3:TERM"
    try:
        assert main([*TRAIN, "--out", str(out)]) == 0
    finally:
        del os.environ[HOOK]
    assert _checkpoint(out)["extra"]["micro"] == 3
    return out


def _damage(folder: Path, how: str) -> None:
    checkpoint, config = folder / "checkpoint.pt", folder / "config.json"
    if how == "no-checkpoint":
        checkpoint.unlink()
    elif how == "truncated-checkpoint":
        checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    elif how == "no-config":
        config.unlink()
    elif how == "damaged-config":
        config.write_text("{not json")
    elif how == "edited-config":
        config.write_text(config.read_text().replace('"lr": null', '"lr": 0.5'))
    elif how == "edited-micro-batch-size":  # other accumulation steps: the Accumulator refuses
        text = config.read_text()
        config.write_text(text.replace('"micro_batch_size": 4', '"micro_batch_size": 8'))
    elif how == "inconsistent-position":
        payload = torch.load(checkpoint, weights_only=True)
        payload["extra"]["micro"] = 4  # the Accumulator holds 3 micro-batches
        torch.save(payload, checkpoint)
    elif how == "other-model":
        payload = torch.load(checkpoint, weights_only=True)
        payload["model"]["classifier.3.weight"] = torch.zeros(3, 64)
        torch.save(payload, checkpoint)


BAD_FOLDERS = [
    ("no-checkpoint", ": holds no checkpoint.pt: the run stopped before its first checkpoint"),
    ("truncated-checkpoint", "cannot read checkpoint"),
    ("no-config", "holds no config.json, so it is not a run folder of `gradaccum train`"),
    ("damaged-config", "config.json is damaged (JSONDecodeError"),
    ("edited-config", "was written by another configuration than config.json describes"),
    ("edited-micro-batch-size", "than config.json describes (they differ in: micro_batch_size)"),
    ("inconsistent-position", "is inconsistent: its Accumulator holds 3 micro-batches"),
    ("other-model", "holds classifier.3.weight of shape (3, 64), the model has (10, 64)"),
]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize(("how", "message"), BAD_FOLDERS, ids=[b[0] for b in BAD_FOLDERS])
def test_unusable_resume_folder_exits_2_and_changes_nothing(
    tmp_path, capsys, stopped, how, message
):
    folder = tmp_path / "run"
    shutil.copytree(stopped, folder)
    _damage(folder, how)
    before = _snapshot(folder)
    rng, threads = _process_rng(), torch.get_num_threads()
    code = main(["train", "--resume", str(folder)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"gradaccum train: error: --resume {folder}: ")
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert _snapshot(folder) == before
    # Nor does the process change: not its RNG states (even when the refusal comes after the
    # checkpoint was loaded, RNG states included), nor its thread count.
    assert_bitwise(_process_rng(), rng)
    assert torch.get_num_threads() == threads


def _process_rng() -> list[Any]:
    kind, keys, *rest = np.random.get_state()
    return [random.getstate(), kind, torch.from_numpy(keys.copy()), rest, torch.get_rng_state()]


def test_starting_again_into_a_stopped_run_folder_points_to_resume(capsys, stopped):
    before = _snapshot(stopped)
    code = main([*TRAIN, "--out", str(stopped)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"continue it with: gradaccum train --resume {stopped} (or choose a new folder)" in err
    assert _snapshot(stopped) == before


def test_undamaged_copy_resumes_to_the_uninterrupted_result(tmp_path, capsys, stopped, runs):
    """Positive control of the damage tests: the same folder, undamaged, resumes fine."""
    folder = tmp_path / "run"
    shutil.copytree(stopped, folder)
    assert main(["train", "--resume", str(folder)]) == 0
    assert "resuming at step 1 (+3 micro-batches)" in capsys.readouterr().out
    _assert_same_run(folder, runs["reference"])


def test_finished_run_cannot_be_resumed_without_more_steps(capsys, runs):
    before = _snapshot(runs["reference"])
    for more in ([], ["--steps", str(STEPS)], ["--steps", "3"]):
        code = main(["train", "--resume", str(runs["reference"]), *more])
        err = capsys.readouterr().err
        assert code == 2
        assert ("already finished" if more[-1:] != ["3"] else "outside this run of 3 steps") in err
        assert "give more --epochs or --steps" in err
    assert _snapshot(runs["reference"]) == before


@pytest.mark.timeout(_TIMEOUT)
def test_a_finished_run_extended_equals_the_longer_run(tmp_path, capsys, runs):
    """`--resume DIR --steps N` continues a finished run: optimizer and schedule intact."""
    short = tmp_path / "short"
    assert main([*TRAIN[:-1], "20", "--out", str(short)]) == 0
    assert _checkpoint(short)["extra"]["finished"] is True
    with pytest.raises(AssertionError):  # negative control: 20 steps are not 26
        assert_bitwise(_checkpoint(short)["model"], _checkpoint(runs["reference"])["model"])
    assert main(["train", "--resume", str(short), "--steps", str(STEPS)]) == 0
    assert "resuming at step 20 (+0 micro-batches)" in capsys.readouterr().out
    final, expected = _checkpoint(short), _checkpoint(runs["reference"])
    assert final["extra"]["finished"] is True
    assert_bitwise({k: final[k] for k in STATES}, {k: expected[k] for k in STATES})
    rows = read_jsonl(short / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert json.loads((short / "config.json").read_text())["config"]["steps"] == STEPS
    assert json.loads((short / "summary.json").read_text())["optimizer_steps"] == STEPS


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resume", "{missing}"], "--resume {missing}: no such directory"),
        (["--resume", "{file}"], "--resume {file}: not a directory"),
        (["--resume", "{run}", "--lr", "0.1"], "--lr cannot be combined with --resume"),
        (["--resume", "{run}", "--task", "digits", "--seed", "0"], "--task, --seed cannot be"),
        (["--resume", "{run}", "--out", "{missing}"], "--out cannot be combined with --resume"),
        (["--resume", "{run}", "--warmup", "3"], "--warmup cannot be combined with --resume"),
    ],
)
def test_bad_resume_flags_exit_2(tmp_path, capsys, stopped, args, message):
    names = {"missing": tmp_path / "missing", "file": tmp_path / "file.txt", "run": stopped}
    names["file"].write_text("not a folder")
    before = _snapshot(stopped)
    code = main(["train", *(arg.format(**names) for arg in args)])
    err = capsys.readouterr().err
    assert code == 2
    assert message.format(**names) in err
    assert len(err.strip().splitlines()) == 1
    assert _snapshot(stopped) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


# ----- the pieces, in-process --------------------------------------------------------------------


def test_first_signal_requests_a_stop_second_raises_and_handlers_are_restored():
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    with stop_on_signals() as request:
        assert not request
        os.kill(os.getpid(), signal.SIGTERM)
        assert request.signal == "SIGTERM"  # and the process goes on
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def _crash(folder: Path, files: list[str], error: BaseException) -> None:
    """Write `files` in a `run_folder(folder)`, then fail with `error`."""
    with run_folder(folder, keep_if="checkpoint.pt"):
        for name in files:
            (folder / name).write_bytes(b"data")
        raise error


def test_crashed_run_folder_stays_only_with_a_checkpoint(tmp_path):
    """After an error, a folder holding a checkpoint stays (resumable); others are removed."""
    keep, drop = tmp_path / "a" / "keep", tmp_path / "b" / "drop"
    with pytest.raises(RuntimeError):
        _crash(keep, ["metrics.jsonl", "checkpoint.pt"], RuntimeError("crash"))
    with pytest.raises(KeyboardInterrupt):
        _crash(drop, ["metrics.jsonl"], KeyboardInterrupt())
    assert sorted(p.name for p in keep.iterdir()) == ["checkpoint.pt", "metrics.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # b/ was created for drop/: gone
    # An existing empty --out folder is emptied again, not removed.
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError):
        _crash(empty, ["metrics.jsonl", "config.json"], RuntimeError("crash"))
    assert empty.is_dir()
    assert list(empty.iterdir()) == []
