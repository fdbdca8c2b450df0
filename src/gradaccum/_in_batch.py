"""A loss that compares the rows of its micro-batch with each other: in-batch negatives.

InfoNCE, CLIP's symmetric loss, SimCLR's NT-Xent and a batch-hard triplet loss score each item
against the other items of its batch (a rows x rows similarity or distance matrix), and Barlow
Twins and VICReg take a cross-correlation over the batch's rows. Given to `loss_fn` as they
are, each micro-batch is the loss's whole batch: fewer negatives, other statistics, another
objective than the full batch's, silently. They are read from the loss's graph near its top: a
matrix product of two tensors computed from the micro-batch (not parameters) whose result is
indexed by its rows on both sides (`za @ zb.T`, `torch.cdist(z, z)`, `einsum("id,jd->ij")`), or
which sums over its rows (`z1.T @ z2`), or the rows broadcast against each other (`z[:, None]` with
`z[None]`, into a rows x rows x ... tensor). The exact recipe is gradient caching (docs/losses.md,
"In-batch negatives").

Example:
    >>> import torch
    >>> enc = torch.nn.Linear(4, 3)
    >>> za, zb = enc(torch.randn(5, 4)), enc(torch.randn(5, 4))
    >>> loss = torch.nn.functional.cross_entropy(za @ zb.T, torch.arange(5))
    >>> "in-batch negatives" in in_batch_problem(loss, rows=5, micro_batches=2)
    True
    >>> in_batch_problem(enc(torch.randn(5, 4)).sum(), rows=5, micro_batches=2) is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["IN_BATCH_RECIPE", "in_batch_problem"]

IN_BATCH_RECIPE = (
    "Exact: gradient caching (docs/losses.md, 'In-batch negatives'): embed the whole batch "
    "once under torch.no_grad(), take the loss's gradient per embedding (and per parameter of "
    "the loss itself, such as a learnable temperature) with torch.autograd.grad, put them in "
    "the batch, and let loss_fn return each micro-batch's embeddings dotted with their cached "
    "gradients; or use one micro-batch per window (the largest micro_batch_size that fits)."
)
_NODES = 96  # graph nodes searched from the loss: the pairwise scores are near its top
_OPERAND_NODES = 16  # nodes searched below an operand to tell parameters from activations
# Nodes that apply a layer to data: below them an operand is an activation, not a parameter.
_ON_DATA = {"EmbeddingBackward0", "EmbeddingBagBackward0", "ConvolutionBackward0"}
_MATMULS = {"MmBackward0", "AddmmBackward0", "BmmBackward0", "ConvolutionBackward0"}
_TRANSPOSES = {"TBackward0", "TransposeBackward0", "PermuteBackward0"}


def _activation(node: Any) -> bool:
    """Whether `node` computes a tensor from the micro-batch, not from parameters alone.

    A tensor that requires no grad (a queue of negatives, a constant) is neither: its node is
    None. Parameters and what is computed from them alone (a transposed or normalized weight)
    end in a few nodes at `AccumulateGrad` leaves; an activation reaches a layer applied to the
    data (a matrix product with an input that requires no grad, an embedding lookup), or a
    graph deeper than the search.
    """
    if node is None or type(node).__name__ == "AccumulateGrad":
        return False
    queue, seen = [node], 0
    while queue:
        current = queue.pop(0)
        seen += 1
        if seen > _OPERAND_NODES:
            return True
        name = type(current).__name__
        nexts = [f for f, _ in getattr(current, "next_functions", ())]
        if name in _ON_DATA or (name in _MATMULS and any(f is None for f in nexts)):
            return True
        queue.extend(f for f in nexts if f is not None)
    return False


def _rows_both_sides(first: int, second: int, rows: int) -> bool:
    return first >= rows and second >= rows and first % rows == 0 and second % rows == 0


def _mixes_rows(node: Any, rows: int) -> str | None:
    """What of the micro-batch's rows `node` compares with each other, or None."""
    name = type(node).__name__
    nexts = [f for f, _ in getattr(node, "next_functions", ())]
    if name in {"CdistBackward0", "EuclideanDistBackward0"} and len(nexts) >= 2:
        x1, x2 = getattr(node, "_saved_x1", None), getattr(node, "_saved_x2", None)
        if x1 is None or x2 is None or x1.dim() != 2 or x2.dim() != 2:
            return None
        if _rows_both_sides(x1.shape[0], x2.shape[0], rows) and all(map(_activation, nexts[:2])):
            return f"a ({x1.shape[0]} x {x2.shape[0]}) distance matrix between its rows"
        return None
    if name not in {"MmBackward0", "BmmBackward0"} or len(nexts) < 2:
        return None
    first, second = _sizes(node, "self"), _sizes(node, "mat2")
    if name == "BmmBackward0":  # einsum("id,jd->ij") runs a batch of one
        if first[:1] != (1,) or second[:1] != (1,):
            return None
        first, second = first[1:], second[1:]
    if len(first) != 2 or len(second) != 2 or not all(map(_activation, nexts[:2])):
        return None
    (p, k), q = first, second[1]
    if k >= rows and k % rows == 0 and type(nexts[0]).__name__ in _TRANSPOSES:
        return f"a ({p} x {q}) cross-correlation summed over its rows"
    if _rows_both_sides(p, q, rows):
        return f"a ({p} x {q}) similarity matrix between its rows"
    return None


