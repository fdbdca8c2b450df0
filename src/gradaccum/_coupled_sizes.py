"""What makes the micro-batch size change the step: then `"auto"` may not time smaller sizes.

`micro_batch_size="auto"` times the largest size that fits against smaller ones and keeps the
fastest, because every split gives the same step. Two things break that, and with either
`"auto"` runs the largest size that fits, untimed (as `"largest"` does), exact whenever the
window fits, and `StepResult.sizing` says why:

- a BatchNorm that normalizes with batch statistics (train mode under `batchnorm="micro"` or
  `"pooled"`, or any mode without running statistics): its batch is the micro-batch, so each
  timed size trained another model (a window of 200 timed at 128, 64 and 32 ended 1.1
  relative off the full-batch step under `"micro"`, 7.6e-2 under `"pooled"`, silently);
  `batchnorm="frozen"` or `convert_to_groupnorm` make the size a speed knob again;
- a loss that compares or pools the rows of its micro-batch (in-batch negatives, a batch Dice,
  preference pairs the split cuts, advantages normalized over it, a mixup drawn per
  micro-batch, class weights from its label counts), once warned about (`gradaccum._token_mean`):
  each timed size trained on another objective (InfoNCE over 64 rows, 32 kept: 7.5e-2 off,
  warned once).
  Such a window's first split runs before the warning, so one timed window may differ.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    >>> batch_statistics_layers(model, frozen=False), batch_statistics_layers(model, frozen=True)
    (['1'], [])
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._averaged import named_trained_modules
from gradaccum.options import BatchNormMode


class Engine(Protocol):
    """What is read of `gradaccum._engine.Engine` (which imports the sizer: no import cycle)."""

    model: torch.nn.Module
    batchnorm: Any  # `BatchNormControl`: its `mode`
    token_mean: Any  # `TokenMeanCheck`: whether a row-coupling warning was told


__all__ = ["batch_statistics_layers", "split_changes_step", "untimed_note"]


def batch_statistics_layers(model: torch.nn.Module, *, frozen: bool) -> list[str]:
    """The trained model's BatchNorm layers that normalize with the micro-batch's statistics.

    `frozen`: `batchnorm="frozen"`, under which every BatchNorm runs on its running statistics.
    """
    if frozen:
        return []
    return [
        name or "<model>"
        for name, module in named_trained_modules(model)
        if isinstance(module, _BatchNorm) and (module.training or module.running_mean is None)
    ]


def split_changes_step(engine: Engine) -> list[str]:
    """Why the next window's size would change its step, if it would (empty: a speed knob)."""
    frozen = engine.batchnorm.mode is BatchNormMode.FROZEN
    reasons = []
    if layers := batch_statistics_layers(engine.model, frozen=frozen):
        shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
        reasons.append(
            f"BatchNorm ({shown}) normalizes each micro-batch with its own statistics "
            "(batchnorm='frozen' or gradaccum.batchnorm.convert_to_groupnorm(model) let auto "
            "time sizes)"
        )
    if engine.token_mean.rows_coupled:
        reasons.append(
            "loss_fn compares, pools or normalizes the rows of its micro-batch, as warned (see "
            "docs/losses.md for an exact recipe)"
        )
    return reasons


def untimed_note(size: int, reasons: list[str]) -> str:
    """`StepResult.sizing` for an auto-sized window that may not time smaller sizes."""
    return (
        f"auto {size}: the largest that fits, untimed: {'; '.join(reasons)}; a smaller size "
        "would change the step"
    )
