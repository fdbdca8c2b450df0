"""Commands run in-process leave the caller's process as they found it.

`gradaccum.cli.main([...])` sets torch's thread count for a command (`--threads`) and silences the
library's BatchNorm warning while training (the CLI prints its own note instead). Both are undone
when the command returns, whether it succeeds, reports bad input or raises. Each test first shows
that the command really did change the setting while it ran (a negative control: otherwise the
"unchanged afterwards" check would prove nothing).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import gradaccum
import gradaccum.cli.compare
import gradaccum.cli.plan
import gradaccum.cli.train
from gradaccum.batchnorm import BatchNormAccumulationWarning
from gradaccum.cli import UsageError, main
from gradaccum.cli._args import torch_threads
from gradaccum.cli._options import batchnorm_notes, batchnorm_warnings_as_notes

CALLER_THREADS = 2  # differs from the --threads 1 the commands are given


@pytest.fixture
def caller_threads() -> Iterator[int]:
    """Give the test process `CALLER_THREADS` threads; put back the suite's count afterwards."""
    suite = torch.get_num_threads()
    torch.set_num_threads(CALLER_THREADS)
    try:
        yield CALLER_THREADS
    finally:
        torch.set_num_threads(suite)


def _recording(seen: list[int], outcome: BaseException | None = None, result: Any = None) -> Any:
    """A stand-in that records the thread count it runs with, then raises `outcome` or returns."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        if outcome is not None:
            raise outcome
        return result

    return stand_in


def test_plan_restores_the_thread_count(caller_threads: int, monkeypatch, capsys) -> None:
    seen: list[int] = []
    original = gradaccum.cli.plan.build_target

    def build_target(args: Any) -> Any:
        seen.append(torch.get_num_threads())
        return original(args)

    monkeypatch.setattr(gradaccum.cli.plan, "build_target", build_target)
    code = main(["plan", "--task", "digits", "--memory-budget", "64KiB", "--threads", "1"])
    assert code == 1, capsys.readouterr().err  # nothing fits: a normal return
    assert seen == [1]  # the command ran with its own count
    assert torch.get_num_threads() == caller_threads


def test_plan_restores_the_thread_count_when_it_fails(
    caller_threads: int, monkeypatch, capsys
) -> None:
    seen: list[int] = []
    monkeypatch.setattr(gradaccum, "plan_micro_batch", _recording(seen, RuntimeError("boom")))
    code = main(["plan", "--task", "digits", "--memory-budget", "1GiB", "--threads", "1"])
    assert code == 2
    assert "the plan could not be made: RuntimeError: boom" in capsys.readouterr().err
    assert seen == [1]
    assert torch.get_num_threads() == caller_threads


def _ignores_batchnorm_warning() -> bool:
    return any(
        action == "ignore" and category is BatchNormAccumulationWarning
        for action, _, category, _, _ in warnings.filters
    )


def test_train_restores_threads_and_warning_filters(
    caller_threads: int, monkeypatch, tmp_path: Path, capsys
) -> None:
    seen: list[int] = []
    silenced: list[bool] = []

    def open_checked(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        silenced.append(_ignores_batchnorm_warning())
        raise UsageError("stand-in stops here")

    monkeypatch.setattr(gradaccum.cli.train, "open_checked", open_checked)
    before = list(warnings.filters)
    argv = ["train", "--task", "digits", "--batch-size", "16", "--micro-batch-size", "8"]
    code = main([*argv, "--steps", "1", "--out", str(tmp_path / "run"), "--threads", "1"])
    assert code == 2
    assert "stand-in stops here" in capsys.readouterr().err
    assert seen == [1]
    assert silenced == [True]  # training would run with the library's warning silenced...
    assert torch.get_num_threads() == caller_threads
    assert warnings.filters == before  # ...and only while the command runs
    assert not _ignores_batchnorm_warning()


def test_compare_restores_the_thread_count_when_interrupted(
    caller_threads: int, monkeypatch, tmp_path: Path, capsys
) -> None:
    seen: list[int] = []
    monkeypatch.setattr(
        gradaccum.cli.compare, "train_session", _recording(seen, KeyboardInterrupt())
    )
    argv = ["compare", "--task", "digits", "--configs", "8x1", "4x2", "--steps", "1"]
    code = main([*argv, "--out", str(tmp_path / "cmp"), "--threads", "1"])
    assert code == 130, capsys.readouterr().err
    assert seen == [1]
    assert torch.get_num_threads() == caller_threads


def test_torch_threads_restores_on_exception(caller_threads: int) -> None:
    inside: list[int] = []

    def fail() -> None:
        with torch_threads(1):
            inside.append(torch.get_num_threads())
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        fail()
    assert inside == [1]
    assert torch.get_num_threads() == caller_threads
    with torch_threads():  # no count: only the restore
        torch.set_num_threads(1)
    assert torch.get_num_threads() == caller_threads


def _batchnorm_warnings() -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with batchnorm_warnings_as_notes():
            warnings.warn(BatchNormAccumulationWarning("inside"), stacklevel=1)
            warnings.warn(UserWarning("another warning"), stacklevel=1)
        warnings.warn(BatchNormAccumulationWarning("after"), stacklevel=1)
    return caught


def test_batchnorm_warning_is_silenced_inside_the_block_only() -> None:
    before = list(warnings.filters)
    caught = _batchnorm_warnings()
    # Inside: only the BatchNorm warning is dropped. After: it shows again (negative control).
    assert [str(w.message) for w in caught] == ["another warning", "after"]
    assert warnings.filters == before


def test_showing_notes_adds_no_process_wide_filter(capsys) -> None:
    before = list(warnings.filters)
    batchnorm_notes([])
    assert warnings.filters == before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(BatchNormAccumulationWarning("still shown"), stacklevel=1)
    assert [str(w.message) for w in caught] == ["still shown"]
