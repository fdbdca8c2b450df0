"""Weight averages held inside the model: an EMA or SWA copy kept as a submodule.

A training module often keeps its EMA as an attribute, `self.ema = AveragedModel(self.net, ...)`,
so that one `state_dict()` and one checkpoint hold both. The copy's parameters still require grad
(AveragedModel deep-copies the module as it is) and its BatchNorm layers are in train mode, but
its forward never runs in a training step: `update_parameters` moves its weights after each step
and `update_bn` sets its statistics at the end. So it is not "a parameter nothing trains", nor a
BatchNorm normalizing micro-batches, nor gradients to plan memory for; the checks that read the
model's modules statically leave it out.

Example:
    >>> import torch
    >>> from torch.optim.swa_utils import AveragedModel
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> holder = torch.nn.ModuleDict({"net": net, "ema": AveragedModel(net)})
    >>> sorted(name for name, _ in named_trained_modules(holder))
    ['', 'net', 'net.0']
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.optim.swa_utils import AveragedModel

__all__ = ["averaged_parameter_ids", "named_trained_modules"]


def named_trained_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """`model.named_modules()` without those inside a weight average the model holds.

    The model itself is kept even if it is an `AveragedModel`: then it is what is trained.
    """
    skipped: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in skipped):
            continue
        if name and isinstance(module, AveragedModel):
            skipped.append(name + ".")
            continue
        yield name, module


def averaged_parameter_ids(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters that only a weight average inside `model` holds.

    A parameter the trained modules share with it (none, for AveragedModel's deep copy) is not
    one of them.
    """
    averaged = {
        id(p)
        for name, module in model.named_modules()
        if name and isinstance(module, AveragedModel)
        for p in module.parameters()
    }
    if not averaged:  # the common case: no weight average inside
        return averaged
    modules = named_trained_modules(model)
    trained = {id(p) for _, module in modules for p in module.parameters(recurse=False)}
    return averaged - trained
