"""Building a run's model (normalization, initial weights) and planning its micro-batch size.

Example:
    >>> from gradaccum.experiments.base import TrainConfig
    >>> type(make_model(TrainConfig(task="shapes", bn="group"))).__name__
    'UNet'
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from gradaccum import MemoryBudgetError
from gradaccum.accumulator import Accumulator
from gradaccum.batching import batch_size, map_tensors
from gradaccum.batchnorm import BatchNormAccumulationWarning
from gradaccum.checkpoint import CheckpointError, load_model_weights
from gradaccum.experiments.base import TrainConfig
from gradaccum.experiments.tasks import get_task
from gradaccum.sizing import MemoryPlan

__all__ = ["ACCUM_DTYPES", "AutoChoice", "make_model", "resolve_micro_batch_size"]

_MAX_TIMING_WINDOWS = 12  # a warm-up and 2 rounds of at most 4 candidates, with room to spare

ACCUM_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64}


def make_model(config: TrainConfig, *, initial_weights: bool = True) -> torch.nn.Module:
    """The task's model for `config`: its normalization, and `init_from` weights if given.

    Raises:
        ValueError: If the task has no such model, or the weights do not fit it.
    """
    model = get_task(config.task).make_model(config.seed, config.model_norm)
    # A resumed run loads its own checkpoint over these weights: the file need not exist anymore.
    if config.init_from is not None and initial_weights:
        try:
            load_model_weights(Path(config.init_from), model)
        except (CheckpointError, FileNotFoundError) as error:
            raise ValueError(f"--init-from: {error}") from None
    return model


@dataclass(frozen=True)
class AutoChoice:
    """`--micro-batch-size auto` resolved: the memory plan, and the fastest size within it.

    Attributes:
        plan: The memory plan (its `micro_batch_size` is the largest that fits).
        micro_batch_size: The fastest size that fits, timed on the first batch.
        reason: Why, as `StepResult.sizing` says it.
    """

    plan: MemoryPlan
    micro_batch_size: int
    reason: str

    def fixed(self, config: TrainConfig) -> TrainConfig:
        """`config` with this size for "auto", recording how it was chosen (for a resume)."""
        planned = f"auto, --memory-budget {config.memory_budget}: {self.reason}"
        extra = {**config.extra, "planned_from": planned}
        return config.replace(
            micro_batch_size=self.micro_batch_size, memory_budget=None, extra=extra
        )


def resolve_micro_batch_size(config: TrainConfig, *, timed: bool = True) -> AutoChoice:
    """Plan `--micro-batch-size auto` on the run's model, optimizer and first batch, then time it.

    The timing is `Accumulator(micro_batch_size="auto")`'s own (`gradaccum._tuner`): real windows
    of the first batch on a throwaway copy of the model, so the run itself starts untouched.

    Raises:
        ValueError: Without a memory budget, or if nothing fits it.
    """
    if config.memory_budget is None:
        raise ValueError("--micro-batch-size auto needs --memory-budget, e.g. 2GiB.")
    task = get_task(config.task)
    train_data = task.make_data(config.seed).train
    items = min(config.batch_size or task.default_batch_size, batch_size(train_data))
    batch = map_tensors(train_data, lambda t: t[:items])
    model = make_model(config)
    acc = Accumulator(
        model,
        torch.optim.AdamW(model.parameters()),
        micro_batch_size="auto" if timed else "largest",
        memory_budget=config.memory_budget,
        precision=config.precision,
        accum_dtype=ACCUM_DTYPES.get(config.accum_dtype or ""),
        batchnorm=config.batchnorm,
    )
    try:
        # A throwaway copy: its BatchNorm notes are not the run's, nor are its random numbers.
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore", BatchNormAccumulationWarning)
            for _ in range(_MAX_TIMING_WINDOWS):
                result = acc.step(batch, task.loss_fn)
                if result.sizing is None or "timing" not in result.sizing:
                    break
    except MemoryBudgetError as error:
        raise ValueError(str(error)) from None
    assert acc.plan is not None
    reason = result.sizing or "the largest size that fits"
    return AutoChoice(acc.plan, result.micro_batch_size, reason.split(": ", 1)[-1])
