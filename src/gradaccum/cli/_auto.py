"""`--micro-batch-size auto` on the command line: planned once, before training.

The run then records the planned size in its `config.json`, so a resumed run uses the same size
without planning again, and the plan's budget is kept in `config.extra["planned_from"]`.
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
    """`--micro-batch-size auto` resolved: the plan, and the config with its size filled in."""

    plan: MemoryPlan
    config: TrainConfig


def plan_auto(config: TrainConfig) -> AutoPlan:
    """Plan `--micro-batch-size auto` once, before training, so the run records a fixed size.

    Raises:
        UsageError: Without `--memory-budget`, or if even one item does not fit it.
    """
    try:
        plan = resolve_micro_batch_size(config)
    except (ValueError, TypeError) as error:
        raise UsageError(one_line(error)) from None
    budget = config.memory_budget
    extra = {**config.extra, "planned_from": f"auto, --memory-budget {budget}"}
    fixed = config.replace(micro_batch_size=plan.micro_batch_size, memory_budget=None, extra=extra)
    return AutoPlan(plan, fixed)
