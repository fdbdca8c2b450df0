"""docs/reliability.md's resume recipe under DDP, as labs write it: a `DistributedSampler`
(`drop_last=False`, `set_epoch`), dropout, per-rank checkpoints saved mid-window, 2 gloo ranks.

The sampler gives each epoch's order; the DataLoader's iterator still draws its workers' base
seed when an epoch starts, from the loader's `generator=`, or, without one, from torch's global
RNG. Resumed with `restore_rng=True`, that draw then comes after the restore, so every later
dropout mask shifts: 7e-3 off the uninterrupted run in a scratch run, silently, though the README
said each rank's random streams resume exactly. With `generator=` (as the recipe says) the
resume is bitwise.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gradaccum import Accumulator, LossSum, load_checkpoint, save_checkpoint
from tests.distributed._harness import run_ranks

EPOCHS, SEED, SAVE_AT = 2, 3, (1, 4)  # saved in epoch 1 after its 5th micro-batch: mid-window


@contextlib.contextmanager
def rng_untouched() -> Iterator[None]:  # the recipe's, verbatim
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng():
        yield
    random.setstate(python)
    np.random.set_state(numpy)


def loss_fn(model: nn.Module, batch: Any) -> LossSum:
    x, y = batch
    return LossSum(nn.functional.cross_entropy(model(x), y, reduction="sum"), count=len(y))


def _train(rank: int, path: str, resuming: bool, with_generator: bool) -> list[torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        x, y = torch.randn(45, 5, dtype=torch.float64), torch.randint(0, 3, (45,))
        net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 3))
    model = DistributedDataParallel(net.double())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10)
    acc = Accumulator(model, optimizer, accumulation_steps=3, scheduler=scheduler)
    dataset = TensorDataset(x, y)  # 23 items per rank: the sampler pads one
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED, drop_last=False)
    generator = torch.Generator() if with_generator else None
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, generator=generator)
    torch.manual_seed(100 + rank)  # dropout streams differ per rank
    start_epoch, skip = 0, 0
    if resuming:
        extra = load_checkpoint(
            path,
            model=model,
            optimizer=optimizer,
            accumulator=acc,
            scheduler=scheduler,
            restore_rng=True,
        )
        start_epoch, skip = extra["epoch"], extra["micro_batches_done"]
    for epoch in range(start_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        if generator is not None:
            generator.manual_seed(SEED + epoch)
        batches = iter(loader)
        with rng_untouched():
            for _ in range(skip):
                next(batches)
        for done, micro_batch in enumerate(batches, start=skip + 1):
            acc.micro_step(micro_batch, loss_fn)
            if not resuming and (epoch, done) == SAVE_AT:
                save_checkpoint(
                    path,
                    model=model,
                    optimizer=optimizer,
                    accumulator=acc,
                    scheduler=scheduler,
                    extra={"epoch": epoch, "micro_batches_done": done},
                )
        skip = 0
        acc.flush()
    return [p.detach().clone() for p in model.parameters()]


def worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out = {}
    for with_generator in (True, False):
        path = str(Path(folder) / f"ckpt-{with_generator}-rank{rank}.pt")  # one file per rank
        whole = _train(rank, path, resuming=False, with_generator=with_generator)
        resumed = _train(rank, path, resuming=True, with_generator=with_generator)
        out[with_generator] = max(
            float((a - b).abs().max()) for a, b in zip(whole, resumed, strict=True)
        )
    return out


@pytest.fixture(scope="module")
def gaps(tmp_path_factory: pytest.TempPathFactory) -> list[dict[bool, float]]:
    folder = tmp_path_factory.mktemp("resume_recipe")
    return run_ranks(worker, folder, str(folder), timeout=120)


@pytest.mark.timeout(180)
def test_the_resume_recipe_with_a_distributed_sampler_resumes_every_rank_bitwise(
    gaps: list[dict[bool, float]],
) -> None:
    for rank_gaps in gaps:
        assert rank_gaps[True] == 0.0


@pytest.mark.timeout(180)
def test_negative_control_without_the_loaders_generator_the_resume_differs(
    gaps: list[dict[bool, float]],
) -> None:
    """The iterator's seed is drawn from the restored global RNG: dropout masks shift."""
    for rank_gaps in gaps:
        assert rank_gaps[False] > 1e-4
