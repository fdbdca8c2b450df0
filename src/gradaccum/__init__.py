"""gradaccum: exact, fast, effortless gradient accumulation for PyTorch.

One optimizer step on a logical batch of B items, run as micro-batches, leaves the model, the
optimizer and the scheduler as one full-batch step would. Each micro-batch reports the SUM of its
loss and the COUNT of items; gradients are divided once, by the window's total count.

Example:
    >>> import torch
    >>> import gradaccum
    >>> model = torch.nn.Linear(4, 1)
    >>> acc = gradaccum.Accumulator(model, torch.optim.AdamW(model.parameters()),
    ...                             micro_batch_size=2)
    >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> acc.step((torch.randn(5, 4), torch.randn(5, 1)), mse).stepped
    True
"""

import importlib.util as _importlib_util

if _importlib_util.find_spec("torch") is None:  # before anything imports it: say how to install
    from gradaccum._install import torch_missing_message

    raise ImportError(torch_missing_message())

from gradaccum._oom import MemoryBudgetError
from gradaccum.accumulator import Accumulator, NonFiniteError, StepResult
from gradaccum.batching import split_batch
from gradaccum.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from gradaccum.loss import LossSum
from gradaccum.options import (
    BatchNormMode,
    Normalize,
    OnNonFinite,
    PartialWindow,
    Precision,
    Tokens,
)
from gradaccum.sizing import MemoryPlan, plan_micro_batch
from gradaccum.sync import RankMismatchError
from gradaccum.verify import check_equivalence
from gradaccum.window import accumulate_grad

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "BatchNormMode",
    "CheckpointError",
    "LossSum",
    "MemoryBudgetError",
    "MemoryPlan",
    "NonFiniteError",
    "Normalize",
    "OnNonFinite",
    "PartialWindow",
    "Precision",
    "RankMismatchError",
    "StepResult",
    "Tokens",
    "accumulate_grad",
    "check_equivalence",
    "load_checkpoint",
    "plan_micro_batch",
    "save_checkpoint",
    "split_batch",
]
