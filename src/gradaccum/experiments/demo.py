"""The measurements behind `gradaccum demo` (its sections are in `demo_sections`).

`run_charlm` (sections 1-3) trains the embedded `charlm` task three ways from the same float64
weights, on the same batches, with the same AdamW: a plain full-batch reference written here
without gradaccum, `gradaccum.Accumulator`, and the naive loop that averages per-micro-batch token
means. It also measures the activation memory of a full-batch and a micro-batch forward.
`run_digits` (section 4) trains `digits` in `DIGITS_CONFIGS` with the experiment runner, writes the
compare report and compares the checkpoints. Weights are compared with `gaps.tensor_gap`.

`OUT_NAMES` lists what the demo writes into its out folder; a folder of only these is a previous
demo's, which the command replaces.

Example:
    >>> train = {"tokens": torch.arange(10).view(5, 2), "labels": torch.arange(10).view(5, 2)}
    >>> [len(batch["labels"]) for batch in charlm_batches(train, steps=3, size=4, seed=0)]
    [4, 4, 4]
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradaccum import Accumulator, load_checkpoint
from gradaccum.experiments.gaps import tensor_gap
from gradaccum.memory import measure_activation_bytes

__all__ = [
    "DIGITS_CONFIGS",
    "OUT_NAMES",
    "CharlmResult",
    "DigitsResult",
    "charlm_batches",
    "run_charlm",
    "run_digits",
]

IGNORE_INDEX = -100
# (micro-batch, accumulation steps) of the digits compare: the reference, its exact twin, a control.
DIGITS_CONFIGS = ((32, 1), (8, 4), (8, 1))
# Everything the demo writes into its out folder; a folder holding only these is replaced.
OUT_NAMES = frozenset({"report.md", "curves.png", "memory.png", "runs"})

Batch = dict[str, torch.Tensor]


@dataclass
class CharlmResult:
    """What sections 1-3 measured on `charlm`.

    `losses` maps "reference", "accumulated" and "naive" to the objective of every step, as each
    run computed it. `gaps` maps "accumulated" and "naive" to `(gap, worst tensor)` against the
    reference. `micro_lines` and `tokens` hold the lines and the counted tokens of each micro-batch
    of the first batch; `full_bytes` and `micro_bytes` the activation bytes of the first batch's
    forward and of its largest micro-batch's.
    """

    steps: int
    batch_size: int
    micro_batch_size: int
    lr: float
    parameters: int
    losses: dict[str, list[float]]
    gaps: dict[str, tuple[float, str]]
    micro_lines: list[int]
    tokens: list[int]
    full_bytes: int
    micro_bytes: int

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step."""
        return math.ceil(self.batch_size / self.micro_batch_size)


@dataclass
class DigitsResult:
    """What section 4 measured on `digits`: one summary per config, gaps vs the first config.

    `paths` is what `report.write_report` returned (`"report"` is the compare's `report.md`).
    """

    epochs: int
    summaries: list[Any]
    gaps: dict[str, tuple[float, str]] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)


def charlm_batches(train: Batch, steps: int, size: int, seed: int) -> list[Batch]:
    """`steps` batches of `size` lines, in seeded random order (a new order per pass)."""
    lines = len(train["labels"])
    generator = torch.Generator().manual_seed(seed)
    passes = math.ceil(steps * size / lines)
    order = torch.cat([torch.randperm(lines, generator=generator) for _ in range(passes)])
    return [
        {key: value[order[k * size : (k + 1) * size]] for key, value in train.items()}
        for k in range(steps)
    ]


def _train_reference(model: nn.Module, batches: list[Batch], lr: float) -> list[float]:
    """Plain PyTorch, no gradaccum: token sum / token count of the whole batch, one step each."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        labels = batch["labels"]
        counted = labels != IGNORE_INDEX
        width = int(counted.sum(dim=1).max())  # labels are right-padded: the rest is padding
        logits = model(batch["tokens"][:, :width])
        targets = labels[:, :width].flatten()
        total = F.cross_entropy(
            logits.flatten(0, 1), targets, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        loss = total / counted.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _train_accumulated(
    model: nn.Module, batches: list[Batch], lr: float, micro: int, task: Any
) -> list[float]:
    """`gradaccum.Accumulator.step` with the task's `LossSum` loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    accumulator = Accumulator(model, optimizer, micro_batch_size=micro)
    losses = []
    for batch in batches:
        result = accumulator.step(batch, task.loss_fn)
        if not result.stepped:
            raise RuntimeError(f"the Accumulator did not step: {result}")
        losses.append(result.loss)
    return losses


