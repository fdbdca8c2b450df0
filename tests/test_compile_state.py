"""An Accumulator state saved mid-window loads whether the model is inside `torch.compile` or not.

`save_checkpoint` unwraps the model's weights, so a file loads into the model compiled or not,
and the docs recommend compiling for speed while resuming from any checkpoint. The Accumulator's
own state names modules too (BatchNorm statistics, the buffers a forward updates): those names
used to carry `torch.compile`'s `_orig_mod.` prefix, so a mid-window state saved by a compiled
run was refused by an eager one ("is no running statistic of this model") and the other way round.
Dynamo's `eager` backend is enough to get the wrapper, and compiles nothing.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import nn

from gradaccum import Accumulator, load_checkpoint, save_checkpoint
from tests.state import assert_bitwise

pytestmark = pytest.mark.filterwarnings(
    "ignore::gradaccum.batchnorm.BatchNormAccumulationWarning",
    "ignore::gradaccum._buffer_watch.ForwardStateWarning",
)


class _Net(nn.Module):
    """BatchNorm, and a buffer the forward updates (watched, put back by a failed window)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.c = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(x.shape[0])
        return self.c(torch.tanh(self.bn(self.a(x))))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(4, 5, generator=generator, dtype=torch.float64) + i, torch.arange(4) % 3)
        for i in range(8)
    ]


def _build(net: _Net, compiled: bool, mode: str) -> tuple[nn.Module, Any, Accumulator]:
    torch._dynamo.reset()
    model = torch.compile(net, backend="eager") if compiled else net
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    return model, optimizer, Accumulator(model, optimizer, accumulation_steps=4, batchnorm=mode)


@pytest.mark.parametrize("mode", ["micro", "pooled"])
@pytest.mark.parametrize(
    "saved_compiled", [True, False], ids=["compiled-to-eager", "eager-to-compiled"]
)
def test_a_mid_window_state_resumes_across_the_compile_wrapper_bitwise(
    tmp_path: Any, mode: str, saved_compiled: bool
) -> None:
    torch.manual_seed(0)
    start, batches = _Net().double(), _batches()
    uninterrupted = copy.deepcopy(start)
    _, _, acc = _build(uninterrupted, False, mode)
    for batch in batches:
        acc.micro_step(batch, _loss)

    first = copy.deepcopy(start)
    model, optimizer, acc = _build(first, saved_compiled, mode)
    for batch in batches[:6]:  # one window, then half of the next
        acc.micro_step(batch, _loss)
    save_checkpoint(tmp_path / "run.pt", model=model, optimizer=optimizer, accumulator=acc)

    resumed = _Net().double()
    model, optimizer, acc = _build(resumed, not saved_compiled, mode)
    load_checkpoint(tmp_path / "run.pt", model=model, optimizer=optimizer, accumulator=acc)
    for batch in batches[6:]:
        acc.micro_step(batch, _loss)
    assert_bitwise(resumed.state_dict(), uninterrupted.state_dict())

    # The resumed window's start came along: a failed window puts the saved start back.
    before = copy.deepcopy(resumed.state_dict())
    acc.micro_step(batches[0], _loss)
    with pytest.raises(RuntimeError, match="boom"):
        acc.micro_step(batches[1], lambda m, b: (_ for _ in ()).throw(RuntimeError("boom")))
    assert_bitwise(resumed.state_dict(), before)

    # Negative control: without the Accumulator's state the resumed run ends elsewhere.
    control = _Net().double()
    model, optimizer, acc = _build(control, not saved_compiled, mode)
    load_checkpoint(tmp_path / "run.pt", model=model, optimizer=optimizer)
    for batch in batches[6:]:
        acc.micro_step(batch, _loss)
    acc.flush()
    assert not torch.equal(control.c.weight, uninterrupted.c.weight)


def test_a_state_saved_with_prefixed_names_still_loads() -> None:
    """States written before the fix name modules `_orig_mod.bn`: still accepted."""
    torch.manual_seed(0)
    net, batches = _Net().double(), _batches()
    _, _, acc = _build(net, False, "pooled")
    for batch in batches[:2]:
        acc.micro_step(batch, _loss)
    state = acc.state_dict()
    engine = state["engine"]
    engine["batchnorm"]["pending"] = {
        f"_orig_mod.{name}": calls for name, calls in engine["batchnorm"]["pending"].items()
    }
    engine["batchnorm"]["start"] = [
        [f"_orig_mod.{name}", key, tensor] for name, key, tensor in engine["batchnorm"]["start"]
    ]
    assert engine["batchnorm"]["start"]  # the case under test
    assert engine["buffers"]
    engine["buffers"] = [[f"_orig_mod.{name}", tensor] for name, tensor in engine["buffers"]]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    expected = copy.deepcopy(net)
    _, _, reference = _build(expected, False, "pooled")
    reference.load_state_dict(acc.state_dict())
    _, _, acc = _build(net, False, "pooled")
    acc.load_state_dict(torch.load(buffer, weights_only=True))
    for run in (acc, reference):
        for batch in batches[2:4]:
            run.micro_step(batch, _loss)
    assert_bitwise(net.state_dict(), expected.state_dict())
