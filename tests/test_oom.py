"""`gradaccum._oom` and the CUDA-only parts of planning, through stand-ins that report real numbers.

There is no GPU here: a stand-in for `torch.cuda` records the calls and reports allocator figures,
and the tests check what the library does with them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradaccum._oom import OptimizerStepMemoryError, is_out_of_memory, release_cached_memory
from gradaccum._probe import CudaAllocatorPeak, Probe
from gradaccum.options import Precision
from gradaccum.result import PartialStepError


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0)"), True),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 8 GB"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"), True),
        (MemoryError(), True),
        # cuDNN and cuBLAS report a failed allocation in their own words (convolutions, GEMMs).
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"), False),
        (ValueError("out of memory"), False),  # not an allocator's error type
        (KeyboardInterrupt(), False),
    ],
)
def test_is_out_of_memory(error: BaseException, expected: bool) -> None:
    assert is_out_of_memory(error) is expected


class _FakeCuda:
    """Stands in for `torch.cuda`: records calls, reports allocator figures."""

    def __init__(self, allocated: int, peak: int) -> None:
        self.allocated, self.peak_value, self.calls = allocated, peak, []

    def synchronize(self, device) -> None:
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self, device) -> None:
        self.calls.append("reset")

    def memory_allocated(self, device) -> int:
        return self.allocated

    def max_memory_allocated(self, device) -> int:
        return self.peak_value

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")


def test_release_cached_memory_empties_the_cuda_cache_only_on_cuda(monkeypatch) -> None:
    fake = _FakeCuda(0, 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", fake.empty_cache)
    release_cached_memory(torch.device("cpu"))
    assert fake.calls == []
    release_cached_memory(torch.device("cuda", 0))
    assert fake.calls == ["empty_cache"]


def test_allocator_peak_is_measured_above_the_level_at_start() -> None:
    fake = _FakeCuda(allocated=3_000_000, peak=7_500_000)
    peak = CudaAllocatorPeak(torch.device("cuda", 0), memory=fake)
    peak.start()
    assert fake.calls[:2] == ["synchronize", "reset"]
    assert peak.peak() == 4_500_000


def _probe() -> Probe:
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 2))
    batch = torch.randn(32, 16)
    return Probe(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).sum(), batch,
        Precision.FP32, None,
    )  # fmt: skip


def test_probe_takes_the_larger_of_tensor_tracking_and_the_allocator() -> None:
    tracked = _probe().activation_peak(8)  # what tensors alone show, on CPU
    workspace = _probe()
    # The allocator saw 1 MiB more than the tensors (a cuBLAS workspace, say).
    fake = _FakeCuda(allocated=10_000, peak=10_000 + tracked + 2**20)
    workspace.allocator = CudaAllocatorPeak(torch.device("cuda", 0), memory=fake)
    assert workspace.activation_peak(8) == tracked + 2**20
    # ... and when the allocator reports less (it rounds), tensor tracking wins.
    small = _probe()
    small.allocator = CudaAllocatorPeak(torch.device("cuda", 0), memory=_FakeCuda(0, 1))
    assert small.activation_peak(8) == tracked


class _StepRunsOutOfMemory(torch.optim.SGD):
    """SGD whose armed step updates everything, then runs out of memory (as a late temporary)."""

    armed = False

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        out = super().step(closure)
        if self.armed:
            self.armed = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return out


def _step_oom_run(mode: str | int) -> tuple[nn.Module, _StepRunsOutOfMemory, object]:
    from torch.nn import functional as F

    from gradaccum import Accumulator

    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    optimizer = _StepRunsOutOfMemory(model.parameters(), lr=0.1, momentum=0.9)
    budget = None if isinstance(mode, int) else "1GiB"
    acc = Accumulator(model, optimizer, micro_batch_size=mode, memory_budget=budget)

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    acc.step((x, y), loss)
    optimizer.armed = True
    # It updated the parameters before running out of memory: PartialStepError names them,
    # and its cause is the out-of-memory error that says why no smaller rerun is made.
    with pytest.raises(PartialStepError) as caught:
        acc.step((x, y), loss)
    assert isinstance(caught.value.__cause__, OptimizerStepMemoryError)
    return model, optimizer, caught.value


@pytest.mark.parametrize("mode", ["largest", "auto", 8])
def test_out_of_memory_in_optimizer_step_is_not_rerun(mode: str | int) -> None:
    """A step that failed may have changed the parameters: a rerun would step twice. It raises."""
    model, _optimizer, error = _step_oom_run(mode)
    assert not is_out_of_memory(error)  # not an error to rerun the window for
    message = str(error)
    assert "optimizer.step() ran out of memory" in message
    assert "not rerun" in message
    # The reference: two plain steps (the failed one did update), not three.
    torch.manual_seed(0)
    reference = nn.Linear(4, 2).double()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    for _ in range(2):
        plain.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        plain.step()
    torch.testing.assert_close(model.weight, reference.weight, rtol=1e-12, atol=0)
    # NEGATIVE CONTROL: a third step (what a rerun would add) is far from it.
    plain.zero_grad()
    nn.functional.cross_entropy(reference(x), y).backward()
    plain.step()
    assert (model.weight - reference.weight).abs().max() > 1e-4
