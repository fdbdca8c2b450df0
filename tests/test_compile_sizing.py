"""Memory planning leaves a `torch.compile`d model compiled.

`plan_micro_batch` (and `micro_batch_size="auto"`, which plans on the first batch) measures a
forward and backward under a Python `TorchDispatchMode`. Dynamo refuses to compile a frame while
such a mode is active, and remembers the refusal: the model's forward was marked to be skipped
for good, so the whole training then ran eagerly, silently (0 frames compiled).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from gradaccum import Accumulator, plan_micro_batch
from gradaccum.memory import track_tensor_bytes


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(16, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.a(x)))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [
        (torch.randn(24, 16, generator=generator, dtype=torch.float64), torch.arange(24) % 3)
        for _ in range(6)
    ]


def test_a_model_measured_by_the_tracker_still_compiles() -> None:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(_Net(), backend=counter)
    x = torch.randn(8, 16)
    with track_tensor_bytes() as tracker:
        compiled(x).sum().backward()
    assert tracker.peak > 0  # measured, eagerly
    compiled(x).sum().backward()
    assert counter.frame_count == 1  # before: 0, the forward skipped for good


def test_plan_then_train_compiled() -> None:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    model = _Net().double()
    compiled = torch.compile(model, backend=counter)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = plan_micro_batch(compiled, _batches()[0], _loss, optimizer, memory_budget="16MiB")
    assert plan.micro_batch_size >= 1
    _loss(compiled, _batches()[0]).backward()
    assert counter.frame_count == 1


def test_auto_sizing_trains_the_compiled_model_exactly() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net().double()
    reference = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    acc = Accumulator(
        torch.compile(model, backend=counter),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        micro_batch_size="auto",
        memory_budget="16MiB",
    )
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for batch in _batches():
        acc.step(batch, _loss)
        reference_optimizer.zero_grad()
        _loss(reference, batch).backward()
        reference_optimizer.step()
    assert counter.frame_count >= 1  # before: 0, every window eager
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
