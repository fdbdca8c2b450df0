"""A loss that is a nonlinear function of a sum, spread or ranking over its micro-batch's rows.

A plain scalar is read as a mean over the micro-batch's rows, so a loss whose per-row terms
are combined linearly (`.mean()`, a masked or weighted sum over a constant) accumulates
exactly. Everyday losses that reduce over the batch's rows BEFORE a nonlinearity do not: a
micro-batch is not a part of the batch's loss, and the window optimizes another objective,
silently (no division by a constant, no rows x rows matrix for the other checks to see):

- a Dice or soft IoU over the batch, `1 - 2 I / (P + T)` with `I`, `P` and `T` sums over the
  rows (segmentation_models' `DiceLoss` sums over dims (0, 2)): 1.6e-2 off on 4 micro-batches;
- a spread of the batch with gradient, VICReg's variance term `relu(1 - z.std(dim=0))`: 4.3e-2;
- an RMSE, `torch.sqrt(F.mse_loss(pred, y))`, an entropy of the batch-mean prediction (info-max's
  diversity term), any `f(mean over rows)` with `f` not linear;
- a ranking of the rows' losses: OHEM's `losses.topk(k)` or `sort()`, a worst case `losses.max()`
  (0.13 and 0.56 off).

They are read from the loss's graph near its top: a reduction over the rows (dimension 0, or
all) of a tensor computed from the micro-batch, with a node that is not linear in it above
(a power, a square root, a logarithm, a product or quotient of two tensors with gradient), or a
`var`/`std` or a `topk`/`sort`/`max` over the rows. A Dice per image (`.sum(dim=(1, 2))`, then
`.mean()`), a `var(dim=1)`, a focal loss's per-row power under its `.mean()` are per-row: quiet.

Example:
    >>> import torch
    >>> p = torch.sigmoid(torch.nn.Linear(3, 4)(torch.randn(6, 3)))  # the model's output
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

from gradaccum._in_batch import IN_BATCH_RECIPE, _activation

__all__ = ["batch_ratio_problem"]

_NODES = 64  # graph nodes searched from the loss: the reduction is near its top
_CACHING = IN_BATCH_RECIPE.removeprefix("Exact: ")
_WRAP = 2**64
_SPREADS = {"VarBackward0", "StdBackward0", "VarMeanBackward0", "StdMeanBackward0"}
_RANKINGS = {  # on a row's values: the hardest rows kept, the worst one
    "TopkBackward0", "SortBackward0", "KthvalueBackward0", "MaxBackward1", "MinBackward1",
    "MedianBackward0", "MedianBackward1", "AmaxBackward0", "AminBackward0", "MaxBackward0",
    "MinBackward0",
}  # fmt: skip
_SUMS = {"SumBackward0", "SumBackward1", "MeanBackward0", "MeanBackward1"}
# Nodes linear in every input that carries gradient: a reduction below them is still a sum.
_LINEAR = {
    "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward1",
    "NegBackward0", "MulBackward1", "DivBackward1", "SumBackward0", "SumBackward1",
    "MeanBackward0", "MeanBackward1", "ViewBackward0", "UnsafeViewBackward0",
    "ReshapeAliasBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "UnsqueezeBackward0", "ExpandBackward0", "SelectBackward0", "SliceBackward0",
    "IndexBackward0", "IndexSelectBackward0", "GatherBackward0", "CatBackward0",
    "StackBackward0", "TBackward0", "PermuteBackward0", "TransposeBackward0", "CloneBackward0",
    "ToCopyBackward0", "MaskedFillBackward0", "WhereBackward0", "NllLossBackward0",
    "NllLoss2DBackward0", "DiagonalBackward0", "FlipBackward0", "RepeatBackward0",
    "SplitBackward0", "SplitWithSizesBackward0", "UnbindBackward0", "NansumBackward0",
    "MaskedSelectBackward0", "AliasBackward0", "AsStridedBackward0",
}  # fmt: skip
_MEAN, _SUM = 1, 2  # a torch loss's saved reduction


def _linear(node: Any) -> bool:
    name = type(node).__name__
    if name in _LINEAR:
        return True
    nexts = [f for f, _ in getattr(node, "next_functions", ())]
    if name == "MulBackward0":  # by a tensor without gradient, or of the parameters alone
        return len(nexts) < 2 or not all(map(_activation, nexts[:2]))  # (a learned weight)
    if name == "DivBackward0":  # by a constant, a count, a learned scale
        return len(nexts) < 2 or not _activation(nexts[1])
    return False


def _dims(node: Any, ndim: int) -> set[int] | None:
    """The dimensions `node` reduces (None: all of them)."""
    dims = getattr(node, "_saved_dim", None)
    if dims is None or dims == () or type(node).__name__ in ("SumBackward0", "MeanBackward0"):
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
    if not sizes or sizes[0] != rows:
        return False
    dims = _dims(node, len(sizes))
    return dims is None or 0 in dims


def _row_reduction(node: Any, rows: int) -> str | None:
    """What kind of reduction over the micro-batch's rows `node` is, or None."""
    name = type(node).__name__
    reduction = getattr(node, "_saved_reduction", None)
    if name in _SUMS or reduction in (_MEAN, _SUM):
        if reduction is None and not _over_rows(node, rows):
            return None
        if reduction is not None and _sizes(node)[:1] != (rows,):
            return None
        kind = "sum"
    elif name in _SPREADS and _over_rows(node, rows):
        kind = "spread"
    elif name in _RANKINGS and _over_rows(node, rows):
        if len(_sizes(node)) > 1 and _dims(node, len(_sizes(node))) is None:
            return None  # `logits.max()` over every value: a stable softmax's shift, not rows
        kind = "ranking"
    else:
        return None
    nexts = [f for f, _ in getattr(node, "next_functions", ())]
    return kind if nexts and _activation(nexts[0]) else None


