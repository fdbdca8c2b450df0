"""Token-budget micro-batches in the CLI: `train --max-tokens N` and `compare` configs `B@Nt`.

Each effective batch of charlm lines is packed by `gradaccum.packing.pack_by_tokens` (rows sorted
by length, at most N padded tokens per micro-batch) and the window ends with its last micro-batch.
The micro-batches a run reports are checked against a recount made here from the runner's
documented data order (per epoch a permutation drawn from `seed * 1_000_003 + epoch`, cut into
consecutive effective batches) and the public `pack_by_tokens`.

Exactness: `8x8`, `64x1` and `64@2048t` see the same batches of 64 in the same order, so they end
with the same parameters up to float32 rounding; `32@1024t` (effective batch 32) is the negative
control. The gap is measured per tensor as ||a - b|| / ||b|| (see tests/cli/test_train.py for why
not element-wise), leaving out the attention key bias: its exact gradient is zero (softmax ignores
a shift shared by all keys of a query), so float32 noise, divided by AdamW's sqrt(v), moves it by
about lr in a random direction whatever the split.

Resuming a token-budget run mid-window is tested in tests/cli/test_train_resume.py.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from gradaccum.batching import batch_size
from gradaccum.cli import main
from gradaccum.experiments.tasks import get_task
from gradaccum.packing import pack_by_tokens, sequence_lengths
from tests.cli._helpers import read_jsonl, run_cli

_TIMEOUT = 120
STEPS = 3
CONFIGS = ("8x8", "64x1", "64@2048t", "32@1024t")
EQUAL = ("8x8", "64x1", "64@2048t")  # effective batch 64: the same batches in the same order
FLOAT32_RTOL = 1e-5
D_MODEL = 64  # charlm's residual width: qkv.bias holds the q, k and v biases, 64 each


def _packed_windows(batch: int, max_tokens: int, steps: int) -> list[list[tuple[int, int]]]:
    """(rows, width) of every micro-batch of each of the first `steps` windows, recounted here."""
    train = get_task("charlm").make_data(0).train
    items = batch_size(train)
    windows: list[list[tuple[int, int]]] = []
    epoch = 0
    while len(windows) < steps:
        epoch += 1
        order = torch.randperm(items, generator=torch.Generator().manual_seed(epoch))
        for start in range(0, items, batch):
            if len(windows) == steps:
                break
            index = order[start : start + batch]
            rows = {key: value[index] for key, value in train.items()}
            parts = pack_by_tokens(rows, max_tokens)
            windows.append([(batch_size(p), max(sequence_lengths(p))) for p in parts])
    return windows


def _params_gap(state: dict, reference: dict) -> float:
    """Largest over tensors of ||a - b|| / ||b||, the key bias left out (see the docstring)."""
    assert state.keys() == reference.keys()
    gaps = []
    for key, ref in reference.items():
        a, b = state[key].float().clone(), ref.float().clone()
        if key.endswith("qkv.bias"):
            a[D_MODEL : 2 * D_MODEL] = b[D_MODEL : 2 * D_MODEL] = 0
        gaps.append(float((a - b).norm() / b.norm()))
    return max(gaps)


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("compare") / "cmp"
    proc = run_cli(
        "compare", "--task", "charlm", "--configs", *CONFIGS, "--steps", str(STEPS),
        "--out", str(out), timeout=_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("train") / "run"
    proc = run_cli(
        "train", "--task", "charlm", "--batch-size", "64", "--max-tokens", "1024",
        "--steps", str(STEPS), "--out", str(out), timeout=_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_train_packs_each_batch_by_the_budget_and_says_so(trained):
    out, proc = trained
    windows = _packed_windows(64, 1024, STEPS)
    assert all(rows * width <= 1024 for window in windows for rows, width in window)
    assert max(len(window) for window in windows) > 1  # really several micro-batches
    rows = read_jsonl(out / "metrics.jsonl")
    assert [row["micro_batches"] for row in rows] == [len(window) for window in windows]
    assert [row["samples"] for row in rows] == [64, 128, 192]  # every line counted once
    summary = json.loads((out / "summary.json").read_text())
    largest = max(rows for window in windows for rows, _ in window)
    most = max(len(window) for window in windows)
    mean = sum(len(window) for window in windows) / STEPS
    assert summary["config"] == "64@1024t"
    assert summary["effective_batch"] == 64
    assert summary["max_tokens"] == 1024
    assert summary["micro_batch_size"] == largest
    assert summary["accumulation_steps"] == most
    assert summary["micro_batches_per_step"] == pytest.approx(mean, abs=1e-4)
    config = json.loads((out / "config.json").read_text())["config"]
    assert (config["max_tokens"], config["micro_batch_size"]) == (1024, None)
    first = proc.stdout.splitlines()[0]
    assert first.startswith("gradaccum train: charlm 64@1024t: batch 64 = micro-batches packed")
    assert "each at most 1024 padded tokens" in first
    assert (
        f"micro-batches packed by 1024 tokens: {round(mean, 4):g} per step on average, at most "
        f"{most}; the largest {largest} rows" in proc.stdout
    )
    assert "charlm 64@1024t: step 3/3 (100%)" in proc.stderr


def test_compare_reports_token_configs_under_their_label(compared):
    out, proc = compared
    assert {path.name for path in out.iterdir()} == {
        "compare.json",
        "report.md", "curves.png", "memory.png", *CONFIGS,
    }  # fmt: skip
    report = (out / "report.md").read_text()
    for config in CONFIGS:
        assert f"| {config} |" in report
        assert any(line.split()[:1] == [config] for line in proc.stdout.splitlines()), config
    for config, batch, budget in (("64@2048t", 64, 2048), ("32@1024t", 32, 1024)):
        summary = json.loads((out / config / "summary.json").read_text())
        windows = _packed_windows(batch, budget, STEPS)
        mean = sum(len(window) for window in windows) / STEPS
        assert summary["config"] == config
        assert summary["max_tokens"] == budget
        assert summary["micro_batch_size"] == max(r for window in windows for r, _ in window)
        note = f"{config}: batch {batch} packed into micro-batches of at most {budget} padded"
        assert note in report
        assert note in proc.stdout
        assert f"{round(mean, 4):g} per step on average" in proc.stdout
    fixed = json.loads((out / "8x8" / "summary.json").read_text())
    assert (fixed["max_tokens"], fixed["micro_batch_size"], fixed["accumulation_steps"]) == (
        None,
        8,
        8,
    )
    assert "8x8: batch" not in report  # only token configs get a packing note


def test_same_effective_batch_ends_with_equal_parameters_whatever_the_split(compared):
    out, _ = compared
    rows = {config: read_jsonl(out / config / "metrics.jsonl") for config in CONFIGS}
    summaries = {c: json.loads((out / c / "summary.json").read_text()) for c in CONFIGS}
    models = {
        config: torch.load(out / config / "checkpoint.pt", weights_only=True)["model"]
        for config in CONFIGS
    }
    for config in ("8x8", "64@2048t"):
        for a, b in zip(rows[config], rows["64x1"], strict=True):
            assert a["samples"] == b["samples"]
            assert math.isclose(a["loss"], b["loss"], rel_tol=FLOAT32_RTOL)
        final, reference = summaries[config]["final_metric"], summaries["64x1"]["final_metric"]
        assert math.isclose(final, reference, rel_tol=FLOAT32_RTOL)
        gap = _params_gap(models[config], models["64x1"])
        assert gap < FLOAT32_RTOL, (config, gap)
    # Negative control: effective batch 32 instead of 64, caught by the same comparison.
    control = _params_gap(models["32@1024t"], models["64x1"])
    assert control > 1000 * FLOAT32_RTOL, control


# --- bad usage: exit 2, one line on stderr, nothing written --------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "0"], "'0' is not a positive integer: give the padded tokens"),
        (["--max-tokens", "-5"], "'-5' is not a positive integer"),
        (["--max-tokens", "2k"], "'2k' is not a positive integer"),
        (["--max-tokens", "2048", "--micro-batch-size", "8"], "both size the micro-batches"),
        (["--max-tokens", "2048", "--micro-batch-size", "auto", "--memory-budget", "1GiB"],
         "both size the micro-batches"),
        (["--max-tokens", "50"], "give --max-tokens 85 or more"),
        (["--task", "digits", "--max-tokens", "2048"], "use it with --task charlm"),
        (["--task", "shapes", "--max-tokens", "2048"], "use it with --task charlm"),
    ],
)  # fmt: skip
def test_bad_max_tokens_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    task = [] if "--task" in args else ["--task", "charlm"]
    out = tmp_path / "deep" / "out"
    code = main(["train", *task, *args, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    assert message in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert captured.out == ""  # nothing planned or trained first
    assert list(tmp_path.iterdir()) == []


def test_max_tokens_cannot_change_a_resumed_run(tmp_path, capsys, trained):
    folder = trained[0]
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    code = main(["train", "--resume", str(folder), "--max-tokens", "512"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--max-tokens cannot be combined with --resume" in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--task", "charlm", "--configs", "64@"], "malformed config '64@': write MICROxSTEPS"),
        (["--task", "charlm", "--configs", "64@2048"], "malformed config '64@2048'"),
        (["--task", "charlm", "--configs", "@2048t"], "malformed config '@2048t'"),
        (["--task", "charlm", "--configs", "64@2048T"], "or BATCH@TOKENSt, e.g. 64@2048t"),
        (["--task", "charlm", "--configs", "0@2048t"], "malformed config '0@2048t': write"),
        (["--task", "charlm", "--configs", "64@0t"], "malformed config '64@0t': write"),
        (["--task", "charlm", "--configs", "64@2048t", "64@2048t"], "given twice"),
        (["--task", "charlm", "--configs", "8x8", "64@50t"],
         "config '64@50t': 50 tokens is less than the longest training sequence (85 tokens), which "
         "cannot be split across micro-batches; give a budget of 85 tokens or more, e.g. 64@85t"),
        (["--task", "digits", "--configs", "8x8", "64@2048t"],
         "config '64@2048t': a B@Nt config packs token sequences by length, and the digits task's "
         "batches are not; use B@Nt with --task charlm, or MxK"),
        (["--task", "charlm", "--configs", "8x8", "--max-tokens", "2048"],
         "--max-tokens is not a compare option"),
    ],
)  # fmt: skip
def test_bad_token_configs_exit_2_and_write_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "new" / "cmp"
    code = main(["compare", *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
