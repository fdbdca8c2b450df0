"""Losses written for a hand-made accumulation loop, which gradaccum would read wrongly.

Two lines of the copied loops survive a port to `loss_fn` and are silently wrong there:

- `loss = loss / accumulation_steps`: the Accumulator divides once by the window's count itself,
  so every gradient ends `accumulation_steps` times too small (a smaller learning rate under SGD,
  a different clipping threshold, a different epsilon weight under Adam);
- `criterion = nn.CrossEntropyLoss(reduction="sum")` returned as a plain scalar: a plain scalar
  is read as a MEAN over the micro-batch's rows, so the sum is weighted by the rows again.

Both are read from the loss's autograd node (no device sync): a division by exactly the window's
number of micro-batches (on two micro-batches), and a torch loss whose saved reduction is "sum".

Example:
    >>> import torch
    >>> logits = torch.randn(4, 3, requires_grad=True)
    >>> loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 1]))
    >>> division_problem(loss / 4, micro_batches=4) is not None
    True
    >>> division_problem(loss, micro_batches=4), sum_problem(loss, items=4)
    (None, None)
"""

from __future__ import annotations

import torch

__all__ = ["CopiedLoopWarning", "division_problem", "sum_problem"]

_SUM = 2  # torch's Reduction::Sum, as a loss node saves it


class CopiedLoopWarning(UserWarning):
    """A loss carries a line of a hand-written accumulation loop that gradaccum does itself."""


def _divisor(node: object) -> float | None:
    """The number a `loss / k` node divides by, if it is a number (no device tensor read)."""
    if type(node).__name__ != "DivBackward0":
        return None
    other = getattr(node, "_saved_other", None)
    if isinstance(other, torch.Tensor) and other.dim() == 0 and other.device.type == "cpu":
        return float(other)
    return None


def division_problem(result: object, micro_batches: int) -> str | None:
    """What is wrong if `result` (a plain scalar, a `LossSum`'s value) divides by `micro_batches`.

    `micro_batches` is the window's number of micro-batches when known up front (else 0). A
    count from the data (`loss_sum / n_tokens`) may equal it once by chance: the caller warns
    only when it holds on two micro-batches.
    """
    value = result if isinstance(result, torch.Tensor) else getattr(result, "value", None)
    node = value.grad_fn if isinstance(value, torch.Tensor) else None
    if micro_batches < 2 or node is None or _divisor(node) != micro_batches:
        return None
    return (
        f"loss_fn divides its loss by {micro_batches}, the window's number of micro-batches "
        "(a hand-written loop's `loss = loss / accumulation_steps`): gradaccum divides once "
        "by the window's item count itself, so every gradient is "
        f"{micro_batches} times too small. Remove the division."
    )


def sum_problem(result: object, items: int) -> str | None:
    """What is wrong if `result` is a plain scalar of a torch loss with reduction='sum'.

    Over `items` > 1 rows only: one row's sum is that row's loss, a mean over one row.
    """
    node = result.grad_fn if isinstance(result, torch.Tensor) else None
    if items < 2 or getattr(node, "_saved_reduction", None) != _SUM:
        return None
    return (
        f"loss_fn returned a plain scalar computed with reduction='sum' "
        f"({type(node).__name__}) over a micro-batch of {items} rows; a plain scalar is read "
        f"as a MEAN over the rows and weighted by them, so the sum counts {items} times. "
        "Return gradaccum.LossSum(loss, count=number_of_items) (the items the sum covers), "
        "or use reduction='mean'."
    )
