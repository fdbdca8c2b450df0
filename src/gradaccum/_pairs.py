"""A loss that pairs the rows of its micro-batch (chosen and rejected), cut by the split.

Preference losses (DPO, IPO, a reward model's pairwise loss) compare two completions of one
prompt. Laid out as rows of the batch, interleaved (`r[0::2]` chosen, `r[1::2]` rejected) or as
halves (all chosen rows, then all rejected: `r[:n // 2]`, `r[n // 2:]`, `r.chunk(2)`), a pair
is only whole if the split keeps it in one micro-batch: an odd micro-batch cuts an interleaved
pair (its halves broadcast against each other, silently, or fail on their sizes), and any split
of a halves batch compares chosen rows with other chosen rows. Both are read from the loss's
graph near its top: a slice of a tensor of the micro-batch's rows along its first dimension.
Slices under a concatenation along the rows are pieces put back together, not pairs: a packed
RNN (`pack_padded_sequence`) cuts its hidden state as its shorter sequences end.

Example:
    >>> import torch
    >>> scores = torch.rand(3, requires_grad=True)
    >>> loss = -torch.nn.functional.logsigmoid(scores[0::2] - scores[1::2]).mean()
    >>> "odd" in split_pairs_problem(loss, rows=3, micro_batches=2)
    True
"""

from __future__ import annotations

import re

import torch

__all__ = ["PAIR_RECIPE", "split_pairs_note", "split_pairs_problem"]

PAIR_RECIPE = (
    "Keep each pair in one row: the chosen and the rejected completions under their own keys "
    "(batch['chosen_ids'], batch['rejected_ids'], the reference log-probs likewise), so a "
    "micro-batch holds whole pairs whatever its size, and return LossSum(loss.sum(), pairs) "
    "or the mean over pairs (docs/losses.md, 'Preference pairs')."
)
_NODES = 64  # graph nodes searched from the loss: the pairing is near its top
_SIZES = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)")


def _slices(loss: torch.Tensor, rows: int) -> list[tuple[str, int, int, int]]:
    """`(kind, start, end, step)` of first-dimension slices of a tensor of `rows` rows."""
    found: list[tuple[str, int, int, int]] = []
    queue, seen = [loss.grad_fn], 0
    while queue and seen < _NODES:
        node = queue.pop(0)
        seen += 1
        if node is None:
            continue
        name = type(node).__name__
        if name == "CatBackward0" and getattr(node, "_saved_dim", None) == 0:
            continue  # rows put back together: below, pieces (a packed RNN's shrinking hidden)
        sizes = tuple(getattr(node, "_saved_self_sym_sizes", None) or ())
        first = getattr(node, "_saved_dim", 1) == 0 and sizes[:1] == (rows,)
        if name == "SplitBackward0" and first:
            found.append(("split", 0, int(node._saved_split_size), 1))  # type: ignore[attr-defined]
        elif name == "SliceBackward0" and first:
            start, end = int(node._saved_start), int(node._saved_end)  # type: ignore[attr-defined]
            found.append(("slice", start, end, int(node._saved_step)))  # type: ignore[attr-defined]
        queue.extend(f for f, _ in getattr(node, "next_functions", ()))
    return found


def split_pairs_problem(loss: object, rows: int, micro_batches: int) -> str | None:
    """Why `loss` compares rows a split cut apart (with the fix), or None.

    Args:
        loss: The scalar (or a `LossSum`'s value) `loss_fn` returned, with its graph.
        rows: The micro-batch's rows.
        micro_batches: The window's micro-batches when `step()` split a batch (else 0: a
            streamed micro-batch is the caller's, laid out as the caller means).
    """
    value = loss if isinstance(loss, torch.Tensor) else getattr(loss, "value", None)
    if not isinstance(value, torch.Tensor) or value.grad_fn is None or rows < 2:
        return None
    slices = _slices(value, rows)
    if rows % 2 and any(kind == "slice" and step == 2 for kind, _, _, step in slices):
        return (
            f"loss_fn pairs the rows of its micro-batch interleaved (rows 0::2 with rows 1::2: "
            f"chosen and rejected completions), and this micro-batch holds an odd number of "
            f"rows ({rows}): a pair is cut between two micro-batches, and the halves broadcast "
            "against each other, so the step is not the full-batch one. " + PAIR_RECIPE
        )
    half = (rows + 1) // 2
    halves = {start for kind, start, _, step in slices if kind == "slice" and step == 1}
    ends = {end for kind, _, end, step in slices if kind == "slice" and step == 1}
    split = any(kind == "split" and end == half for kind, _, end, _ in slices)
    if micro_batches > 1 and (split or (rows // 2 in halves and rows // 2 in ends)):
        return (
            f"loss_fn compares the first half of its micro-batch's {rows} rows with the second "
            "(chosen rows, then rejected rows: `r[:n // 2]`, `r[n // 2:]` or `r.chunk(2)`), but "
            f"step() cut the batch into {micro_batches} micro-batches of consecutive rows: a "
            "micro-batch's halves are not the batch's halves, and chosen rows are compared "
            "with other chosen rows. " + PAIR_RECIPE
        )
    return None


def split_pairs_note(error: BaseException, micro_batch_rows: int) -> list[str]:
    """A note for a size mismatch of two parts adding up to an odd micro-batch's rows."""
    found = _SIZES.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None or micro_batch_rows % 2 == 0:
        return []
    a, b = int(found[1]), int(found[2])
    if a + b != micro_batch_rows or abs(a - b) != 1:
        return []
    return [
        f"two parts of {a} and {b} rows of a micro-batch of {micro_batch_rows} (an odd number): "
        "if loss_fn pairs its rows (chosen and rejected completions interleaved or in halves), "
        "the split cut a pair. " + PAIR_RECIPE
    ]
