"""How a training run cuts its data: effective batches in a seeded order, then micro-batches.

Each epoch's order is a permutation drawn from `seed * 1_000_003 + epoch`, cut into consecutive
effective batches (the last one of an epoch may be shorter). Each effective batch is then cut into
micro-batches: by rows (`split_batch` with the run's micro-batch size, config `MxK`), or, with a
token budget (config `B@Nt`), by `gradaccum.packing.pack_by_tokens`, which sorts the batch's rows
by length and packs them so that no micro-batch holds more than N padded tokens (rows x its
longest row). Both are pure functions of the data, the seed and the step, so a resumed run cuts
exactly the same micro-batches, and `plan_micro_batches` can count every window's micro-batches
before training.

Example:
    >>> from gradaccum.experiments.runner import resolve
    >>> from gradaccum.experiments.base import TrainConfig
    >>> from gradaccum.experiments.tasks import get_task
    >>> train = get_task("charlm").make_data(0).train
    >>> run = resolve(TrainConfig(task="charlm", batch_size=96, max_tokens=512, steps=3))
    >>> plan = plan_micro_batches(train, run)
    >>> plan.per_window, plan.largest_rows, round(plan.mean, 2)
    ((9, 10, 9), 13, 9.33)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.batching import batch_size, map_tensors, split_batch
from gradaccum.experiments.base import ResolvedRun, Task, TrainConfig
from gradaccum.experiments.tasks import TASKS, get_task
from gradaccum.packing import pack_by_tokens, sequence_lengths

__all__ = [
    "MicroBatchPlan",
    "check_max_tokens",
    "check_token_budget",
    "effective_batches",
    "micro_batches",
    "plan_micro_batches",
]


def effective_batches(
    train: Any, run: ResolvedRun, done: int = 0
) -> Iterator[tuple[int, Any, bool]]:
    """Effective batches in a seeded order per epoch: (epoch, batch, last of its epoch).

    Args:
        train: The training set.
        run: The resolved run (batch size, steps).
        done: Batches already trained (resume): the order is regenerated and they are skipped.
    """
    items = batch_size(train)
    step = done
    first_epoch = done // run.steps_per_epoch + 1
    for epoch in range(first_epoch, 1 + math.ceil(run.total_steps / run.steps_per_epoch)):
        generator = torch.Generator().manual_seed(run.config.seed * 1_000_003 + epoch)
        order = torch.randperm(items, generator=generator)
        skip = done % run.steps_per_epoch if epoch == first_epoch else 0
        for start in range(skip * run.effective_batch, items, run.effective_batch):
            if step == run.total_steps:
                return
            index = order[start : start + run.effective_batch]
            step += 1
            yield epoch, map_tensors(train, lambda t, i=index: t[i]), start + len(index) >= items


def micro_batches(batch: Any, run: ResolvedRun) -> list[Any]:
    """The micro-batches of one effective batch: packed by the token budget, or split by rows."""
    if run.max_tokens is not None:
        return pack_by_tokens(batch, run.max_tokens)
    return split_batch(batch, run.micro_batch_size)


def check_max_tokens(config: TrainConfig, task: Task) -> None:
    """Check `config.max_tokens` against the rest of `config` and its task.

    Raises:
        ValueError: If the budget is not a positive int, comes with a micro-batch size, or is
            given for a task whose batches are not token sequences; the message names the fix.
    """
    budget = config.max_tokens
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(
            f"--max-tokens={budget!r} must be a positive int: the padded tokens (rows x longest "
            "row) one micro-batch may hold, e.g. --max-tokens 2048."
        )
    if config.micro_batch_size is not None:
        raise ValueError(
            "--max-tokens and --micro-batch-size both size the micro-batches; give one: "
            "--max-tokens N packs each batch by tokens, --micro-batch-size M splits it by rows."
        )
    if not getattr(task, "token_sequences", False):
        names = [name for name in TASKS if getattr(get_task(name), "token_sequences", False)]
        raise ValueError(
            f"--max-tokens packs token sequences by length, and the {task.name} task's batches "
            f"are not token sequences; use it with --task {' or '.join(names)} (or split "
            f"{task.name} by rows with --micro-batch-size)."
        )


def check_token_budget(train: Any, max_tokens: int) -> None:
    """Refuse a token budget below the longest row: that row could not be split, only run alone.

    Raises:
        ValueError: If a training row is longer than `max_tokens`; the message names the minimum.
    """
    longest = max(sequence_lengths(train), default=0)
    if longest > max_tokens:
        raise ValueError(
            f"--max-tokens={max_tokens} is less than the longest training sequence ({longest} "
            f"tokens), which cannot be split across micro-batches; give --max-tokens {longest} "
            "or more."
        )


@dataclass(frozen=True)
class MicroBatchPlan:
    """The micro-batches of every window of a run, counted before it trains.

    Attributes:
        per_window: Micro-batches of each window, by step (index 0 is step 1).
        largest_rows: Rows of the run's largest micro-batch.
        measured: The micro-batch peak memory is measured on: the first `micro_batch_size`
            rows, or with a token budget the packed micro-batch holding the most padded tokens.
    """

    per_window: tuple[int, ...]
    largest_rows: int
    measured: Any

    @property
    def most(self) -> int:
        """Micro-batches of the window with the most."""
        return max(self.per_window, default=0)

    @property
    def mean(self) -> float:
        """Micro-batches per window, on average over the run."""
        return sum(self.per_window) / len(self.per_window) if self.per_window else 0.0


def plan_micro_batches(train: Any, run: ResolvedRun) -> MicroBatchPlan:
    """Count the micro-batches of every window of `run` on `train` (packing each batch if needed).

    Args:
        train: The training set.
        run: The resolved run.
    """
    if run.max_tokens is None:
        items = batch_size(train)
        sizes = (
            min(run.effective_batch, items - (step % run.steps_per_epoch) * run.effective_batch)
            for step in range(run.total_steps)
        )
        per_window = tuple(math.ceil(size / run.micro_batch_size) for size in sizes)
        measured = map_tensors(train, lambda t: t[: run.micro_batch_size])
        return MicroBatchPlan(per_window, run.micro_batch_size, measured)
    counts, largest, measured, most_tokens = [], 0, None, -1
    for _, batch, _ in effective_batches(train, run):
        parts = micro_batches(batch, run)
        counts.append(len(parts))
        for part in parts:
            rows = batch_size(part)
            tokens = rows * max(sequence_lengths(part), default=0)
            largest = max(largest, rows)
            if tokens > most_tokens:
                measured, most_tokens = part, tokens
    return MicroBatchPlan(tuple(counts), largest, measured)
