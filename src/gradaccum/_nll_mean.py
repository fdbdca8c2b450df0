"""A plain-scalar `cross_entropy` / `nll_loss` mean over targets, not rows, read from its graph.

A scalar loss is read as a mean over the micro-batch's rows. `cross_entropy(...)` with the
default `reduction="mean"` divides by the targets it counts instead: those that are not its
`ignore_index` (255 for the pixels of no class in segmentation, whatever the user set), and,
with class weights (`weight=`), by the targets' summed weights. Either way the micro-batches'
denominators differ, and weighting each by rows is not the full-batch mean.

The batch alone cannot tell: 255 may be a class, and the weights are not in it. The loss's
autograd graph can: an `NllLossBackward0` / `NllLoss2DBackward0` node (under `cross_entropy`,
`nll_loss`, a `label_smoothing` sum, an auxiliary head's `ce + 0.4 * ce_aux`) saves the
reduction, the `ignore_index`, the weight and the target. Only the nodes near the loss are read,
before its backward frees them.

Example:
    >>> import torch
    >>> logits = torch.randn(2, 3, 4, 4, requires_grad=True)
    >>> target = torch.randint(0, 3, (2, 4, 4))
    >>> target[0, 0] = 255
    >>> loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=255)
    >>> "ignore_index=255" in nll_mean_problem(loss, (logits, target))
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from gradaccum._weighted_mean import through_factors

__all__ = ["ctc_without_nll", "nll_mean_problem", "unshifted_count_problem"]

_NLL_NODES = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
_MEAN, _SUM = 1, 2  # torch's Reduction::Mean and ::Sum, as the nodes save them
_NEAR = 48  # graph nodes read at most: the loss's own arithmetic, never the model's graph


def _nll_means(loss: torch.Tensor) -> Iterator[object]:
    """The mean-reduced NLL nodes near `loss`'s root (breadth first, not below them)."""
    queue, seen = [loss.grad_fn], 0
    while queue and seen < _NEAR:
        node = queue.pop(0)
        if node is None:
            continue
        seen += 1
        if node.name() in _NLL_NODES:
            if getattr(node, "_saved_reduction", None) == _MEAN:
                yield node
            continue  # below it is the model: its logits
        queue.extend(function for function, _ in node.next_functions)


def ctc_without_nll(loss: torch.Tensor) -> bool:
    """Whether `loss` is made of CTC losses and no NLL near its root (read as `_nll_means`).

    CTC targets padded with -100 (Hugging Face's `*ForCTC` labels) are no token mean: CTC's
    `"mean"` divides each row by its own target length, then averages the rows.
    """
    queue, seen, ctc = [loss.grad_fn], 0, False
    while queue and seen < _NEAR:
        node = queue.pop(0)
        if node is None:
            continue
        seen += 1
        name = node.name()
        if name in _NLL_NODES:
            return False
        if name.startswith("CtcLossBackward"):
            ctc = True
            continue  # below it is the model
        queue.extend(function for function, _ in node.next_functions)
    return ctc


def _where(micro_batch: object, target: torch.Tensor, ignore: int) -> str:
    """How the user indexes `target` in the micro-batch (`batch[1]`), or "the target".

    The target itself (a view of a batch entry: `y.flatten()`), else the entry holding
    `ignore` (a model's labels shifted into a copy: a Hugging Face causal LM).
    """
    if isinstance(micro_batch, Mapping):
        items = [(f"[{key!r}]", value) for key, value in micro_batch.items()]
    elif isinstance(micro_batch, (tuple, list)):
        items = [(f"[{index}]", value) for index, value in enumerate(micro_batch)]
    else:
        items = [("", micro_batch)]
    tensors = [(where, value) for where, value in items if isinstance(value, torch.Tensor)]
    for where, value in tensors:
        if value.numel() == target.numel() and value.data_ptr() == target.data_ptr():
            return f"batch{where}"
    for where, value in tensors:  # read only once it warns
        if value.dtype == target.dtype and bool((value == ignore).any()):
            return f"batch{where}"
    return "the target"


