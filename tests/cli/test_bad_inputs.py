"""Bad command-line inputs of a newcomer's first runs: one line on stderr, exit 2, nothing written.

Also: output piped to a reader that goes away (`| head`) neither prints a traceback nor stops the
run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from gradaccum.cli import main
from gradaccum.cli._args import thread_count

# (argv after the command's --out, what the one line must say)
BATCHNORM_CASES = {
    "bn pooled on digits": (
        ["train", "--task", "digits", "--bn", "pooled", "--steps", "1"],
        "--bn pooled acts on BatchNorm layers, and the digits model has none; drop --bn",
    ),
    "bn frozen on charlm": (
        ["train", "--task", "charlm", "--bn", "frozen", "--steps", "1"],
        "--bn frozen acts on BatchNorm layers, and the charlm model has none; drop --bn",
    ),
    "recalibrate on digits": (
        ["train", "--task", "digits", "--recalibrate", "5", "--steps", "1"],
        "--recalibrate 5 acts on BatchNorm layers, and the digits model has none; drop "
        "--recalibrate",
    ),
    "compare bn pooled on digits": (
        ["compare", "--task", "digits", "--configs", "8x1", "--bn", "pooled", "--steps", "1"],
        "--bn pooled acts on BatchNorm layers, and the digits model has none",
    ),
    "compare recalibrate on charlm": (
        ["compare", "--task", "charlm", "--configs", "8x1", "--recalibrate", "2", "--steps", "1"],
        "--recalibrate 2 acts on BatchNorm layers, and the charlm model has none",
    ),
}


def _one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"gradaccum {command}: error: ")
    return lines[0]


@pytest.mark.parametrize("case", list(BATCHNORM_CASES))
def test_batchnorm_options_on_a_model_without_batchnorm_are_refused(tmp_path, capsys, case):
    argv, expected = BATCHNORM_CASES[case]
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 2
    assert expected in _one_line_error(capsys, argv[0])
    assert list(tmp_path.iterdir()) == []


def test_batchnorm_options_on_a_model_with_batchnorm_are_accepted(tmp_path, capsys):
    """Negative control: on shapes (BatchNorm) the same options run."""
    argv = ["train", "--task", "shapes", "--bn", "pooled", "--recalibrate", "1", "--steps", "1"]
    assert main([*argv, "--batch-size", "4", "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "summary.json").is_file()


@pytest.mark.parametrize("command", ["train", "check"])
def test_the_norm_error_suggests_only_values_the_option_accepts(tmp_path, capsys, command):
    argv = [command, "--task", "digits", "--norm", "group"]
    if command == "train":
        argv += ["--steps", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    line = _one_line_error(capsys, command)
    assert "norm='group' is not available for the 'digits' task" in line
    suggested = set(re.findall(r"'(\w+)'", line.split(";", 1)[1])) - {"digits", "shapes", "group"}
    assert suggested == {"batch"}
    assert "none" not in line
    # Every value it suggests, --norm accepts.
    for value in suggested:
        argv = ["train", "--task", "digits", "--norm", value, "--steps", "1"]
        assert main([*argv, "--out", str(tmp_path / value)]) == 0
        capsys.readouterr()
    assert list(tmp_path.iterdir()) == [tmp_path / "batch"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["train", "--task", "digits", "--micro-batch-size", "auto", "--memory-budget", "-5MiB"],
            "argument --memory-budget: '-5MiB' is negative; give a size of more than 0 bytes",
        ),
        (
            ["plan", "--task", "digits", "--memory-budget", "-5MiB"],
            "'-5MiB' is negative; give a size of more than 0 bytes",
        ),
        (["train", "--task", "digits", "--lr", "-1e-3"], "'-1e-3' must be a finite number > 0"),
    ],
)
def test_a_negative_value_is_named_not_expected_one_argument(tmp_path, capsys, argv, expected):
    out = [] if argv[0] == "plan" else ["--out", str(tmp_path / "out")]
    assert main([*argv, *out]) == 2
    line = _one_line_error(capsys, argv[0])
    assert expected in line
    assert "expected one argument" not in line
    assert list(tmp_path.iterdir()) == []


def test_an_option_after_an_option_still_says_it_expected_a_value(capsys):
    """Negative control: `--memory-budget --lr 1` is still a missing value, not a joined one."""
    assert main(["train", "--task", "digits", "--memory-budget", "--lr", "1"]) == 2
    assert "argument --memory-budget: expected one argument" in _one_line_error(capsys, "train")


@pytest.mark.parametrize("command", ["train", "compare", "demo"])
def test_an_out_folder_under_proc_is_one_line_and_exit_2(capsys, command):
    argv = {
        "train": ["train", "--task", "digits", "--steps", "1"],
        "compare": ["compare", "--task", "digits", "--configs", "8x1", "--steps", "1"],
        "demo": ["demo"],
    }[command]
    assert main([*argv, "--out", "/proc/gradaccum-out"]) == 2
    line = _one_line_error(capsys, command)
    assert "--out /proc/gradaccum-out: cannot create it in /proc" in line


def test_an_out_folder_under_proc_in_a_subprocess_prints_no_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "gradaccum", *_TRAIN[:3], "--steps", "1", "--out", "/proc/x"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        "gradaccum train: error: --out /proc/x: cannot create it in /proc"
    )
    assert "Traceback" not in done.stderr


# ----- a reader that goes away ------------------------------------------------------------------

_TRAIN = ["train", "--task", "digits", "--steps", "40"]


def _run_with_closed_reader(tmp_path, stream: str, entry: str) -> tuple[int, str]:
    """Run a training with `stream` piped to a reader that closes after 10 bytes.

    Returns the exit code and what the other stream received.
    """
    out = tmp_path / "run"
    code = (
        "import sys; from gradaccum.cli import main; sys.exit(main(sys.argv[1:]))"
        if entry == "main"
        else "import sys; from gradaccum.cli import _main; sys.exit(_main(sys.argv[1:]))"
    )
    other = tmp_path / "other.txt"
    with open(other, "w") as sink:
        streams = {"stdout": sink, "stderr": sink, stream: subprocess.PIPE}
        command = [sys.executable, "-c", code, *_TRAIN, "--out", str(out)]
        proc = subprocess.Popen(command, **streams)  # type: ignore[call-overload]
        reader = proc.stdout if stream == "stdout" else proc.stderr
        assert reader is not None
        reader.read(10)
        reader.close()  # as `head -c 10` does
        returncode = proc.wait(timeout=120)
    return returncode, other.read_text()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_reader_that_goes_away_stops_neither_the_run_nor_prints_a_traceback(tmp_path, stream):
    returncode, other = _run_with_closed_reader(tmp_path, stream, "main")
    assert returncode == 0, other
    assert "Traceback" not in other
    assert "BrokenPipeError" not in other
    assert (tmp_path / "run" / "summary.json").is_file()  # the run went to its end
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 40


def test_negative_control_without_the_guard_a_closed_stdout_breaks_the_run(tmp_path):
    returncode, other = _run_with_closed_reader(tmp_path, "stdout", "_main")
    assert returncode != 0
    assert "BrokenPipeError" in other


@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_batch_larger_than_the_training_set_is_refused_not_relabelled(tmp_path, capsys, command):
    """It would run on the whole set under the requested size's label; say so instead."""
    sizes = ["--batch-size", "5000"] if command == "train" else ["--configs", "5000x1"]
    argv = [command, "--task", "digits", *sizes, "--steps", "1", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    line = _one_line_error(capsys, command)
    said = "--batch-size=5000" if command == "train" else "config '5000x1': its batch of 5000"
    assert f"{said} is larger than digits's training set" in line
    assert list(tmp_path.iterdir()) == []
    # Negative control: the whole set exactly is fine.
    items = int(re.search(r"\((\d+) items\)", line).group(1))
    ok = ["train", "--task", "digits", "--batch-size", str(items), "--steps", "1"]
    assert main([*ok, "--out", str(tmp_path / "ok")]) == 0


# (argv, what the one line must say): an unknown option is named by its command's parser
UNKNOWN_OPTION_CASES = {
    "misspelt train option": (
        ["train", "--task", "digits", "--micro-batchsize", "4"],
        "gradaccum train: error: unrecognized arguments: --micro-batchsize 4; did you mean "
        "--micro-batch-size? (see 'gradaccum train --help')",
    ),
    "misspelt demo option with a value": (
        ["demo", "--stpes=3"],
        "gradaccum demo: error: unrecognized arguments: --stpes=3; did you mean --steps? "
        "(see 'gradaccum demo --help')",
    ),
    "misspelt check option": (
        ["check", "--task", "digits", "--dtypes", "float32"],
        "gradaccum check: error: unrecognized arguments: --dtypes float32; did you mean --dtype? "
        "(see 'gradaccum check --help')",
    ),
    "unknown compare option": (
        ["compare", "--task", "digits", "--configs", "8x1", "--bogus"],
        "gradaccum compare: error: unrecognized arguments: --bogus "
        "(see 'gradaccum compare --help')",
    ),
    "stray plan argument": (
        ["plan", "--task", "digits", "--memory-budget", "1GiB", "extra"],
        "gradaccum plan: error: unrecognized arguments: extra (see 'gradaccum plan --help')",
    ),
    "unknown top-level option": (
        ["--bogus"],
        "gradaccum: error: unrecognized arguments: --bogus (see 'gradaccum --help')",
    ),
}


@pytest.mark.parametrize("case", list(UNKNOWN_OPTION_CASES))
def test_an_unknown_option_names_its_command_help_and_the_closest_option(
    tmp_path, capsys, monkeypatch, case
):
    """`gradaccum train --micro-batchsize 4` once said `gradaccum: error: unrecognized arguments:
    --micro-batchsize 4 (see 'gradaccum --help')`: the top-level help, which lists no option of
    train, and no hint of the option meant."""
    argv, expected = UNKNOWN_OPTION_CASES[case]
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [expected]
    assert list(tmp_path.iterdir()) == []


# Every command that takes --seed, with what it needs besides (tiny settings).
SEED_COMMANDS = {
    "train": ["train", "--task", "charlm", "--steps", "1"],
    "compare": ["compare", "--task", "digits", "--configs", "8x1", "--steps", "1"],
    "check": ["check", "--task", "digits", "--batch-size", "8"],
    "plan": ["plan", "--task", "digits", "--batch-size", "8", "--memory-budget", "1GiB"],
    "demo": ["demo", "--steps", "1", "--epochs", "1"],
}


@pytest.mark.parametrize("command", list(SEED_COMMANDS))
@pytest.mark.parametrize("value", [str(2**62), str(2**64), "-1"])
def test_a_seed_out_of_range_is_one_line_and_writes_nothing(tmp_path, capsys, command, value):
    """`--seed 4611686018427387904` overflowed torch's generator: `train` crashed after its first
    lines with a traceback (the epoch order, `seed * 1_000_003 + epoch`), `check` at once, and
    `train --seed 2**64` said only `Overflow when unpacking long long`."""
    argv = [*SEED_COMMANDS[command], "--seed", value]
    argv += ["--out", str(tmp_path / "out")] if command in ("train", "compare", "demo") else []
    assert main(argv) == 2
    line = _one_line_error(capsys, command)
    assert f"argument --seed: '{value}' is not a seed: give an integer from 0 to 4294967295" in line
    assert list(tmp_path.iterdir()) == []


def test_the_largest_seed_trains_to_the_end(tmp_path, capsys):
    """Negative control: 2**32 - 1 is accepted and its epoch order does not overflow."""
    argv = [*SEED_COMMANDS["train"], "--seed", str(2**32 - 1), "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    assert (tmp_path / "o" / "summary.json").is_file()


@pytest.mark.parametrize("command", ["train", "compare", "plan", "demo"])
def test_threads_beyond_four_per_cpu_are_refused_before_any_work(tmp_path, capsys, command):
    """`--threads 100000` crashed the process (exit 139, OpenBLAS could not start its threads),
    `--threads 30000` aborted in libgomp (exit 1); 64 on 2 CPUs trained 100x slower."""
    cap = 4 * (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    argv = [*SEED_COMMANDS[command], "--threads", str(cap + 1)]
    argv += ["--out", str(tmp_path / "out")] if command != "plan" else []
    assert main(argv) == 2
    line = _one_line_error(capsys, command)
    assert f"argument --threads: '{cap + 1}' is more than 4 threads per CPU" in line
    assert f"give at most {cap}" in line
    assert list(tmp_path.iterdir()) == []
    # Negative control: the cap itself is accepted.
    assert thread_count(str(cap)) == cap


def test_the_threads_message_is_the_documented_one(tmp_path, capsys, monkeypatch):
    """docs/reliability.md's row, on the 2 CPUs it names (the cap follows the machine)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    argv = [*SEED_COMMANDS["train"], "--threads", "100000", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert _one_line_error(capsys, "train") == (
        "gradaccum train: error: argument --threads: '100000' is more than 4 threads per CPU: "
        "this process may use 2 CPU(s); give at most 8, best 2 (threads beyond the CPUs only slow "
        "torch down) (see 'gradaccum train --help')"
    )
    assert list(tmp_path.iterdir()) == []


EMPTY_PATH_CASES = {
    "train --out": ["train", "--task", "digits", "--steps", "1", "--out", ""],
    "train --resume": ["train", "--resume", ""],
    "train --init-from": ["train", "--task", "digits", "--steps", "1", "--init-from", ""],
    "compare --out": [
        "compare",
        "--task",
        "digits",
        "--configs",
        "8x1",
        "--steps",
        "1",
        "--out",
        "",
    ],
    "compare --resume": ["compare", "--resume", " "],
    "demo --out": ["demo", "--steps", "1", "--epochs", "1", "--out", ""],
}


@pytest.mark.parametrize("case", list(EMPTY_PATH_CASES))
def test_an_empty_path_is_refused_not_taken_for_the_current_folder(
    tmp_path, capsys, monkeypatch, case
):
    """`gradaccum train ... --out "$OUT"` with OUT unset wrote the run's five files into the
    current folder: Path("") is ".". `--resume ""` resumed whatever run the current folder held."""
    monkeypatch.chdir(tmp_path)
    argv = EMPTY_PATH_CASES[case]
    assert main(argv) == 2
    line = _one_line_error(capsys, argv[0])
    option = case.split()[1]
    assert f"argument {option}: '{argv[-1]}' is empty; give a path (an unset variable?)" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", list(SEED_COMMANDS))
def test_a_launch_of_several_processes_is_refused_writing_nothing(
    tmp_path, capsys, monkeypatch, command
):
    """`torchrun --nproc_per_node 2 -m gradaccum train ...` ran the whole single-process run on
    each rank (the same model trained twice, no gradient shared), both writing into one --out
    folder, and exited 0: it read like a distributed run. Refused on every rank, exit 2."""
    argv = [*SEED_COMMANDS[command]]
    argv += ["--out", str(tmp_path / "out")] if command in ("train", "compare", "demo") else []
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(argv) == 2
    line = _one_line_error(capsys, command)
    assert "launched as 2 processes (WORLD_SIZE=2" in line
    assert "has no distributed mode" in line
    assert "examples/ddp_train.py" in line
    assert list(tmp_path.iterdir()) == []
    # Negative control: one process (torchrun --nproc_per_node 1 sets WORLD_SIZE=1) runs.
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main([*SEED_COMMANDS["check"]]) in (0, 1)
