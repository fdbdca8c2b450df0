"""The measurements behind `gradaccum demo`, and the sections that show them.

Sections 1-3 (`run_charlm`) train the embedded `charlm` task three ways from the same float64
weights, on the same batches, with the same AdamW: a plain full-batch reference written here
without gradaccum, `gradaccum.Accumulator`, and the naive loop that averages per-micro-batch token
means. They also measure the activation memory of a full-batch and a micro-batch forward.
Section 4 (`run_digits`) trains `digits` in three configs with the experiment runner and compares
the checkpoints it writes.

Parameters are compared per tensor, as `||p - p_ref|| / ||p_ref||` (`tensor_gap`). An
element-wise test would mostly measure AdamW: it divides by `sqrt(v) + eps`, so for a weight whose
gradient is zero in exact arithmetic (such as an attention key bias) it turns rounding noise into
a visible change of that one weight.

`Section` renders one section both as terminal text and as markdown. `OUT_NAMES` lists what the
demo writes into `--out` (see `gradaccum.cli._outdir` for how a previous demo's folder is replaced).
"""

from __future__ import annotations

import copy
import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gradaccum import Accumulator, load_checkpoint
from gradaccum.memory import measure_activation_bytes

__all__ = [
    "DIGITS_CONFIGS",
    "OUT_NAMES",
    "CharlmResult",
    "DigitsResult",
    "INDENT",
    "Section",
    "charlm_batches",
    "run_charlm",
    "run_digits",
    "tensor_gap",
    "wrapped",
]

IGNORE_INDEX = -100
# (micro-batch, accumulation steps) of the digits compare: the reference, its exact twin, a control.
DIGITS_CONFIGS = ((32, 1), (8, 4), (8, 1))
# Everything the demo writes into its out folder; a folder holding only these is replaced.
OUT_NAMES = frozenset({"report.md", "curves.png", "memory.png", "runs"})

INDENT = "   "

Batch = dict[str, torch.Tensor]


@dataclass
class CharlmResult:
    """What sections 1-3 measured on `charlm`.

    `losses` maps "reference", "accumulated" and "naive" to the objective of every step, as each
    run computed it. `gaps` maps "accumulated" and "naive" to `(gap, worst tensor)` against the
    reference. `micro_lines` and `tokens` hold the lines and the counted tokens of each micro-batch
    of the first batch.
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
    """What section 4 measured on `digits`: one summary per config, gaps vs the first config."""

    epochs: int
    summaries: list[Any]
    gaps: dict[str, tuple[float, str]] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)


def tensor_gap(
    params: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> tuple[float, str]:
    """Largest over tensors of `||p - p_ref|| / ||p_ref||`, and the name of that tensor.

    Raises:
        ValueError: If the two hold different tensor names, or a reference tensor is all zeros
            while the other is not (no relative gap exists).
    """
    if params.keys() != reference.keys():
        raise ValueError("the two models have different parameters")
    worst, worst_name = 0.0, ""
    for name, ref in reference.items():
        diff = float((params[name].detach().double() - ref.detach().double()).norm())
        scale = float(ref.detach().double().norm())
        if scale == 0.0 and diff > 0.0:
            raise ValueError(f"reference tensor {name} is all zeros; no relative gap exists")
        gap = diff / scale if scale else 0.0
        if gap >= worst:
            worst, worst_name = gap, name
    return worst, worst_name


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


@dataclass
class Section:
    """One section of the demo, rendered both as terminal text and as markdown.

    `inset_text` and `inset_markdown` go between the introduction and the table (section 4 puts
    the compare report there).
    """

    title: str
    before: list[str]
    headers: list[str]
    rows: list[list[str]]
    after: list[str]
    right: frozenset[int] = frozenset()
    inset_text: str = ""
    inset_markdown: str = ""

    def text(self, number: int) -> str:
        """The section as aligned terminal text, titled `"<number>. <title>"`."""
        lines = [f"{number}. {self.title}", *wrapped(self.before), ""]
        if self.inset_text:
            lines += [self.inset_text, ""]
        widths = [max(map(len, column)) for column in zip(self.headers, *self.rows, strict=True)]
        for cells in [self.headers, *self.rows]:
            padded = [
                cell.rjust(width) if index in self.right else cell.ljust(width)
                for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
            ]
            lines.append((INDENT + "  ".join(padded)).rstrip())
        return "\n".join([*lines, "", *wrapped(self.after)])

    def markdown(self, number: int) -> str:
        """The section as GitHub markdown, under a `## <number>. <title>` heading."""
        lines = [f"## {number}. {self.title}", "", " ".join(self.before), ""]
        if self.inset_markdown:
            lines += [self.inset_markdown, ""]
        align = ["---:" if index in self.right else "---" for index in range(len(self.headers))]
        for cells in [self.headers, align, *self.rows]:
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join([*lines, "", *(f"{line}  " for line in self.after)]).rstrip()


def wrapped(paragraphs: list[str]) -> list[str]:
    """The paragraphs as lines of at most 100 characters, indented by `INDENT`."""
    return [
        line
        for text in paragraphs
        for line in textwrap.wrap(
            text, 100, initial_indent=INDENT, subsequent_indent=INDENT, break_on_hyphens=False
        )
    ]
