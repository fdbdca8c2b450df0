"""Where the loss is in what a `loss_fn` returned whole, for `read_loss`'s `TypeError`.

A Hugging Face output (a dict or `ModelOutput` with `loss`, a tuple whose first element is the
loss) names its loss; a detector's dict of losses (torchvision's `loss_*` keys) names their
total; several scalar losses of a multi-task model (`{"cls": ..., "reg": ...}`,
`(cls_loss, reg_loss)`) name their weighted total and `LossSum.terms`. Before, such a tuple was
told to return `result[0]` alone, which drops every other task silently, and such a dict got
no hint.

Example:
    >>> import torch
    >>> losses = (torch.tensor(1.0, requires_grad=True), torch.tensor(2.0, requires_grad=True))
    >>> "LossSum.terms" in loss_inside(losses)
    True
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import torch

__all__ = ["loss_inside"]


def _scalars(values: list[object]) -> bool:
    """Whether `values` are two or more one-element tensors: several losses."""
    return len(values) > 1 and all(
        isinstance(value, torch.Tensor) and value.numel() == 1 for value in values
    )


def _several_losses(result: object) -> str:
    """The hint for a multi-task model's losses returned together ("" if `result` is not)."""
    if isinstance(result, Mapping) and _scalars(list(result.values())):
        names = ", ".join(f"{key}=(..._sum, ..._count)" for key in list(result)[:3])
        total = "sum(result.values())"
    elif isinstance(result, (tuple, list)) and _scalars(list(result)):
        names = ", ".join(f"task{index}=(..._sum, ..._count)" for index in range(len(result))[:3])
        total = "sum(result)"
    else:
        return ""
    return (
        f": it holds {len(result)} scalar losses (several tasks' or heads'); returning one of "
        f"them alone drops the others. Return their (weighted) total, e.g. {total} or "
        "cls + 0.5 * reg, when each is a mean over the micro-batch's rows, or, when a task "
        "divides by its own count (labels missing for some rows: a masked mean), "
        f"LossSum.terms({names}) with each task's sum and count (from gradaccum.loss import "
        "Term; a task with no item in a micro-batch still comes, counting 0; docs/losses.md)"
    )


def _loss_dict(result: object) -> bool:
    """Whether `result` is a non-empty dict of scalar tensors keyed `loss...`."""
    return (
        isinstance(result, Mapping)
        and bool(result)
        and all(str(key).startswith("loss") for key in result)
        and all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in result.values())
    )


def loss_inside(result: object) -> str:
    """Where the loss is in a model's output that `loss_fn` returned whole, for the message."""
    if isinstance(result, Mapping) and isinstance(result.get("loss"), torch.Tensor):
        where = "result['loss']"
    elif isinstance(getattr(result, "loss", None), torch.Tensor):
        where = "result.loss"
    elif _loss_dict(result):  # a detection model's losses (torchvision's convention)
        return (
            ": it is a dict of losses; return their total, sum(result.values()) (each a mean "
            "over its micro-batch's images, boxes or anchors: docs/vision.md), or their sums "
            "as gradaccum.LossSum(total_sum, count) / LossSum.terms(...)"
        )
    elif _several_losses(result):
        return _several_losses(result)
    elif isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        where = "result[0] (if it is the loss)"
    elif isinstance(result, numbers.Number) or getattr(result, "ndim", None) == 0:  # numpy too
        return (
            ": a Python or numpy number has no graph; return the loss tensor itself, not "
            "loss.item(), float(loss) or loss.detach().numpy()"
        )
    else:
        return ""
    return (
        f": return {where} alone (a Hugging Face model's loss is a token mean, weighted by rows "
        "here: gradaccum.hf.causal_lm and its siblings count tokens exactly)"
    )
