"""docs/reliability.md's recipe for resuming a user's own loop (data order included) exactly.

The block is run as written, in a namespace holding what the page elides (the model, the data,
`time_to_save`); a "kill" after the save at a chosen micro-batch stops it, and a second run of
the block with fresh objects (and other global RNG states, as a new process has) resumes it.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from gradaccum import Accumulator, LossSum, load_checkpoint, save_checkpoint
from tests.state import assert_bitwise, clone_state
from tests.test_docs_examples import python_block

RECIPE = python_block("reliability.md", "generator.manual_seed(seed + epoch)")
SEEDING = "    generator.manual_seed(seed + epoch)"
SKIP = """    batches = iter(loader)
    with rng_untouched():  # what the checkpoint trained is skipped; its augmentations' draws too
        for _ in range(skip):
            next(batches)
"""
ISLICE = "    batches = itertools.islice(loader, skip, None)\n"  # the page's skip until round 12
LOADER = "generator=generator)"


class _Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Rows drawn a random flip and noise when loaded, from torch's, NumPy's and Python's RNGs."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[index].flip(0) if torch.rand(()) < 0.5 else self.x[index]
        scale = 0.01 * (1 + np.random.rand() + random.random())
        return x + scale * torch.randn_like(x), self.y[index]


class _KilledError(Exception):
    """The process 'dies' right after a checkpoint."""


def _loss(model: nn.Module, batch: list[torch.Tensor]) -> LossSum:
    x, y = batch
    return LossSum((model(x) - y).pow(2).sum(), y.numel())


def _run(
    folder: Path,
    code: str,
    *,
    kill_after: int | None = None,
    resuming: bool = False,
    augmented: bool = False,
) -> Any:
    """The block over 3 epochs of 53 rows (7 micro-batches of 8, 3 per window); final states."""
    torch.manual_seed(1234 if resuming else 0)  # a new process: other global RNG states
    np.random.seed(1234 if resuming else 0)
    random.seed(1234 if resuming else 0)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(53, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(53, 2, generator=generator, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 2)).double()
    if not resuming:
        torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    acc = Accumulator(model, optimizer, accumulation_steps=3, scheduler=scheduler)
    calls = [0]

    def time_to_save() -> bool:
        calls[0] += 1
        if kill_after is not None and calls[0] > kill_after:
            raise _KilledError  # the checkpoint written at kill_after is the last one
        return kill_after is not None and calls[0] == kill_after

    namespace: dict[str, Any] = {
        "torch": torch,
        "DataLoader": DataLoader,
        "dataset": _Augmented(x, y) if augmented else TensorDataset(x, y),
        "itertools": itertools,
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "acc": acc,
        "loss_fn": _loss,
        "epochs": 3,
        "seed": 0,
        "resuming": resuming,
        "time_to_save": time_to_save,
        "load_checkpoint": lambda path, **kw: load_checkpoint(folder / path, **kw),
        "save_checkpoint": lambda path, **kw: save_checkpoint(folder / path, **kw),
    }
    try:
        exec(code, namespace)  # the documented block, run as written
    except _KilledError:
        return None
    return clone_state([model.state_dict(), optimizer.state_dict(), scheduler.state_dict()])


@pytest.mark.parametrize("kill_after", [1, 4, 7, 8, 13, 20])  # mid-window, epoch ends, late
def test_the_documented_data_order_recipe_resumes_bitwise(tmp_path: Path, kill_after: int) -> None:
    assert SEEDING in RECIPE
    uninterrupted = _run(tmp_path, RECIPE)
    assert _run(tmp_path, RECIPE, kill_after=kill_after) is None
    assert_bitwise(_run(tmp_path, RECIPE, resuming=True), uninterrupted)


def test_negative_control_without_seeding_the_epoch_the_resume_differs(tmp_path: Path) -> None:
    """The loader's generator left alone: the resumed epoch is drawn in another order.

    (A fresh generator starts from torch's default seed, so a stop in the first epoch would
    resume in the right order by luck: the stop is in the second.)
    """
    code = RECIPE.replace(SEEDING, "    pass")
    uninterrupted = _run(tmp_path, code)
    _run(tmp_path, code, kill_after=10)
    resumed = _run(tmp_path, code, resuming=True)
    with pytest.raises(AssertionError):
        assert_bitwise(resumed, uninterrupted)


@pytest.mark.parametrize(("kill_after", "workers"), [(1, 0), (4, 0), (8, 0), (13, 0), (9, 2)])
def test_the_recipe_resumes_a_randomly_augmented_dataset_bitwise(
    tmp_path: Path, kill_after: int, workers: int
) -> None:
    """Each item drawn a flip and noise as it is loaded: the skipped ones draw again on resume."""
    assert SKIP in RECIPE
    assert LOADER in RECIPE
    code = RECIPE.replace(LOADER, f"generator=generator, num_workers={workers})")
    uninterrupted = _run(tmp_path, code, augmented=True)
    assert _run(tmp_path, code, kill_after=kill_after, augmented=True) is None
    assert_bitwise(_run(tmp_path, code, resuming=True, augmented=True), uninterrupted)


def test_negative_control_skipping_with_the_rngs_moving_differs(tmp_path: Path) -> None:
    """The skip of earlier versions of the page: the skipped items' augmentations move the RNGs."""
    code = RECIPE.replace(SKIP, ISLICE)
    uninterrupted = _run(tmp_path, code, augmented=True)
    _run(tmp_path, code, kill_after=8, augmented=True)
    resumed = _run(tmp_path, code, resuming=True, augmented=True)
    with pytest.raises(AssertionError):
        assert_bitwise(resumed, uninterrupted)
    plain = _run(tmp_path, code)  # a dataset without augmentation: that skip was exact
    _run(tmp_path, code, kill_after=8)
    assert_bitwise(_run(tmp_path, code, resuming=True), plain)