def _train_naive(
    model: nn.Module, batches: list[Batch], lr: float, micro: int, task: Any
) -> list[float]:
    """The common loop: each micro-batch's token mean, divided by the number of micro-batches."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        starts = range(0, len(batch["labels"]), micro)
        window = 0.0
        for start in starts:
            part = {key: value[start : start + micro] for key, value in batch.items()}
            loss = task.naive_loss_fn(model, part) / len(starts)
            loss.backward()
            window += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(window)
    return losses


def run_charlm(task: Any, *, seed: int, steps: int, size: int, micro: int) -> CharlmResult:
    """Sections 1-3: train `charlm` three ways in float64, compare, and measure memory.

    Args:
        task: The `charlm` task (`gradaccum.experiments.tasks.get_task("charlm")`).
        seed: Seeds the data split, the batch order and the initial weights.
        steps: Optimizer steps of each run.
        size: Lines per optimizer step.
        micro: Lines per micro-batch.
    """
    train = task.make_data(seed).train
    batches = charlm_batches(train, steps, size, seed)
    initial = task.make_model(seed).double()
    lr = task.default_lr
    runs = {name: copy.deepcopy(initial) for name in ("reference", "accumulated", "naive")}
    losses = {
        "reference": _train_reference(runs["reference"], batches, lr),
        "accumulated": _train_accumulated(runs["accumulated"], batches, lr, micro, task),
        "naive": _train_naive(runs["naive"], batches, lr, micro, task),
    }
    reference = dict(runs["reference"].named_parameters())
    gaps = {
        name: tensor_gap(dict(runs[name].named_parameters()), reference)
        for name in ("accumulated", "naive")
    }
    first = batches[0]
    parts = [
        {key: value[start : start + micro] for key, value in first.items()}
        for start in range(0, size, micro)
    ]
    return CharlmResult(
        steps=steps,
        batch_size=size,
        micro_batch_size=micro,
        lr=lr,
        parameters=sum(p.numel() for p in initial.parameters()),
        losses=losses,
        gaps=gaps,
        micro_lines=[len(part["labels"]) for part in parts],
        tokens=[int((part["labels"] != IGNORE_INDEX).sum()) for part in parts],
        full_bytes=measure_activation_bytes(initial, first, task.loss_fn),
        micro_bytes=max(measure_activation_bytes(initial, part, task.loss_fn) for part in parts),
    )


def run_digits(folder: Path, *, seed: int, epochs: int) -> DigitsResult:
    """Section 4: train `DIGITS_CONFIGS` with the runner, write the compare report, compare weights.

    Each config's files go to `folder/runs/<config>`; `report.md`, `curves.png` and `memory.png`
    (from `gradaccum.experiments.report.write_report`) go to `folder`.

    Args:
        folder: An existing, empty folder.
        seed: The seed of every run (same initial weights; same batch order for equal batches).
        epochs: Epochs of every run.
    """
    from gradaccum.experiments.base import TrainConfig
    from gradaccum.experiments.report import read_metrics, write_report
    from gradaccum.experiments.runner import train
    from gradaccum.experiments.tasks import get_task

    task = get_task("digits")
    result = DigitsResult(epochs=epochs, summaries=[])
    curves, weights = {}, {}
    for micro, accumulation in DIGITS_CONFIGS:
        label = f"{micro}x{accumulation}"
        run_dir = folder / "runs" / label
        run_dir.mkdir(parents=True)
        config = TrainConfig(
            task="digits",
            batch_size=micro * accumulation,
            micro_batch_size=micro,
            epochs=epochs,
            seed=seed,
        )
        result.summaries.append(train(config, out=run_dir))
        curves[label] = read_metrics(run_dir / "metrics.jsonl")
        model = task.make_model(seed)
        optimizer = torch.optim.AdamW(model.parameters())
        load_checkpoint(run_dir / "checkpoint.pt", model=model, optimizer=optimizer)
        weights[label] = dict(model.named_parameters())
    first, *others = weights
    result.gaps = {label: tensor_gap(weights[label], weights[first]) for label in others}
    settings = {
        "seed": seed,
        "epochs": epochs,
        "lr": f"{task.default_lr:g} (no scaling)",
        "optimizer": "AdamW",
        "precision": "fp32",
        "threads": torch.get_num_threads(),
    }
    result.paths = write_report(
        folder, "digits", result.summaries, curves=curves, settings=settings
    )
    return result
