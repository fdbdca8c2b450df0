"""A fixed-length schedule at the end of a streamed run (`gradaccum._schedule_length`).

`OneCycleLR(total_steps=...)` counted another way than the Accumulator steps (per micro-batch,
or with the floor when each epoch's `flush()` steps its shorter last window) runs out before the
data. The Accumulator raises torch's "Tried to step N times" before any change; its note names
the `total_steps` formula for the Accumulator's settings. Evaluated as written, that formula
runs the whole run to the schedule's last step, exactly as the plain full-batch loop (float64,
rtol 1e-10).
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradaccum import Accumulator
from tests.state import assert_bitwise

_GEN = torch.Generator().manual_seed(5)
_X = torch.randn(50, 4, generator=_GEN, dtype=torch.float64)
_Y = torch.randn(50, 1, generator=_GEN, dtype=torch.float64)
LOADER = [(_X[i : i + 4], _Y[i : i + 4]) for i in range(0, 50, 4)]  # 13, the last of 2 rows
EPOCHS, K = 3, 3


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _build(total: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total)


def _run(acc: Accumulator, mode: str) -> None:
    for _ in range(EPOCHS):
        for micro_batch in LOADER:
            acc.micro_step(micro_batch, _loss)
        acc.flush()
    if mode == "carry":
        acc.flush("step")


def _windows(mode: str) -> list[list[int]]:
    """The micro-batches (indices into LOADER) of each optimizer step of the run."""
    flat = [[i for i in range(len(LOADER))] for _ in range(EPOCHS)]
    if mode == "carry":
        run = [i for epoch in flat for i in epoch]
        return [run[j : j + K] for j in range(0, len(run), K)]
    windows = [epoch[j : j + K] for epoch in flat for j in range(0, len(epoch), K)]
    return [w for w in windows if mode == "step" or len(w) == K]


def _plain(total: int, mode: str) -> tuple[nn.Module, Any]:
    model, optimizer, scheduler = _build(total)
    for window in _windows(mode):
        optimizer.zero_grad(set_to_none=True)
        x = torch.cat([LOADER[i][0] for i in window])
        y = torch.cat([LOADER[i][1] for i in window])
        _loss(model, (x, y)).backward()
        optimizer.step()
        scheduler.step()
    return model, scheduler


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Any:
    return copy.deepcopy((model.state_dict(), optimizer.state_dict(), scheduler.state_dict()))


@pytest.mark.parametrize("mode", ["step", "drop", "carry"])
def test_a_schedule_that_runs_out_names_the_total_steps_formula_and_it_runs_exactly(
    mode: str,
) -> None:
    short = EPOCHS * (len(LOADER) // K) - 1  # one short of even the floor
    model, optimizer, scheduler = _build(short)
    acc = Accumulator(
        model, optimizer, accumulation_steps=K, scheduler=scheduler, partial_window=mode
    )
    raised: ValueError | None = None
    calls = [(acc.micro_step, (b, _loss)) for b in LOADER] + [(acc.flush, ())]
    for call, args in calls * EPOCHS:
        before = _state(model, optimizer, scheduler)
        try:
            call(*args)
        except ValueError as error:
            raised = error
            break
    assert raised is not None
    assert f"Tried to step {short + 1} times" in str(raised)
    assert_bitwise(_state(model, optimizer, scheduler), before)  # caught before any change
    notes = " ".join(raised.__notes__)
    assert f"partial_window='{mode}'" in notes
    found = re.search(r"total_steps=(.+?) optimizer steps", notes)
    assert found is not None, notes  # fails without the fix: no formula named
    total = eval(found.group(1), {"math": math, "epochs": EPOCHS, "loader": LOADER})
    assert total == len(_windows(mode))
    model, optimizer, scheduler = _build(total)
    acc = Accumulator(
        model, optimizer, accumulation_steps=K, scheduler=scheduler, partial_window=mode
    )
    _run(acc, mode)  # the named formula runs to the schedule's end, not past it
    assert scheduler.last_epoch == total
    want, plain_schedule = _plain(total, mode)
    assert plain_schedule.last_epoch == total
    for got, ref in zip(model.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    # control: the floor under "step" and "carry" is too short; under "drop" it is the formula
    floor = EPOCHS * (len(LOADER) // K)
    assert (floor == total) == (mode == "drop")


def test_step_names_one_step_per_call() -> None:
    model, optimizer, scheduler = _build(2)
    acc = Accumulator(model, optimizer, micro_batch_size=4, scheduler=scheduler)
    for seed in range(2):
        assert acc.step(LOADER[seed], _loss).stepped
    with pytest.raises(ValueError, match="Tried to step 3 times") as raised:
        acc.step(LOADER[2], _loss)
    notes = " ".join(raised.value.__notes__)
    assert "total_steps=epochs * len(loader) optimizer steps" in notes
    assert "micro_step()" not in notes


def test_a_schedule_of_no_fixed_length_gets_no_formula() -> None:
    """A failing LambdaLR is no schedule running out: its note names no total_steps."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 - step))
    acc = Accumulator(model, optimizer, accumulation_steps=2, scheduler=scheduler)
    acc.micro_step(LOADER[0], _loss)
    with pytest.raises(ZeroDivisionError) as raised:
        acc.micro_step(LOADER[1], _loss)
    assert "total_steps=" not in " ".join(raised.value.__notes__)
