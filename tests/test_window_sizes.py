"""`acc.accumulation_steps` and `acc.micro_batch_size` changed by a training loop (a ramp).

Before, any value was taken as it came: `acc.accumulation_steps = 0` (or `"4"`, or a value
below the open window's micro-batches) made `micro_step()` accumulate forever without stepping,
and `acc.micro_batch_size = 2.5` or `"auto"` failed with a bare AssertionError (an "auto"
Accumulator ignored a new int silently).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradaccum import Accumulator, Tokens

LR = 0.3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def _micro_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [
        (torch.randn(n, 4, generator=generator, dtype=torch.float64), torch.arange(n) % 2)
        for n in ([3, 2, 4] * count)[:count]
    ]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _reference(windows: list[int]) -> nn.Module:
    """Plain full-batch Adam steps over consecutive windows of the given micro-batches."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    batches = iter(_micro_batches(sum(windows)))
    for size in windows:
        parts = [next(batches) for _ in range(size)]
        optimizer.zero_grad()
        _loss(model, tuple(torch.cat(p) for p in zip(*parts, strict=True))).backward()
        optimizer.step()
    return model


def _gap(model: nn.Module, reference: nn.Module) -> float:
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    return max(float(((a - b).abs().max() / b.abs().max()).detach()) for a, b in pairs)


def test_a_ramp_of_accumulation_steps_equals_the_full_batch_steps() -> None:
    """2, then 3 between windows, then 4 lowered to 2 after 3 micro-batches of an open window:
    it closes at the next one (a window holds at least accumulation_steps micro-batches)."""
    model = _model()
    acc = Accumulator(model, torch.optim.Adam(model.parameters(), lr=LR), accumulation_steps=2)
    stepped, batches = [], iter(_micro_batches(13))
    for steps, calls in ((2, 4), (3, 3), (4, 3), (2, 3)):
        acc.accumulation_steps = steps
        stepped += [acc.micro_step(next(batches), _loss) for _ in range(calls)]
    assert [r.micro_batches for r in stepped if r.stepped] == [2, 2, 3, 4, 2]
    assert _gap(model, _reference([2, 2, 3, 4, 2])) < 1e-10
    # Negative control: had the lowered window stayed open (as before), nothing would match.
    assert _gap(model, _reference([2, 2, 3, 6])) > 1e-3


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("accumulation_steps", 0, "accumulation_steps=0 must be a positive int"),
        ("accumulation_steps", "4", "micro-batches per window"),
        ("micro_batch_size", 2.5, "micro_batch_size=2.5 must be a positive int"),
        ("micro_batch_size", "auto", "cannot change from 4 to 'auto'"),
    ],
)
def test_a_bad_assignment_is_refused_naming_the_fix_and_changes_nothing(name, value, says):
    model = _model()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=LR), micro_batch_size=4, accumulation_steps=3
    )
    acc.micro_step(_micro_batches(1)[0], _loss)
    before = (acc.accumulation_steps, acc.micro_batch_size)
    with pytest.raises(ValueError, match=says):
        setattr(acc, name, value)
    assert (acc.accumulation_steps, acc.micro_batch_size) == before
    assert acc.micro_step(_micro_batches(2)[1], _loss).micro_batches == 2  # the window goes on


def test_the_window_rule_cannot_change_inside_an_open_window() -> None:
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR), accumulation_steps=3)
    acc.micro_step(_micro_batches(1)[0], _loss)
    with pytest.raises(ValueError, match=r"inside an open window \(1 micro-batches.*flush"):
        acc.accumulation_steps = Tokens(10)
    assert acc.accumulation_steps == 3
    acc.flush()
    acc.accumulation_steps = Tokens(10)  # between windows: fine
    assert acc.accumulation_steps == Tokens(10)


def test_an_auto_accumulator_refuses_a_fixed_size_instead_of_ignoring_it() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    acc = Accumulator(model, optimizer, micro_batch_size="auto", memory_budget="1GiB")
    with pytest.raises(ValueError, match=r"cannot change from 'auto' to 3.*new Accumulator"):
        acc.micro_batch_size = 3
    acc.micro_batch_size = "auto"  # the same: nothing changes
    fixed = Accumulator(model, optimizer, micro_batch_size=4)
    fixed.micro_batch_size = 6  # one int for another: fine between windows
    assert fixed.step(_micro_batches(3)[2], _loss).micro_batch_size == 4  # 4 items, at most 6


def test_batch_dim_set_after_construction_is_refused_and_changes_nothing() -> None:
    """`acc.batch_dim = 1` rebound the attribute while the engine (and its layout check, auto
    sizing) kept splitting along 0: the split and the engine's item count disagreed. A change is
    refused naming the fix; the same value is accepted; the run goes on exactly."""
    model = _model()
    acc = Accumulator(model, torch.optim.Adam(model.parameters(), lr=LR), micro_batch_size=2)
    x, y = _micro_batches(1)[0]
    with pytest.raises(ValueError, match=r"batch_dim cannot change from 0 to 1.*batch_dim=1"):
        acc.batch_dim = 1
    assert acc.batch_dim == 0
    acc.batch_dim = 0
    assert acc.step((x, y), _loss).stepped
    reference = _reference([1])
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=0.0)
