"""gradaccum with objects from Hugging Face accelerate's `Accelerator.prepare`.

`prepare` returns the optimizer wrapped in an `AcceleratedOptimizer`, a subclass of
`torch.optim.Optimizer` that never runs its `__init__`: the Accumulator could not watch its steps
and failed deep inside with an AttributeError. It is now refused at construction, naming the fix
(pass `optimizer.optimizer`), and with that fix the steps are the full-batch ones.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")

from gradaccum import Accumulator  # noqa: E402
from tests.reference import param_tensors, relative_gap  # noqa: E402
from tests.state import assert_bitwise, clone_state  # noqa: E402

ROWS, MICRO = 10, 3


def _setup() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(ROWS, 4, dtype=torch.float64)
    return model.double(), x, torch.randint(0, 3, (ROWS,))


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _prepared(model: torch.nn.Module) -> tuple[torch.nn.Module, object, object]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    accelerator = accelerate.Accelerator(cpu=True)
    prepared: tuple[torch.nn.Module, object, object] = accelerator.prepare(
        model, optimizer, scheduler
    )
    return prepared


def test_a_prepared_optimizer_is_refused_naming_the_fix_changing_nothing() -> None:
    model, _, _ = _setup()
    model, optimizer, scheduler = _prepared(model)
    before = clone_state(param_tensors(model))
    with pytest.raises(TypeError, match=r"optimizer\.optimizer"):
        Accumulator(model, optimizer, micro_batch_size=MICRO, scheduler=scheduler)  # type: ignore[arg-type]
    assert_bitwise(param_tensors(model), before)


@pytest.mark.parametrize("inner_scheduler", [True, False])
def test_the_wrapped_optimizer_gives_the_full_batch_steps(inner_scheduler: bool) -> None:
    model, x, y = _setup()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        _loss(reference, (x, y)).backward()
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
        optimizer.step()
        scheduler.step()

    model, prepared_optimizer, prepared_scheduler = _prepared(model)
    acc = Accumulator(
        model,
        prepared_optimizer.optimizer,  # type: ignore[attr-defined]
        micro_batch_size=MICRO,
        max_grad_norm=0.5,
        scheduler=prepared_scheduler.scheduler if inner_scheduler else prepared_scheduler,  # type: ignore[attr-defined]
    )
    for _ in range(3):
        assert acc.step((x, y), _loss).stepped
    assert relative_gap(param_tensors(model), param_tensors(reference)) < 1e-10
