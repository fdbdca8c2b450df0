"""`gradaccum plan`: the memory plan table (exit 0), nothing fits (exit 1), bad input (exit 2)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gradaccum.cli import build_parser, main
from gradaccum.cli._args import byte_count
from gradaccum.memory import parse_bytes

REPO = Path(__file__).resolve().parents[2]
_TIMEOUT = 60


@pytest.mark.timeout(_TIMEOUT + 20)
def test_plan_subprocess_prints_the_table_and_the_train_command():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradaccum.cli",
            "plan",
            "--task",
            "shapes",
            "--batch-size",
            "64",
            "--memory-budget",
            "24MiB",
        ],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
        check=False,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for row in (
        "parameters",
        "gradients",
        "optimizer state",
        "activations per item",
        "predicted peak at m=",
        "memory budget",
        "25,165,824",
    ):
        assert row in out, out
    chosen = int(out.split("chosen micro_batch_size = ")[1].split(":")[0])
    assert 1 < chosen < 64  # the budget constrains it, and it still fits something
    assert f"--batch-size 64 --micro-batch-size {chosen}" in out


def test_plan_with_a_model_factory_and_sgd(capsys):
    code = main(
        [
            "plan",
            "--model",
            "tests.cli.factories:additive",
            "--memory-budget",
            "1MiB",
            "--optimizer",
            "sgd",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "optimizer state" in captured.out
    assert "train with" not in captured.out  # no task to train


def test_plan_exits_1_when_nothing_fits(capsys):
    code = main(["plan", "--task", "digits", "--memory-budget", "64KiB"])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1, captured.err
    assert "even micro_batch_size=1 needs" in captured.err
    assert "raise the budget" in captured.err


def test_plan_help_describes_the_budget(capsys):
    assert main(["plan", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--memory-budget" in help_text
    assert "largest micro-batch" in help_text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory-budget", "1GiB"], "one of the arguments --task --model is required"),
        (["--task", "digits"], "the following arguments are required: --memory-budget"),
        (["--task", "digits", "--memory-budget", "1GiB", "--margin", "1.5"], "--margin 1.5"),
        (["--task", "digits", "--memory-budget", "1GiB", "--batch-size", "99999"], "larger"),
        (["--task", "nope", "--memory-budget", "1GiB"], "unknown task 'nope'"),
        (["--model", "nocolon", "--memory-budget", "1GiB"], "not of the form module:factory"),
        (["--task", "digits", "--memory-budget", "lots"], "is not a size"),
        (["--task", "digits", "--memory-budget", "2 parsecs"], "is not a size"),
        (["--task", "digits", "--memory-budget", "0"], "must be more than 0 bytes"),
    ],
)
def test_plan_bad_input_exits_2_with_one_line(capsys, args, message):
    code = main(["plan", *args])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1, captured.err
    assert message in captured.err


def test_a_model_with_no_trainable_parameter_exits_2_with_one_line(capsys):
    """A factory whose model is all frozen made AdamW([]) raise a traceback (exit 1)."""
    argv = ["plan", "--model", "tests.cli.factories:frozen", "--memory-budget", "1GiB"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1, captured.err
    assert "no parameter requires grad" in captured.err
    assert "unfreeze some to plan" in captured.err
    # Negative control: the same model and batch, trainable, is planned.
    assert main([*argv[:2], "tests.cli.factories:additive", *argv[3:]]) == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("512MB", 512 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("2GiB", 2 * 2**30),
        ("64 kib", 64 * 1024),
        ("3b", 3),
    ],
)
def test_memory_budget_forms(text, expected):
    assert parse_bytes(byte_count(text)) == expected


def test_a_negative_memory_budget_is_named(capsys):
    assert main(["plan", "--task", "digits", "--memory-budget", "-1GB"]) == 2
    assert "'-1GB' is negative" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "train_with"),
    [
        (
            ["--norm", "group", "--precision", "bf16"],
            "train with: gradaccum train --task shapes --batch-size 8 --norm group --precision "
            "bf16 --micro-batch-size ",
        ),
        (["--precision", "fp16"], "--batch-size 8 --precision fp16 --micro-batch-size "),
        ([], "train with: gradaccum train --task shapes --batch-size 8 --micro-batch-size "),
        (["--optimizer", "sgd"], None),  # train steps AdamW: no train command fits this plan
    ],
)
def test_the_train_command_is_the_setup_the_plan_measured(capsys, options, train_with):
    """`plan --norm group --precision bf16` once printed `train with: gradaccum train --task shapes
    --batch-size 8 --micro-batch-size M`: an fp32 BatchNorm model, not the one measured, whose
    peak at M may not fit the budget; and an SGD plan suggested train, which steps AdamW."""
    argv = ["plan", "--task", "shapes", "--batch-size", "8", "--memory-budget", "64MiB", *options]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "train with" in line]
    if train_with is None:
        assert lines == []
    else:
        assert len(lines) == 1
        assert train_with in lines[0]


def test_the_printed_train_command_runs_as_printed_with_a_spaced_budget(capsys):
    """`plan --memory-budget "2 GiB"` printed `... --memory-budget 2 GiB`: pasted into a shell,
    `GiB` is a stray argument and train refuses the command."""
    assert main(["plan", "--task", "digits", "--memory-budget", " 2 GiB "]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("train with: "))
    command = shlex.split(line.split("(or ", 1)[0].removeprefix("train with: "))
    auto = [*command[:6], *shlex.split(line.split("(or ", 1)[1].rstrip(")"))]  # up to the batch
    for words in (command, auto):
        args, unknown = build_parser().parse_known_args(words[1:])
        assert unknown == [], words
    assert args.memory_budget == "2GiB"
