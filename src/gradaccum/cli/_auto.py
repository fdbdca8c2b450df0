"""`--micro-batch-size auto` on the command line: planned and timed once, before training.

The memory plan gives the largest size that fits `--memory-budget`; the sizes up to it are then
timed on windows of the first batch, on a throwaway copy of the model, and the fastest is kept
(`gradaccum._tuner`, with hysteresis). The run records that size in its `config.json`, so a
resumed run uses the same size without planning again, and how it was chosen in
`config.extra["planned_from"]`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.cli import UsageError
from gradaccum.cli._args import one_line
from gradaccum.experiments.base import TrainConfig
from gradaccum.experiments.runner import resolve_micro_batch_size
from gradaccum.sizing import MemoryPlan

__all__ = ["AutoPlan", "plan_auto"]


@dataclass(frozen=True)
class AutoPlan:
    """`--micro-batch-size auto` resolved: the plan, why the size, and the config with it."""

    plan: MemoryPlan
    reason: str
    config: TrainConfig


def plan_auto(config: TrainConfig) -> AutoPlan:
    """Plan `--micro-batch-size auto` once, before training, so the run records a fixed size.

    Raises:
        UsageError: Without `--memory-budget`, or if even one item does not fit it.
    """
    try:
        choice = resolve_micro_batch_size(config)
    except (ValueError, TypeError) as error:
        raise UsageError(one_line(error)) from None
    budget = config.memory_budget
    planned = f"auto, --memory-budget {budget}: {choice.reason}"
    extra = {**config.extra, "planned_from": planned}
    size = choice.micro_batch_size
    fixed = config.replace(micro_batch_size=size, memory_budget=None, extra=extra)
    return AutoPlan(choice.plan, choice.reason, fixed)
