"""`gradaccum plan`: not yet available; it says so on stderr, names what to do, and exits 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradaccum.cli import UsageError, main
from gradaccum.cli.plan import parse_memory_budget

REPO = Path(__file__).resolve().parents[2]
_TIMEOUT = 60


@pytest.mark.timeout(_TIMEOUT + 20)
def test_plan_subprocess_says_not_available_and_exits_1():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradaccum.cli",
            "plan",
            "--task",
            "digits",
            "--memory-budget",
            "2GiB",
        ],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
        check=False,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "not yet available" in proc.stderr
    assert "--micro-batch-size" in proc.stderr


def test_plan_with_a_model_factory_exits_1(capsys):
    code = main(["plan", "--model", "tests.cli.factories:additive"])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    assert "not yet available" in captured.err


def test_plan_help_documents_that_it_is_not_available(capsys):
    assert main(["plan", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "NOT YET AVAILABLE" in help_text
    assert "--micro-batch-size explicitly" in help_text
    assert "exits with code 1" in help_text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "one of the arguments --task --model is required"),
        (["--task", "nope"], "unknown task 'nope'"),
        (["--model", "nocolon"], "not of the form module:factory"),
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
def test_parse_memory_budget(text, expected):
    assert parse_memory_budget(text) == expected


def test_parse_memory_budget_rejects_negative():
    with pytest.raises(UsageError):
        parse_memory_budget("-1GB")