def _item_tensors(micro_batch: object, rows: int) -> Iterator[torch.Tensor]:
    """The tensors of one item each: a per-item list's elements, a record's values.

    A batch entry that is a list (or tuple) of `rows` tensors (segmentation masks of varied
    sizes: `(images, masks)`), or a micro-batch that is a list of `rows` dicts (examples,
    `[{"image": ..., "mask": ...}, ...]`). The top level of a tuple is the batch's layout
    (`(x, y)`), never its items.
    """
    entries: list[object] = []
    if isinstance(micro_batch, Mapping):
        entries = list(micro_batch.values())
    elif isinstance(micro_batch, (tuple, list)):
        entries = list(micro_batch)
        records = [entry for entry in entries if isinstance(entry, Mapping)]
        if len(records) == len(entries) == rows:
            for record in records:
                yield from (v for v in record.values() if isinstance(v, torch.Tensor))
            return
    for entry in entries:
        if isinstance(entry, (tuple, list)) and len(entry) == rows:
            yield from (item for item in entry if isinstance(item, torch.Tensor))


def _one_item(target: torch.Tensor, micro_batch: object, rows: int) -> bool:
    """Whether `target` is one item's targets, of a per-item list: a per-item mean, exact.

    A loss_fn given a list of masks computes each image's loss on its own mask (`t[None]`, a
    view of it, or a copy such as `t.long()`): the full batch runs the same code, so each
    NLL mean covers one item (a view of it also in a micro-batch of one image).
    """
    for item in _item_tensors(micro_batch, rows):
        if item.numel() != target.numel() or item.device != target.device:
            continue
        if item.data_ptr() == target.data_ptr():
            return True
        # A copy of one item's targets; of a micro-batch of one, it may be `torch.cat` of its
        # only mask: a pixel mean over the micro-batch, which is warned of.
        if rows > 1 and torch.equal(item.reshape(-1).to(target.dtype), target.reshape(-1)):
            return True
    return False


def _one_row(target: torch.Tensor, micro_batch: object, rows: int) -> bool:
    """Whether `target` is one row's targets of a batch entry: a per-row mean, read exactly."""
    if _one_item(target, micro_batch, rows):
        return True
    if rows < 2:
        return False  # one row's token mean, weighted by 1, is not the window's (warned)
    entries: list[object] = []
    if isinstance(micro_batch, Mapping):
        entries = list(micro_batch.values())
    elif isinstance(micro_batch, (tuple, list)):
        entries = list(micro_batch)
    return any(
        isinstance(value, torch.Tensor)
        and value.dtype == target.dtype  # the labels, not the inputs (3 rows of RGB images)
        and value.numel() == target.numel() * rows
        for value in entries
    )


def nll_mean_problem(loss: torch.Tensor, micro_batch: object, rows: int = 0) -> str | None:
    """Why a plain-scalar `loss` is a mean over targets (with its fix), or None.

    Reads the target (a device sync on an accelerator, as the -100 check's), so it is called
    for the first few micro-batches only.

    Args:
        loss: The scalar `loss_fn` returned, with its graph (before its backward).
        micro_batch: The micro-batch, to name where the target is.
        rows: The micro-batch's rows (0 if not known): a mean over one row's targets, taken
            per row and averaged (`torch.stack([ce(o[i], y[i]) ...]).mean()`), is a per-row
            loss and exact.

    Returns:
        A message naming the fix when the loss is a class-weighted mean, or a mean over
        targets that hold its `ignore_index`; None otherwise.
    """
    if loss.grad_fn is None:
        return None
    means = list(_nll_means(loss))
    for node in means:
        ignore = int(getattr(node, "_saved_ignore_index", -100))
        ignore = ignore - 2**64 if ignore >= 2**63 else ignore  # saved as an unsigned int64
        weight = getattr(node, "_saved_weight", None)
        target = getattr(node, "_saved_target", None)
        if not isinstance(target, torch.Tensor) or _one_row(target, micro_batch, rows):
            continue
        if isinstance(weight, torch.Tensor) and bool((weight != weight.flatten()[0]).any()):
            where = _where(micro_batch, target, ignore)
            return (
                "loss_fn returned a plain scalar, read as a mean over the micro-batch's rows, "
                "but it is a class-weighted cross_entropy/nll_loss mean (weight=), divided by "
                f"the summed weights of {where}'s classes: weighting it by rows is not the "
                "full-batch mean. Return gradaccum.LossSum.terms(ce=(F.cross_entropy(..., "
                f"weight=w, ignore_index={ignore}, reduction='sum'), "
                f"w[y[y != {ignore}]].sum())) instead (docs/losses.md)."
            )
        if bool((target == ignore).any()):
            where = _where(micro_batch, target, ignore)
            if len(means) > 1:
                return _several_means(len(means), where, ignore)
            return (
                "loss_fn returned a plain scalar, read as a mean over the micro-batch's rows, "
                f"but it is a cross_entropy/nll_loss mean over the targets that are not "
                f"ignore_index={ignore}, and {where} holds {ignore}: a mean over the counted "
                "targets (pixels, tokens) weighted by rows is not the full-batch mean. Return "
                f"gradaccum.LossSum(F.cross_entropy(..., ignore_index={ignore}, "
                f"reduction='sum'), count=(y != {ignore}).sum()) instead."
            )
    return None


