"""A loss that is a nonlinear function of sums or spreads over its micro-batch's rows.

Two everyday losses reduce over the batch's rows before a nonlinearity, so a micro-batch is
not a part of the batch's loss: a Dice or soft IoU (Tversky) over the batch, `1 - 2 I / (P + T)`
with `I`, `P` and `T` sums over the batch's rows (segmentation_models' `DiceLoss` sums over
dims (0, 2)); and a spread of the batch's outputs with gradient, VICReg's variance term
`relu(1 - z.std(dim=0))`, a batch standard deviation as a regularizer. Returned per
micro-batch, each is another objective than the full batch's (1.6e-2 and 4.3e-2 off an SGD
step on 4 micro-batches), silently: no division by a constant, no rows x rows matrix. Both are
read from the loss's graph near its top:

- a division whose numerator and denominator both carry gradient and each sums over the
  micro-batch's rows (`.sum()`, `.sum(0)`, `.sum((0, 2))`): a ratio of batch sums;
- a `var`/`std` over dimension 0 (or all) of a tensor with one row per item, with gradient.

A per-image Dice (`.sum(dim=(1, 2))`, then `.mean()`) and a `var(dim=1)` are per-row: quiet.

Example:
    >>> import torch
    >>> p = torch.rand(6, 4, requires_grad=True)
    >>> t = (torch.rand(6, 4) > 0.5).double()
    >>> dice = 1 - 2 * (p * t).sum() / (p.sum() + t.sum())
    >>> "ratio of sums" in batch_ratio_problem(dice, rows=6, micro_batches=2)
    True
    >>> batch_ratio_problem((1 - 2 * (p * t).sum(1) / (p.sum(1) + t.sum(1))).mean(), 6, 2) is None
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["batch_ratio_problem"]

_NODES = 48  # graph nodes searched from the loss: the ratio or spread is near its top
_BELOW = 8  # nodes searched below a division's operand for its sum over rows
_SPREADS = {"VarBackward0", "StdBackward0", "VarMeanBackward0", "StdMeanBackward0"}
_WRAP = 2**64


def _dims(node: Any, ndim: int) -> set[int] | None:
    """The dimensions `node` reduces (None: all of them)."""
    dims = getattr(node, "_saved_dim", None)
    if dims is None or dims == ():
        return None
    dims = (dims,) if isinstance(dims, int) else dims
    return {(d - _WRAP if d >= _WRAP // 2 else d) % max(ndim, 1) for d in dims}


def _sizes(node: Any) -> tuple[int, ...]:
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    if sizes is None:
        saved = getattr(node, "_saved_self", None)
        sizes = saved.shape if isinstance(saved, torch.Tensor) else ()
    return tuple(int(s) for s in sizes)


def _over_rows(node: Any, rows: int) -> bool:
    """Whether `node` reduces over the first dimension of a tensor with `rows` rows."""
    sizes = _sizes(node)
    if len(sizes) < 1 or sizes[0] != rows:
        return False
    dims = _dims(node, len(sizes)) if type(node).__name__ != "SumBackward0" else None
    return dims is None or 0 in dims


def _sums_rows(node: Any, rows: int) -> bool:
    """Whether a sum over the micro-batch's rows is among the few nodes below `node`."""
    queue, seen = [node], 0
    while queue and seen < _BELOW:
        current = queue.pop(0)
        if current is None:
            continue
        seen += 1
        if type(current).__name__ in ("SumBackward0", "SumBackward1") and _over_rows(current, rows):
            return True
        queue.extend(f for f, _ in getattr(current, "next_functions", ()))
    return False


def _nodes(loss: object) -> Iterator[Any]:
    terms = getattr(loss, "terms", None)
    values = (
        [getattr(t, "value", None) for t in terms.values()]
        if isinstance(terms, Mapping)
        else [loss if isinstance(loss, torch.Tensor) else getattr(loss, "value", None)]
    )
    queue = [v.grad_fn for v in values if isinstance(v, torch.Tensor) and v.grad_fn is not None]
    seen: set[int] = set()
    while queue and len(seen) < _NODES:
        node = queue.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        queue.extend(f for f, _ in getattr(node, "next_functions", ()))


def batch_ratio_problem(loss: object, rows: int, micro_batches: int) -> str | None:
    """Why `loss` is a nonlinear function of sums or spreads over its rows (with the fix).

    Args:
        loss: What `loss_fn` returned: a scalar, a `LossSum` or `LossSum.terms`, with graphs.
        rows: The micro-batch's rows (one row has no spread to take).
        micro_batches: The window's micro-batches when known (1: the whole batch, exact).
    """
    if micro_batches == 1 or rows < 2:
        return None
    for node in _nodes(loss):
        name = type(node).__name__
        if name in _SPREADS and _over_rows(node, rows):
            found = (
                f"a {'standard deviation' if 'Std' in name else 'variance'} over its {rows} "
                "rows (VICReg's variance term, relu(1 - z.std(dim=0)))"
            )
            recipe = "gradient caching (docs/losses.md, 'In-batch negatives: gradient caching')"
        elif name == "DivBackward0" and all(
            f is not None and _sums_rows(f, rows) for f, _ in node.next_functions[:2]
        ):
            found = f"a ratio of sums over its {rows} rows (a Dice or soft IoU over the batch)"
            recipe = (
                "the two-pass recipe (docs/losses.md, 'Segmentation losses over the batch'), "
                "or a Dice per image, .sum(dim=(1, 2)) then .mean()"
            )
        else:
            continue
        return (
            f"loss_fn's loss is a nonlinear function of {found}: each micro-batch is the "
            "loss's whole batch, so the window optimizes another objective than the full "
            f"batch's, and the step is not the full-batch step. Exact: {recipe}; or use one "
            "micro-batch per window (the largest micro_batch_size that fits)."
        )
    return None
