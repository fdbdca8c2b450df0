"""An Accumulator that goes away with an open window warns: its micro-batches were never stepped.

A streaming loop that leaves out `acc.flush()` after its last epoch, or `break`s out mid-window
and ends, loses the window's micro-batches: they sit in `.grad` and no step uses them. Before,
nothing said so, neither when the Accumulator was garbage-collected nor when the program ended.
Now `gradaccum._open_window.OpenWindowWarning` does, unless the window was settled (`flush()`),
closed at a boundary, or saved for a resume after its last micro-batch.
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum import Accumulator
from gradaccum._open_window import OpenWindowWarning

SRC = Path(__file__).resolve().parents[1] / "src"


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model = model.double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _stream(micro_batches: int = 5, rows: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(micro_batches * rows, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(micro_batches * rows, 2, generator=generator, dtype=torch.float64)
    return [(x[i : i + rows], y[i : i + rows]) for i in range(0, len(x), rows)]


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _drop_and_collect(run: Any) -> list[warnings.WarningMessage]:
    """Warnings raised while `run()` builds an Accumulator, drives it and lets it go."""
    # An earlier test's Accumulator left in a reference cycle with an open window would warn
    # when the cycle collector runs, maybe inside `run()`: collect it first, outside the record.
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()  # its Accumulator is a local: freed when run() returns (no reference cycle)
    return [w for w in caught if issubclass(w.category, OpenWindowWarning)]


def _epoch(flush: str | None, save: bool = False, after_save: int = 0) -> None:
    model, optimizer = _setup()
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    stream = _stream()
    for micro_batch in stream[:4]:
        acc.micro_step(micro_batch, _mse)
    acc.micro_step(stream[4], _mse)  # the epoch's last micro-batch: a window of 1 left open
    if save:
        acc.state_dict()  # what save_checkpoint(..., accumulator=acc) takes
    for micro_batch in stream[:after_save]:
        acc.micro_step(micro_batch, _mse)
    if flush is not None:
        acc.flush(flush)


def test_an_accumulator_collected_with_an_open_window_warns_naming_flush() -> None:
    caught = _drop_and_collect(lambda: _epoch(flush=None))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "open window of 1 micro-batches (3 items counted)" in message
    assert "acc.flush()" in message
    assert "break" in message
    assert caught[0].filename == __file__  # the user's line that let it go, not gradaccum's


@pytest.mark.parametrize("flush", ["step", "drop"])
def test_no_warning_once_the_window_is_settled(flush: str) -> None:
    assert _drop_and_collect(lambda: _epoch(flush=flush)) == []


def test_a_carried_window_is_still_open_and_warns() -> None:
    assert len(_drop_and_collect(lambda: _epoch(flush="carry"))) == 1


def test_no_warning_when_the_window_was_saved_after_its_last_micro_batch() -> None:
    assert _drop_and_collect(lambda: _epoch(flush=None, save=True)) == []
    # Negative control: a micro-batch after the save is progress the file does not hold.
    assert len(_drop_and_collect(lambda: _epoch(flush=None, save=True, after_save=2))) == 1


def test_no_warning_for_a_loaded_window_nor_a_window_closed_at_a_boundary() -> None:
    model, optimizer = _setup()
    saved = Accumulator(model, optimizer, accumulation_steps=3)
    saved.micro_step(_stream()[0], _mse)
    state = saved.state_dict()

    def load() -> None:
        twin = copy.deepcopy(model)
        twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
        Accumulator(twin, twin_optimizer, accumulation_steps=3).load_state_dict(state)

    def boundary() -> None:
        acc = Accumulator(*_setup(), accumulation_steps=2)
        for micro_batch in _stream(4):
            acc.micro_step(micro_batch, _mse)

    assert _drop_and_collect(load) == []
    assert _drop_and_collect(boundary) == []
    saved.flush("drop")


def test_the_forgotten_window_is_really_lost() -> None:
    """Why it warns: without flush() the model misses the last partial batch's step."""
    stream = _stream()

    def train(flush: bool) -> torch.nn.Module:
        model, optimizer = _setup()
        acc = Accumulator(model, optimizer, accumulation_steps=2)
        for micro_batch in stream:
            acc.micro_step(micro_batch, _mse)
        if flush:
            acc.flush()
        else:
            acc.flush("drop")  # what a forgotten flush() amounts to, without the warning
        return model

    reference, optimizer = _setup()  # plain full-batch steps on windows of 2, 2 and 1
    for window in (stream[0:2], stream[2:4], stream[4:5]):
        x, y = (torch.cat(parts) for parts in zip(*window, strict=True))
        optimizer.zero_grad()
        _mse(reference, (x, y)).backward()
        optimizer.step()
    flushed, forgotten = train(flush=True), train(flush=False)
    for p, r in zip(flushed.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-13)
    gap = max(
        float((q - r).detach().abs().max())
        for q, r in zip(forgotten.parameters(), reference.parameters(), strict=True)
    )
    assert gap > 1e-3


_SCRIPT = """
import torch
from gradaccum import Accumulator
model = torch.nn.Linear(3, 1)
acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4)
for _ in range(6):
    acc.micro_step((torch.randn(2, 3), torch.randn(2, 1)),
                   lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
{end}
print("done")
"""


@pytest.mark.parametrize(
    ("end", "options", "warned"),
    [
        ("pass", [], True),  # the program ends with the window open
        ("acc.flush()", [], False),
        ("pass", ["-W", "error"], False),  # an error filter: nothing raised from the finalizer
    ],
    ids=["forgotten", "flushed", "warnings-as-errors"],
)
def test_the_program_ending_with_an_open_window_warns(
    end: str, options: list[str], warned: bool
) -> None:
    script = textwrap.dedent(_SCRIPT).format(end=end)
    done = subprocess.run(
        [sys.executable, *options, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert done.stdout.strip() == "done"
    assert ("OpenWindowWarning" in done.stderr) is warned, done.stderr
    assert "Exception ignored" not in done.stderr
    if warned:
        assert "open window of 2 micro-batches" in done.stderr
