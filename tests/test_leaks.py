"""No memory piles up over a long streaming run: 128 micro-batches per window, 50 windows.

After each window the test measures, with the collector run first:

- the live tensors (Python-visible, counted and their storage bytes summed once per storage) among
  the objects created during the run: `gc.freeze()` before the run hides every older object, so
  the baseline is the run's own model, optimizer state and current micro-batch;
- the process RSS (resident memory), which also sees what only C++ holds, such as a graph kept
  alive by the autograd engine.

After a warm-up of 5 windows (gradients and AdamW moments are allocated by the first ones) the
count must not change at all, and bytes and RSS must grow by less than 1%. The negative control
is the classic caller-side leak, keeping each micro-batch's loss tensor (and with it its graph):
the same measurements must catch it clearly.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import resource
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from gradaccum import Accumulator

N = 128  # micro-batches per window
WINDOWS = 50
WARMUP = 5
MICRO, FEATURES, CLASSES = 16, 256, 10
TOLERANCE = 0.01


@dataclass(frozen=True)
class Sample:
    """Memory after one window."""

    tensors: int
    tensor_bytes: int
    rss: int


def _rss() -> int:
    """Resident set size in bytes (Linux: current; elsewhere: the peak, which must stay flat)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _live_tensors() -> tuple[int, int]:
    """Count and storage bytes of the tensors among the objects the collector tracks."""
    storages: dict[int, int] = {}
    count = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): some module proxies warn when their __class__ is read.
        if issubclass(type(obj), torch.Tensor):
            count += 1
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return count, sum(storages.values())


@contextlib.contextmanager
def _only_new_objects() -> Iterator[None]:
    """Hide every object that exists now from `gc.get_objects()` (and from collections)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _train(*, keep_losses: bool) -> list[Sample]:
    """Stream WINDOWS windows of N micro-batches; memory after each window."""
    samples = []
    with _only_new_objects():
        generator = torch.Generator().manual_seed(0)
        model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
        acc = Accumulator(
            model, optimizer, accumulation_steps=N, scheduler=scheduler, max_grad_norm=1.0
        )
        kept: list[torch.Tensor] = []

        def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
            if keep_losses:
                kept.append(loss)  # the leak of the negative control: the graph stays alive
            return loss

        for _ in range(WINDOWS):
            for _ in range(N):
                x = torch.randn(MICRO, FEATURES, generator=generator)
                y = torch.randint(0, CLASSES, (MICRO,), generator=generator)
                result = acc.micro_step((x, y), loss_fn)
            assert result.stepped
            del x, y, result
            gc.collect()
            samples.append(Sample(*_live_tensors(), _rss()))
    return samples


def _growth(values: list[int]) -> float:
    """Largest relative growth after the warm-up, over the value at its end."""
    base = values[WARMUP - 1]
    return max(values[WARMUP:]) / base - 1


def test_memory_is_flat_over_50_windows_of_128_micro_batches() -> None:
    samples = _train(keep_losses=False)
    counts = [s.tensors for s in samples]
    assert len(set(counts[WARMUP - 1 :])) == 1, counts  # not one tensor more, ever
    assert _growth([s.tensor_bytes for s in samples]) < TOLERANCE
    assert _growth([s.rss for s in samples]) < TOLERANCE, [s.rss for s in samples]


def test_negative_control_keeping_each_loss_is_caught_by_every_measure() -> None:
    samples = _train(keep_losses=True)
    counts = [s.tensors for s in samples]
    # Each window keeps N more loss tensors (and their graphs, which hold the inputs).
    assert all(b - a >= N for a, b in itertools.pairwise(counts)), counts
    assert _growth([s.tensor_bytes for s in samples]) > 10 * TOLERANCE
    assert _growth([s.rss for s in samples]) > TOLERANCE, [s.rss for s in samples]