def _roots(loss: object) -> list[Any]:
    terms = getattr(loss, "terms", None)
    values = (
        [getattr(t, "value", None) for t in terms.values()]
        if isinstance(terms, Mapping)
        else [loss if isinstance(loss, torch.Tensor) else getattr(loss, "value", None)]
    )
    return [v.grad_fn for v in values if isinstance(v, torch.Tensor) and v.grad_fn is not None]


def _found(loss: object, rows: int) -> Iterator[tuple[str, str, Any]]:
    """`(kind, the nonlinear node's name above, the node)` of each reduction over the rows."""
    queue: list[tuple[Any, str]] = [(root, "") for root in _roots(loss)]
    seen: set[tuple[int, bool]] = set()
    while queue and len(seen) < _NODES:
        node, above = queue.pop(0)
        if node is None or (id(node), bool(above)) in seen:
            continue
        seen.add((id(node), bool(above)))
        kind = _row_reduction(node, rows)
        if kind in ("spread", "ranking") or (kind == "sum" and above):
            yield kind, above, node
            return
        below = above or ("" if _linear(node) else type(node).__name__)
        queue.extend((f, below) for f, _ in getattr(node, "next_functions", ()))


def batch_ratio_problem(loss: object, rows: int, micro_batches: int) -> str | None:
    """Why `loss` is a nonlinear function of a reduction over its rows (with the fix), or None.

    Args:
        loss: What `loss_fn` returned: a scalar, a `LossSum` or `LossSum.terms`, with graphs.
        rows: The micro-batch's rows (one row has no spread to take).
        micro_batches: The window's micro-batches when known (1: the whole batch, exact).
    """
    if micro_batches == 1 or rows < 2:
        return None
    for kind, above, node in _found(loss, rows):
        fix = "Exact: " + _CACHING
        if kind == "spread":
            std = "Std" in type(node).__name__
            found = (
                f"a {'standard deviation' if std else 'variance'} over its {rows} rows "
                "(VICReg's variance term, relu(1 - z.std(dim=0)))"
            )
        elif kind == "ranking":
            found = (
                f"a ranking of its {rows} rows ({type(node).__name__}: OHEM's losses.topk(k) "
                "or sort(), a worst case losses.max()), which keeps other rows than the batch's"
            )
            fix = (
                "a ranking over the whole batch has no exact accumulation: rank within each "
                "row (an image's own pixels), or use one micro-batch per window (the largest "
                "micro_batch_size that fits)."
            )
        elif above == "DivBackward0":
            found = f"a ratio of sums over its {rows} rows (a Dice or soft IoU over the batch)"
            fix = (
                "Exact: the two-pass recipe (docs/losses.md, 'Segmentation losses over the "
                "batch'), or a Dice per image, .sum(dim=(1, 2)) then .mean()."
            )
        else:
            found = (
                f"a sum or mean over its {rows} rows ({type(node).__name__}) under {above} "
                "(an RMSE's sqrt(mse), an entropy of the batch-mean prediction)"
            )
            fix = (
                f"Exact: {_CACHING} For an RMSE, the MSE (a mean over the rows, exact as it "
                "is) has the same minimizer."
            )
        return (
            f"loss_fn's loss is a nonlinear function of {found}: each micro-batch is the "
            "loss's whole batch, so the window optimizes another objective than the full "
            f"batch's, and the step is not the full-batch step. {fix}"
        )
    return None
