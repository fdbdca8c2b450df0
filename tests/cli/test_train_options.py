"""`gradaccum train --bn`, `--init-from` and `--micro-batch-size auto`, through subprocesses.

- `--bn pooled` at 8x2 gives the first BatchNorm the running statistics of the full batch of 16
  after one step (both forwards see the same initial weights); `--bn micro` at 8x2 does not.
- `--bn frozen --init-from` keeps every running statistic of the initial checkpoint bitwise.
- `--micro-batch-size auto` records the planned size in config.json, and trains with it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli._helpers import run_cli, subprocess_env

FIRST_BN = "enc1.1"  # the U-Net's first BatchNorm: its input does not depend on other BN layers


def _model(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "checkpoint.pt", weights_only=True)["model"]


def _shapes(out: Path, *args: str) -> dict[str, torch.Tensor]:
    done = run_cli("train", "--task", "shapes", "--steps", "1", "--out", str(out), *args)
    assert done.returncode == 0, done.stderr
    return _model(out)


@pytest.mark.timeout(180)
def test_bn_pooled_gives_full_batch_running_statistics(tmp_path: Path) -> None:
    full = _shapes(tmp_path / "full", "--batch-size", "16", "--micro-batch-size", "16")
    pooled = _shapes(
        tmp_path / "pooled", "--batch-size", "16", "--micro-batch-size", "8", "--bn", "pooled"
    )
    micro = _shapes(tmp_path / "micro", "--batch-size", "16", "--micro-batch-size", "8")
    for name in ("running_mean", "running_var"):
        key = f"{FIRST_BN}.{name}"
        torch.testing.assert_close(pooled[key], full[key], rtol=1e-5, atol=1e-7)
        # NEGATIVE CONTROL: two updates from micro-batch statistics.
        gap = (micro[key] - full[key]).abs().max() / full[key].abs().max()
        assert gap > 1e-3, (name, float(gap))
    assert int(pooled[f"{FIRST_BN}.num_batches_tracked"]) == 1
    assert int(micro[f"{FIRST_BN}.num_batches_tracked"]) == 2


@pytest.mark.timeout(180)
def test_bn_frozen_from_a_checkpoint_keeps_running_statistics(tmp_path: Path) -> None:
    start = _shapes(tmp_path / "start")
    frozen = _shapes(
        tmp_path / "frozen",
        "--batch-size", "16",
        "--micro-batch-size", "4",
        "--bn", "frozen",
        "--init-from", str(tmp_path / "start" / "checkpoint.pt"),
    )  # fmt: skip
    stats = [k for k in start if "running_" in k or "num_batches" in k]
    assert stats
    for key in stats:
        assert torch.equal(frozen[key], start[key]), key
    assert not torch.equal(frozen["enc1.0.weight"], start["enc1.0.weight"])  # it did train


def test_bn_and_init_from_errors_exit_2(tmp_path: Path) -> None:
    done = run_cli("train", "--task", "shapes", "--norm", "group", "--bn", "pooled",
                   "--out", str(tmp_path / "a"))  # fmt: skip
    assert done.returncode == 2
    assert "--norm group builds none" in done.stderr
    done = run_cli("train", "--task", "digits", "--init-from", str(tmp_path / "missing.pt"),
                   "--out", str(tmp_path / "b"))  # fmt: skip
    assert done.returncode == 2
    assert "--init-from" in done.stderr
    assert not (tmp_path / "a").exists()
    assert not (tmp_path / "b").exists()


@pytest.mark.timeout(180)
def test_auto_micro_batch_size_is_planned_and_recorded(tmp_path: Path) -> None:
    out = tmp_path / "auto"
    done = run_cli("train", "--task", "charlm", "--batch-size", "64", "--steps", "2",
                   "--micro-batch-size", "auto", "--memory-budget", "24MiB",
                   "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())["config"]
    planned = config["micro_batch_size"]
    assert isinstance(planned, int)
    assert 1 < planned < 64  # the budget constrains it
    # The fastest size that fits, timed: why is recorded and printed.
    assert config["extra"]["planned_from"].startswith("auto, --memory-budget 24MiB: ")
    assert "items/s" in config["extra"]["planned_from"]
    largest = int(re.search(r"largest that fits: (\d+)", done.stdout).group(1))
    assert 1 < planned <= largest
    assert f"--micro-batch-size auto chose {planned} for --memory-budget 24MiB" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["micro_batch_size"] == planned
    # The same budget in `gradaccum plan` finds the same largest size that fits.
    shown = run_cli("plan", "--task", "charlm", "--batch-size", "64", "--memory-budget", "24MiB")
    assert f"chosen micro_batch_size = {largest}:" in shown.stdout
    missing = run_cli("train", "--task", "digits", "--micro-batch-size", "auto",
                      "--out", str(tmp_path / "x"))  # fmt: skip
    assert missing.returncode == 2
    assert "needs --memory-budget" in missing.stderr


@pytest.mark.timeout(180)
def test_resume_of_a_run_started_from_init_weights_needs_no_init_file(tmp_path: Path) -> None:
    """The run's own checkpoint replaces the --init-from weights; the file may be gone."""
    _shapes(tmp_path / "start")
    init = tmp_path / "init.pt"
    (tmp_path / "start" / "checkpoint.pt").rename(init)
    out = tmp_path / "run"
    args = ["train", "--task", "shapes", "--steps", "3", "--batch-size", "16",
            "--micro-batch-size", "8", "--bn", "pooled", "--out", str(out)]  # fmt: skip
    env = subprocess_env(GRADACCUM_TEST_SIGNAL_AT="1:1:TERM")
    stopped = subprocess.run(
        [sys.executable, "-m", "tests.cli.signal_at", *args, "--init-from", str(init)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr
    assert "SIGTERM received" in stopped.stderr
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["init_from"] == str(init.resolve())  # absolute, as given relative or not
    init.unlink()
    resumed = run_cli("train", "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "summary.json").read_text())["optimizer_steps"] == 3


def test_batchnorm_notes_use_the_cli_options(tmp_path: Path) -> None:
    done = run_cli("train", "--task", "shapes", "--steps", "1", "--batch-size", "16",
                   "--micro-batch-size", "8", "--out", str(tmp_path / "micro"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "see --bn pooled, frozen or group" in done.stderr
    assert "batchnorm='pooled'" not in done.stderr  # the library's Python-level warning
    frozen = run_cli("train", "--task", "shapes", "--steps", "1", "--bn", "frozen",
                     "--out", str(tmp_path / "frozen"))  # fmt: skip
    assert frozen.returncode == 0, frozen.stderr
    assert "without --init-from they are untrained" in frozen.stderr
    exact = run_cli("train", "--task", "shapes", "--steps", "1", "--batch-size", "16",
                    "--micro-batch-size", "16", "--out", str(tmp_path / "exact"))  # fmt: skip
    assert "note:" not in exact.stderr  # NEGATIVE CONTROL: no accumulation, nothing to say


@pytest.mark.timeout(180)
def test_recalibrate_sets_exact_statistics_before_validation(tmp_path: Path) -> None:
    """`--recalibrate 3`: the saved running statistics are PreciseBN's over 3 training batches."""
    from gradaccum.batchnorm import recalibrate
    from gradaccum.experiments.tasks import get_task

    common = ["--batch-size", "16", "--micro-batch-size", "8", "--steps", "2"]
    calibrated = _shapes(tmp_path / "recal", *common, "--recalibrate", "3")
    plain = _shapes(tmp_path / "plain", *common)
    task = get_task("shapes")
    images, masks = task.make_data(0).train
    reference = task.make_model(0)
    reference.load_state_dict(calibrated)
    recalibrate(reference, ((images[i : i + 16], masks[i : i + 16]) for i in (0, 16, 32)), 3)
    expected = reference.state_dict()
    stats = [k for k in expected if k.endswith(("running_mean", "running_var"))]
    for key in stats:
        torch.testing.assert_close(calibrated[key], expected[key], rtol=1e-5, atol=1e-6)
    # NEGATIVE CONTROL: without --recalibrate the statistics are the momentum averages.
    gap = max(float((plain[k] - expected[k]).abs().max()) for k in stats)
    assert gap > 1e-2
