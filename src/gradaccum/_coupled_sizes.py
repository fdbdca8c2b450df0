"""Layers whose batch is the micro-batch: with them, `"auto"` may not time smaller sizes.

`micro_batch_size="auto"` times the largest size that fits against smaller ones and keeps the
fastest, because every split gives the same step. A BatchNorm that normalizes with batch
statistics (train mode under `batchnorm="micro"` or `"pooled"`, or any mode without running
statistics) breaks that: its batch is the micro-batch, so each timed size trains another model
(a window of 200 timed at 128, 64 and 32 ended 1.1 relative off the full-batch step under
`"micro"`, 7.6e-2 under `"pooled"`, the latter silently), and the size kept is chosen for speed,
not for the statistics. With such layers `"auto"` runs the largest size that fits, untimed (as
`"largest"` does), which is exact whenever the window fits; `batchnorm="frozen"` or
`convert_to_groupnorm` make the size a pure speed knob again, and `"auto"` times it.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    >>> batch_statistics_layers(model, frozen=False), batch_statistics_layers(model, frozen=True)
    (['1'], [])
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._averaged import named_trained_modules

__all__ = ["batch_statistics_layers", "untimed_note"]


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


def untimed_note(size: int, layers: list[str]) -> str:
    """`StepResult.sizing` for an auto-sized window that may not time smaller sizes."""
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return (
        f"auto {size}: the largest that fits, untimed: BatchNorm ({shown}) normalizes each "
        "micro-batch with its own statistics, so a smaller size would change the step; "
        "batchnorm='frozen' or gradaccum.batchnorm.convert_to_groupnorm(model) let auto time sizes"
    )
