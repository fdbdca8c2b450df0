"""Which parameters a window accumulates into: the optimizer's first, then the model's others.

Kept apart from `gradaccum.window` (which re-exports both) so that the window stays small.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["trainable_parameters", "window_parameters"]


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's parameters that require grad, each once, in registration order.

    Raises:
        ValueError: If the model has no trainable parameter.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no parameter with requires_grad=True; there is nothing "
            "to accumulate. Unfreeze at least one parameter."
        )
    return params


def window_parameters(
    model_params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> tuple[list[torch.nn.Parameter], int]:
    """The parameters a window accumulates into, and how many of them (first) the optimizer holds.

    Read when a window opens, not once at construction: a parameter unfrozen or an optimizer
    group added between windows takes part in the next one.

    Args:
        model_params: The model's parameters (`model.parameters()`, or a list of them).
        optimizer: The optimizer, whose parameters come first, in its order.
    """
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    seen = set(map(id, params))
    if len(seen) < len(params):  # a parameter in two groups: keep its first place
        params = list({id(p): p for p in params}.values())
    held = len(params)
    for param in model_params:
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            params.append(param)
    return params, held
