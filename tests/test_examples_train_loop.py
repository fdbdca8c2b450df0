"""examples/train_loop.py: it runs, learns, and each of its steps is the plain full-batch step.

The example is imported (it has no side effects at import) and its `main(argv)` returns the
trained model, which is compared with a plain PyTorch loop written here on the same batches: one
forward over the whole batch, the mean loss, clipping, AdamW, the warm-up schedule. Its default
split (batch 32 in micro-batches of 12) has a ragged last micro-batch of 8, so the naive loop
(each micro-batch's mean divided by the number of micro-batches) is a live negative control.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_loop.py"
STEPS = 6


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_loop_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()

MicroLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _full_batch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _naive_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The copied loop: every micro-batch's mean over the number of micro-batches, then summed."""
    parts = list(zip(x.split(12), y.split(12), strict=True))
    return sum(nn.functional.cross_entropy(model(xm), ym) / len(parts) for xm, ym in parts)


def _plain_loop(steps: int, loss: MicroLoss = _full_batch_loss) -> nn.Module:
    """The example's defaults without gradaccum: one backward of `loss` per batch."""
    torch.manual_seed(0)
    model = example.Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    data = example.batches(example.make_dataset(), 32, seed=0, skip=0)
    for _ in range(steps):
        x, y = next(data)
        loss(model, x, y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model


def _gap(a: nn.Module, b: nn.Module) -> float:
    """Largest relative parameter difference, over all tensors."""
    with torch.no_grad():
        return max(
            float((p - q).abs().max() / q.abs().max())
            for p, q in zip(a.parameters(), b.parameters(), strict=True)
        )


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_runs_as_a_script_and_learns() -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    losses = [float(v) for v in re.findall(r"^step +\d+  loss (\S+)", run.stdout, re.MULTILINE)]
    assert len(losses) == 20, run.stdout
    assert losses[-1] < 0.8 * losses[0], run.stdout
    assert "micro-batches 3" in run.stdout  # 12 + 12 + 8: the ragged split is exercised


def test_matches_the_plain_full_batch_loop() -> None:
    model = example.main(["--steps", str(STEPS), "--quiet"])
    _assert_same(model, _plain_loop(STEPS))


def test_negative_control_naive_loop_differs() -> None:
    # A ragged last micro-batch (8 of 32) weighs 1/3 instead of 1/4 in the naive loop.
    exact, naive = _plain_loop(STEPS), _plain_loop(STEPS, _naive_loss)
    assert _gap(naive, exact) > 1e-3


def test_resume_continues_as_if_uninterrupted(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "ckpt.pt")
    example.main(["--steps", "3", "--quiet", "--save", checkpoint])
    resumed = example.main(["--steps", str(STEPS), "--quiet", "--resume", checkpoint])
    straight = example.main(["--steps", str(STEPS), "--quiet"])
    for p, q in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(p, q)


def test_bf16_runs_and_stays_close() -> None:
    model = example.main(["--steps", "3", "--quiet", "--precision", "bf16"])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert _gap(model, _plain_loop(3)) < 5e-2  # bf16 autocast: close, not exact


@pytest.fixture
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiled_model_is_exact_and_compiles_once() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    from gradaccum import Accumulator

    counter = CompileCounterWithBackend("aot_eager")
    torch.manual_seed(0)
    model = example.Classifier()
    model.compile(backend=counter, dynamic=True)
    reference = example.Classifier()
    reference.load_state_dict(model.state_dict())
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=12)
    plain = torch.optim.SGD(reference.parameters(), lr=0.5)
    data = example.batches(example.make_dataset(), 32, seed=0, skip=0)
    for _ in range(3):
        x, y = next(data)
        acc.step((x, y), example.loss_fn)  # micro-batches of 12, 12, 8
        _full_batch_loss(reference, x, y).backward()
        plain.step()
        plain.zero_grad()
    _assert_same(model, reference)
    assert counter.frame_count == 1  # dynamic=True: the ragged 8 reuses the graph built for 12


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compile_flag_matches_the_plain_loop() -> None:
    model = example.main(["--steps", "3", "--quiet", "--compile", "aot_eager"])
    _assert_same(model, _plain_loop(3))