def _several_means(means: int, where: str, ignore: int) -> str:
    """The fix for a loss combining several means over targets (a QA head's start and end)."""
    return (
        f"loss_fn returned a plain scalar, read as a mean over the micro-batch's rows, but it "
        f"combines {means} cross_entropy/nll_loss means, each over its own targets that are not "
        f"its ignore_index, and {where} holds {ignore}: means over the counted targets "
        "weighted by rows are not the full-batch means, and one LossSum of their summed "
        "values would divide them by one count. Return one term per mean, each with its own "
        "count and its factor in your loss: for extractive QA (start_positions, end_positions, "
        "clamped to n = start_logits.shape[1] and ignored there, as transformers does), "
        "LossSum.terms(start=Term(F.cross_entropy(start_logits, s, ignore_index=n, "
        "reduction='sum'), count=(s != n).sum(), weight=0.5), end=Term(...)) (Term from "
        "gradaccum.loss; docs/losses.md, Extractive question answering)."
    )


def unshifted_count_problem(result: object, rows: int) -> str | None:
    """Why a `LossSum` counts more items than its cross-entropy sum scored (with the fix), or None.

    A causal LM's loss scores the labels shifted by one (`labels[:, 1:]` against
    `logits[:, :-1]`), one fewer per row; its count taken before the shift,
    `(labels != -100).sum()`, counts up to one more per row (rows whose first label is not
    -100: pretraining, packed rows), silently another normalization. Told when the value is
    (past constant factors) a cross_entropy / nll_loss with reduction='sum' and its count
    exceeds the targets it scored by 1 to `rows`.
    """
    value, count = getattr(result, "value", None), getattr(result, "count", None)
    if rows < 1 or not isinstance(value, torch.Tensor) or value.grad_fn is None:
        return None
    node = through_factors(value.grad_fn)
    target = getattr(node, "_saved_target", None)
    if type(node).__name__ not in _NLL_NODES or getattr(node, "_saved_reduction", 0) != _SUM:
        return None
    if not isinstance(target, torch.Tensor) or getattr(node, "_saved_weight", None) is not None:
        return None
    if target.numel() <= rows:  # one target per row: a classifier, whose -100 rows are no shift
        return None
    scored = int((target != int(getattr(node, "_saved_ignore_index", -100))).sum())
    counted = int(count.item()) if isinstance(count, torch.Tensor) else count
    if not isinstance(counted, int) or not 0 < counted - scored <= rows:
        return None
    return (
        f"loss_fn returned LossSum(cross_entropy(..., reduction='sum'), count={counted}), but "
        f"that cross-entropy scored {scored} targets (not ignore_index): {counted - scored} "
        f"more over {rows} row{'s' if rows > 1 else ''}, at most one per row, as a causal LM's "
        "count taken before its "
        "labels were shifted ((labels != -100).sum(), not (labels[:, 1:] != -100).sum()). "
        "Count the targets the loss scores: the shifted labels that are not -100."
    )