def _sizes(node: Any, operand: str) -> tuple[int, ...]:
    """The sizes of a matrix product's operand (`self` or `mat2`), as saved for its backward."""
    sizes = getattr(node, f"_saved_{operand}_sym_sizes", None)
    if sizes is None:  # bmm saves the tensors themselves
        try:
            sizes = getattr(node, f"_saved_{operand}").shape
        except (AttributeError, RuntimeError):  # not saved, or freed by a backward
            return ()
    return tuple(int(size) for size in sizes)


def _row_index(node: Any, rows: int) -> torch.Tensor | None:
    """The row indices `node` picks from a tensor with `rows` rows (`z[idx]`), or None."""
    name = type(node).__name__
    if name == "IndexBackward0":
        indices = getattr(node, "_saved_indices", None) or (None,)
        index = indices[0]
    elif name == "IndexSelectBackward0" and getattr(node, "_saved_dim", None) == 0:
        index = getattr(node, "_saved_index", None)
    else:
        return None
    sizes: tuple[int, ...] = tuple(getattr(node, "_saved_self_sym_sizes", ()))
    if (
        not isinstance(index, torch.Tensor)
        or index.dim() != 1
        or index.dtype in (torch.bool, torch.uint8)
        or sizes[:1] != (rows,)
        or index.numel() % rows  # a subset of the rows (`out[kept]`) is scored row by row
    ):
        return None
    return index


def _gathered_rows(node: Any, rows: int, gathered: dict[Any, str], direct: set[Any]) -> str | None:
    """Whether `node`'s inputs are an activation picked by other rows' indices and used as is.

    Triplets mined under `torch.no_grad()` then gathered (`triplet_margin_loss(z, z[pos],
    z[neg])`) compare each row with others; a permutation alone (a packed RNN's unsorting) or
    a selection in order (`out[idx]`, `logp[arange(n), y]`) does not.
    """
    index = _row_index(node, rows)
    for child, _ in getattr(node, "next_functions", ())[: 1 if index is not None else None]:
        if child is None or type(child).__name__ == "AccumulateGrad":
            continue
        if index is not None:
            positions = torch.arange(index.numel(), device=index.device) % rows
            if not bool((index.to(positions.dtype) == positions).all()):
                gathered[child] = f"rows picked by index, z[{index[:4].tolist()}...]"
        else:
            direct.add(child)
        if child in gathered and child in direct and _activation(child):
            return f"{gathered[child]} of an output it also uses row by row (mined triplets)"
    return None


def in_batch_problem(loss: object, rows: int, micro_batches: int) -> str | None:
    """Why `loss` is not additive over the micro-batch's rows (with the fix), or None.

    Args:
        loss: What `loss_fn` returned: a scalar, a `LossSum` or `LossSum.terms`, with graphs.
        rows: The micro-batch's rows (a micro-batch of one compares nothing).
        micro_batches: The window's micro-batches when known (1: the micro-batch is the whole
            batch, which is exact; 0: not known up front).
    """
    if micro_batches == 1 or rows < 2:
        return None
    terms = getattr(loss, "terms", None)  # `LossSum.terms`: each term's value
    values = (
        [getattr(t, "value", None) for t in terms.values()]
        if isinstance(terms, Mapping)
        else [loss]
    )
    values = [v if isinstance(v, torch.Tensor) else getattr(v, "value", None) for v in values]
    roots = [v.grad_fn for v in values if isinstance(v, torch.Tensor) and v.grad_fn is not None]
    queue, seen, visited = roots, 0, set()
    unsqueezed: set[int] = set()  # z[:, None] and z[None] of activations: broadcast pairs
    pairwise: tuple[int, ...] = ()  # a (rows x rows x ...) tensor saved for the backward
    gathered: dict[Any, str] = {}  # activations picked by row indices: `z[neg_idx]`
    direct: set[Any] = set()  # activations the loss also uses as they are: the anchors
    while queue and seen < _NODES:
        node = queue.pop(0)
        if node is None or node in visited:
            continue
        visited.add(node)
        seen += 1
        found = _mixes_rows(node, rows)
        if type(node).__name__ == "UnsqueezeBackward0" and _activation(node.next_functions[0][0]):
            unsqueezed.add(int(getattr(node, "_saved_dim", -1)))
        sizes = _sizes(node, "self")
        if not pairwise and len(sizes) >= 3 and _rows_both_sides(sizes[0], sizes[1], rows):
            pairwise = sizes
        if found is None and pairwise and {0, 1} <= unsqueezed:
            found = f"a ({pairwise[0]} x {pairwise[1]}) comparison of its rows by broadcasting"
        if found is None:
            found = _gathered_rows(node, rows, gathered, direct)
        if found is not None:
            return (
                f"loss_fn's loss compares the rows of its micro-batch with each other ({found}: "
                "in-batch negatives as in InfoNCE, CLIP, SimCLR or triplet mining, or batch "
                "statistics as in Barlow Twins and VICReg): each micro-batch of "
                f"{rows} rows is the loss's whole batch, so the window optimizes another "
                "objective than the full batch's (fewer negatives), and the step is not the "
                "full-batch step. " + IN_BATCH_RECIPE
            )
        queue.extend(f for f, _ in getattr(node, "next_functions", ()))
    return None
