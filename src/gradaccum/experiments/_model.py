"""Building a run's model (normalization, initial weights) and planning its micro-batch size.

Example:
    >>> from gradaccum.experiments.base import TrainConfig
    >>> type(make_model(TrainConfig(task="shapes", bn="group"))).__name__
    'UNet'
"""

from __future__ import annotations

from pathlib import Path

import torch

from gradaccum._oom import MemoryBudgetError
from gradaccum.batching import batch_size, map_tensors
from gradaccum.checkpoint import CheckpointError, load_model_weights
from gradaccum.experiments.base import TrainConfig
from gradaccum.experiments.tasks import get_task
from gradaccum.sizing import MemoryPlan, plan_micro_batch

__all__ = ["ACCUM_DTYPES", "make_model", "resolve_micro_batch_size"]

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


def resolve_micro_batch_size(config: TrainConfig) -> MemoryPlan:
    """Plan `--micro-batch-size auto`: measured on the run's model, optimizer and first batch.

    Raises:
        ValueError: Without a memory budget, or if nothing fits it.
    """
    if config.memory_budget is None:
        raise ValueError("--micro-batch-size auto needs --memory-budget, e.g. 2GiB.")
    task = get_task(config.task)
    train_data = task.make_data(config.seed).train
    items = min(config.batch_size or task.default_batch_size, batch_size(train_data))
    model = make_model(config)
    try:
        return plan_micro_batch(
            model,
            map_tensors(train_data, lambda t: t[:items]),
            task.loss_fn,
            torch.optim.AdamW(model.parameters()),
            memory_budget=config.memory_budget,
            precision=config.precision,
            accum_dtype=ACCUM_DTYPES.get(config.accum_dtype or ""),
        )
    except MemoryBudgetError as error:
        raise ValueError(str(error)) from None
