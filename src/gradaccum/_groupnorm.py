"""Finding a model's BatchNorm layers, and replacing them by GroupNorm (exact under accumulation).

Both are public through `gradaccum.batchnorm`; they live here so that the window's BatchNorm
control (`gradaccum.batchnorm.BatchNormControl`) reads as one concern.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    >>> [name for name, _ in batchnorm_modules(net)], type(convert_to_groupnorm(net)[1]).__name__
    (['1'], 'GroupNorm')
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["batchnorm_modules", "convert_to_groupnorm"]


def batchnorm_modules(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """All BatchNorm modules of `model` (1d, 2d, 3d, lazy and SyncBatchNorm), with their names.

    Example:
        >>> [name for name, _ in batchnorm_modules(nn.Sequential(nn.BatchNorm2d(3)))]
        ['0']
    """
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def _group_count(channels: int, num_groups: int) -> int:
    """The largest divisor of `channels` that is at most `num_groups`."""
    return next(g for g in range(min(num_groups, channels), 0, -1) if channels % g == 0)


def convert_to_groupnorm(model: nn.Module, num_groups: int = 32) -> nn.Module:
    """Replace every BatchNorm of `model` by a GroupNorm, in place; accumulation becomes exact.

    Each GroupNorm gets the largest group count that divides the channels and is at most
    `num_groups`, the BatchNorm's `eps` and a copy of its affine weight and bias (same device,
    dtype, `requires_grad` and training flag). GroupNorm suits feature maps `(N, C, *)`; for
    BatchNorm1d over plain features `(N, C)` pass a small `num_groups` (1 is a LayerNorm), as a
    one-channel group normalizes a single number. Build the optimizer after converting.

    Returns:
        The model; a new GroupNorm if `model` itself is a BatchNorm.

    Raises:
        ValueError: For a bad `num_groups`, or a lazy BatchNorm that has seen no input.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 48, 3), nn.BatchNorm2d(48))
        >>> convert_to_groupnorm(net)[1].num_groups
        24
    """
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
        raise ValueError(f"num_groups={num_groups!r} must be a positive int.")
    found = batchnorm_modules(model)
    lazy = [
        f"{name or '<model>'!r} ({type(m).__name__})" for name, m in found if not m.num_features
    ]
    if lazy:
        raise ValueError(
            f"convert_to_groupnorm: {', '.join(lazy)} has not seen an input yet, so its channel "
            "count is unknown; run one forward pass (e.g. model(sample_batch)) first."
        )
    if isinstance(model, _BatchNorm):
        return _groupnorm_like(model, num_groups)
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _groupnorm_like(module, num_groups))
    return model


def _groupnorm_like(bn: _BatchNorm, num_groups: int) -> nn.GroupNorm:
    channels, like = bn.num_features, bn.weight if bn.affine else bn.running_mean
    factory: dict[str, Any] = {} if like is None else {"device": like.device, "dtype": like.dtype}
    groups = _group_count(channels, num_groups)
    gn = nn.GroupNorm(groups, channels, eps=bn.eps, affine=bn.affine, **factory)
    if bn.affine:
        gn.weight = nn.Parameter(bn.weight.detach().clone(), bn.weight.requires_grad)
        gn.bias = nn.Parameter(bn.bias.detach().clone(), bn.bias.requires_grad)
    return gn.train(bn.training)
