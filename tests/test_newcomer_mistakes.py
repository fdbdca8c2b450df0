"""Arguments given in the wrong place: each error names the right call, on one line.

`acc.step(loss_fn, batch)` and a DataLoader given as the batch said only that the batch held no
tensor; `Accumulator(optimizer, model)` printed the optimizer's repr over 14 lines.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradaccum import Accumulator


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, (torch.randn(16, 4), torch.randint(0, 3, (16,)))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_step_with_loss_fn_and_batch_swapped_names_the_order() -> None:
    model, optimizer, batch = _setup()
    before = _weights(model)
    acc = Accumulator(model, optimizer, micro_batch_size=4)
    with pytest.raises(ValueError, match=r"the batch comes first, acc\.step\(batch, loss_fn\)"):
        acc.step(_loss, batch)  # type: ignore[arg-type]
    streaming = Accumulator(model, optimizer, accumulation_steps=2)
    with pytest.raises(ValueError, match=r"acc\.micro_step\(micro_batch, loss_fn\)"):
        streaming.micro_step(_loss, batch)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    assert not optimizer.state


@pytest.mark.parametrize("kind", ["DataLoader", "generator"])
def test_a_dataloader_or_generator_as_the_batch_says_to_iterate_it(kind: str) -> None:
    model, optimizer, batch = _setup()
    loader = DataLoader(TensorDataset(*batch), batch_size=4)
    data = loader if kind == "DataLoader" else (b for b in loader)
    acc = Accumulator(model, optimizer, micro_batch_size=4)
    with pytest.raises(ValueError, match=rf"A {kind} is the whole data, not one batch: iterate"):
        acc.step(data, _loss)
    assert not optimizer.state


def test_optimizer_and_model_swapped_is_one_line_naming_the_order() -> None:
    model, optimizer, _ = _setup()
    with pytest.raises(TypeError) as caught:
        Accumulator(optimizer, model, micro_batch_size=4)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("model=<AdamW> must be a torch.nn.Module instance")
    assert message.endswith("The model comes first: Accumulator(model, optimizer, ...).")
    with pytest.raises(TypeError, match=r"e\.g\. torch\.optim\.AdamW\(model\.parameters\(\)"):
        Accumulator(model, model.parameters(), micro_batch_size=4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "fix"),
    [(np.int64(8), "8"), (8.0, "8"), (torch.tensor(8), "8"), (2.5, "8"), (True, "8")],
)
@pytest.mark.parametrize("name", ["micro_batch_size", "accumulation_steps"])
def test_a_non_int_size_names_the_int_to_pass(value: object, fix: str, name: str) -> None:
    model, optimizer, _ = _setup()
    with pytest.raises(ValueError, match=rf"must be a positive int .*: pass {name}={fix}\.$"):
        Accumulator(model, optimizer, **{name: value})
