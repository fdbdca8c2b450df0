"""The shapes shared by tasks, the runner and the reports.

A `Task` bundles data that ships with the package (or is generated), a model factory, a loss
function in the library's `(sum, count)` convention and a validation metric. A `TrainConfig`
says how to train one configuration, a `ResolvedRun` is one with every default filled in, and a
`RunSummary` is what a finished run reports.

Example:
    >>> config = TrainConfig(task="digits", batch_size=32, micro_batch_size=8)
    >>> config.accumulation_label(), parse_label("8x4"), parse_label("64@2048t")
    ('8x4', (32, 8, None), (64, None, 2048))
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gradaccum.loss import LossSum

__all__ = [
    "LrScaling",
    "ResolvedRun",
    "RunSummary",
    "Task",
    "TaskData",
    "TrainConfig",
    "parse_label",
]


class LrScaling(str, enum.Enum):
    """How the learning rate follows the effective batch size, relative to a reference batch."""

    NONE = "none"
    LINEAR = "linear"  # lr * B / B_ref
    SQRT = "sqrt"  # lr * sqrt(B / B_ref)


@dataclass(frozen=True)
class TaskData:
    """Train and validation sets, each a nesting of tensors sharing the leading dimension."""

    train: Any
    val: Any


class Task(Protocol):
    """An embedded task: data, model, loss and metric.

    Attributes:
        name: Registry name, e.g. `"digits"`.
        metric: Name of the validation metric, e.g. `"accuracy"`.
        higher_is_better: Whether a larger metric is better (False for perplexity).
        reference_batch_size: The batch size `default_lr` was tuned for (lr scaling base).
        default_batch_size: Effective batch size used when none is given.
        default_lr: Learning rate at `reference_batch_size`.
        default_epochs: Epochs used when neither epochs nor steps are given.
        token_sequences: Whether batches are right-padded token sequences with an
            `attention_mask`, which a token budget (`TrainConfig.max_tokens`) can pack.
    """

    name: str
    metric: str
    higher_is_better: bool
    reference_batch_size: int
    default_batch_size: int
    default_lr: float
    default_epochs: int
    token_sequences: bool

    def make_data(self, seed: int) -> TaskData:
        """Build (or load from the package) the train/val split, deterministically."""
        ...

    def make_model(self, seed: int, norm: str = "batch") -> torch.nn.Module:
        """Build the model with weights initialized from `seed`; `norm` picks BN or GroupNorm."""
        ...

    def loss_fn(self, model: torch.nn.Module, batch: Any) -> torch.Tensor | LossSum:
        """The training loss of one micro-batch, as a mean tensor or a `LossSum`."""
        ...

    def evaluate(self, model: torch.nn.Module, val: Any, batch_size: int) -> dict[str, float]:
        """Validation `{"metric": ..., "loss": ...}` in eval mode without gradients."""
        ...


@dataclass(frozen=True)
class TrainConfig:
    """One training configuration, as the `train` and `compare` commands take it.

    `batch_size` is the effective batch; `micro_batch_size` defaults to it (no accumulation).
    `max_tokens` replaces `micro_batch_size` with a token budget: each effective batch is packed
    by `gradaccum.packing.pack_by_tokens` into micro-batches of at most that many padded tokens.
    """

    task: str
    batch_size: int | None = None
    micro_batch_size: int | str | None = None
    memory_budget: str | None = None
    precision: str = "fp32"
    accum_dtype: str | None = None
    lr: float | None = None
    lr_scaling: LrScaling = LrScaling.NONE
    warmup: int = 0
    epochs: int | None = None
    steps: int | None = None
    seed: int = 0
    norm: str = "batch"
    bn: str = "micro"
    init_from: str | None = None
    recalibrate: int = 0
    max_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def accumulation_label(self) -> str:
        """`"{micro}x{steps}"` or, with `max_tokens`, `"{batch}@{max_tokens}t"` (as in the CLI)."""
        batch = self.batch_size or 0
        if self.max_tokens is not None:
            return f"{batch}@{self.max_tokens}t"
        micro = self.micro_batch_size if isinstance(self.micro_batch_size, int) else batch
        return f"{micro}x{-(-batch // micro) if micro else 1}"

    @property
    def model_norm(self) -> str:
        """The task model's normalization: `--bn group` asks for GroupNorm."""
        return "group" if self.bn == "group" else self.norm

    @property
    def batchnorm(self) -> str:
        """The Accumulator's `batchnorm` mode (GroupNorm models have no BatchNorm)."""
        return "micro" if self.bn == "group" else self.bn

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ResolvedRun:
    """A `TrainConfig` with every default filled in from its task and checked.

    `gradaccum.experiments.runner.resolve` builds it.
    """

    config: TrainConfig
    task: Task
    effective_batch: int
    micro_batch_size: int
    lr: float
    total_steps: int
    steps_per_epoch: int
    max_tokens: int | None = None

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches of a full effective batch; with a token budget, an upper bound.

        A packed micro-batch holds at least one row, so an effective batch of B rows makes at
        most B of them; the runner ends a window after its batch's last micro-batch (`flush()`).
        """
        if self.max_tokens is not None:
            return self.effective_batch
        return math.ceil(self.effective_batch / self.micro_batch_size)

    def describe(self) -> str:
        """One line: the batch split, lr, length, precision and seed."""
        length = f"{self.total_steps} steps"
        if self.config.steps is None:
            epochs = self.total_steps // self.steps_per_epoch
            length += f" ({epochs} epochs of {self.steps_per_epoch})"
        count = self.accumulation_steps
        split = (
            f"{count} micro-batch{'es' if count > 1 else ''} of up to {self.micro_batch_size}"
            if self.max_tokens is None
            else f"micro-batches packed by length, each at most {self.max_tokens} padded tokens"
        )
        return (
            f"{self.label}: batch {self.effective_batch} = {split}, lr {self.lr:.3g}, {length}, "
            f"{self.config.precision}, seed {self.config.seed}"
        )

    @property
    def label(self) -> str:
        """The config as the command line writes it: `MxK`, or `B@Nt` with a token budget."""
        if self.max_tokens is not None:
            return f"{self.effective_batch}@{self.max_tokens}t"
        return f"{self.micro_batch_size}x{self.accumulation_steps}"


@dataclass(frozen=True)
class RunSummary:
    """What a finished run reports (also written as `summary.json`).

    `micro_batch_size` is the rows of the run's largest micro-batch and `accumulation_steps` the
    micro-batches of its fullest window: for `MxK` configs, M and K. With a token budget
    (`max_tokens`, configs `B@Nt`) they are what the packing produced, and
    `micro_batches_per_step` is the mean number of micro-batches per optimizer step.
    `noise_scale` is the gradient noise scale `B_simple` at the last step (`gradaccum.telemetry`).
    """

    config: str
    effective_batch: int
    micro_batch_size: int
    accumulation_steps: int
    optimizer_steps: int
    samples_seen: int
    best_metric: float
    final_metric: float
    metric: str
    peak_memory_bytes: int
    samples_per_second: float
    wall_seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    max_tokens: int | None = None
    micro_batches_per_step: float | None = None
    noise_scale: float | None = None


_HOW = (
    "write MICROxSTEPS, e.g. 8x2 (micro-batch 8, 2 accumulation steps, effective batch 16), or "
    "BATCH@TOKENSt, e.g. 64@2048t (batch 64 packed into micro-batches of at most 2048 tokens)"
)


def parse_label(text: str) -> tuple[int, int | None, int | None]:
    """`MxK` or `B@Nt` as (batch size, micro-batch size, token budget).

    The inverse of `TrainConfig.accumulation_label`; `gradaccum compare` reads its configs so.

    Raises:
        ValueError: If `text` is neither, or holds a zero; the message shows both forms.
    """
    split = re.fullmatch(r"(\d+)x(\d+)", text)
    budget = re.fullmatch(r"(\d+)@(\d+)t", text)
    numbers = [int(n) for n in (split or budget).groups()] if split or budget else [0]
    if min(numbers) < 1:
        raise ValueError(f"malformed config {text!r}: {_HOW}")
    if split:
        return numbers[0] * numbers[1], numbers[0], None
    return numbers[0], None, numbers[1]
