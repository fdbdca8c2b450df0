"""Losses written for a hand-made accumulation loop, which gradaccum would read wrongly.

Two lines of the copied loops survive a port to `loss_fn` and are silently wrong there:

- `loss = loss / accumulation_steps`: the Accumulator divides once by the window's count itself,
  so every gradient ends `accumulation_steps` times too small (a smaller learning rate under SGD,
  a different clipping threshold, a different epsilon weight under Adam);
- `criterion = nn.CrossEntropyLoss(reduction="sum")` returned as a plain scalar (or a `.sum()`
  of `reduction="none"` losses, the per-sample weights' path): a plain scalar is read as a MEAN
  over the micro-batch's rows, so the sum is weighted by the rows again.

Both are read from the loss's autograd node (no device sync): a division by exactly the window's
number of micro-batches (on two micro-batches), and a torch loss whose saved reduction is "sum"
(in a batch with labels, also divided by 1, as transformers' `num_items_in_batch=1` returns it).

A third is the Hugging Face `Trainer`'s own accumulation: a model called with
`num_items_in_batch=n` returns its token sum divided by `n`, the WHOLE window's count. A plain
scalar `sum / n` whose `n` is more than the micro-batch's labels could count is that (or a
constant denominator): read as a mean over the rows, it is not the full-batch step (`k` times
too small on `k` equal micro-batches), and without -100 labels nothing else warns of it.

A fourth, `scaler.scale(loss)` of a plain fp16 loop's own `GradScaler`, is refused outright
(`scaler_problem`): gradaccum never unscales a scale it did not apply, so the step would be taken
on gradients `scale` times too large (fp16: scaled twice, every window overflows and is skipped).
It is told exactly, not guessed: the loss's last node multiplies by a tensor that a GradScaler
holds as its `_scale`.

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

import gc
from collections.abc import Mapping

import torch

from gradaccum._weighted_mean import (
    constant_factor,
    reciprocal_divisor,
    summed_values,
    through_factors,
)

__all__ = [
    "CopiedLoopWarning",
    "division_problem",
    "scaler_problem",
    "mean_problem",
    "sum_problem",
    "window_count_problem",
]

_MEAN, _SUM = 1, 2  # torch's Reduction::Mean and ::Sum, as a loss node saves them
_IGNORE_INDEX = -100  # an unscored label (cross_entropy's default, Hugging Face's)


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


def _sum_over(node: object, *, read_device: bool = False) -> float | None:
    """`n` if `node` divides a sum (`.sum()`, a loss with reduction='sum') by a constant `n`.

    A divisor on an accelerator is read (a device sync) only with `read_device`.
    """
    if type(node).__name__ != "DivBackward0":
        return None
    other = getattr(node, "_saved_other", None)
    if not isinstance(other, torch.Tensor) or other.dim() != 0 or other.requires_grad:
        return None
    if other.device.type != "cpu" and not read_device:
        return None
    numerator = through_factors(node.next_functions[0][0])  # type: ignore[attr-defined]
    summed = getattr(numerator, "_saved_reduction", None) == _SUM
    if not summed and type(numerator).__name__ != "SumBackward0":
        return None
    return float(other)


def _addends(node: object, limit: int = 256) -> int:
    """How many terms an addition chain adds (`sum(per_item_losses)`: 0 + l_0 + l_1 + ...)."""
    queue, count = [node], 0
    while queue and count <= limit:
        current = queue.pop()
        if type(current).__name__ == "AddBackward0":
            queue.extend(f for f, _ in current.next_functions if f is not None)  # type: ignore[attr-defined]
        else:
            count += 1
    return count


def _row_sum(node: object, items: int) -> bool:
    """Whether `node` divides a sum over the micro-batch's `items` rows by `items`: a row mean.

    The sum is a `.sum()` or a reduction='sum' loss, or Python's `sum()` of one loss per item
    (`sum(ce(model(x[None]), y[None]) for x, y in zip(images, masks)) / len(images)`: a list
    of images of varied sizes, looped over).
    """
    if _sum_over(node) == items:
        return True
    if _divisor(node) != items:
        return False
    numerator = through_factors(node.next_functions[0][0])  # type: ignore[attr-defined]
    return type(numerator).__name__ == "AddBackward0" and _addends(numerator) == items


def division_problem(result: object, micro_batches: int, items: int = 0) -> str | None:
    """What is wrong if `result` (a plain scalar, a `LossSum`'s value) divides by `micro_batches`.

    `micro_batches` is the window's number of micro-batches when known up front (else 0). A
    count from the data (`loss_sum / n_tokens`) may equal it by chance: the caller warns only
    when it holds on the first two micro-batches (and every one looked at since). A sum
    divided by the micro-batch's own `items` rows (`.sum() / len(x)`,
    `kl_div(reduction='batchmean')`) is the row mean gradaccum reads, whatever the number of
    micro-batches (16 rows split in 4 micro-batches of 4).
    """
    value = result if isinstance(result, torch.Tensor) else getattr(result, "value", None)
    node = through_factors(value.grad_fn) if isinstance(value, torch.Tensor) else None
    if micro_batches < 2 or node is None or _divisor(node) != micro_batches:
        return None
    if isinstance(result, torch.Tensor) and items == micro_batches and _row_sum(node, items):
        return None
    numerator = through_factors(node.next_functions[0][0])  # type: ignore[attr-defined]
    if type(numerator).__name__ == "AddBackward0" and _addends(numerator) == micro_batches:
        return None  # `(head_a + head_b + head_c) / 3`: a mean of as many losses
    return (
        f"loss_fn divides its loss by {micro_batches}, the window's number of micro-batches "
        "(a hand-written loop's `loss = loss / accumulation_steps`): gradaccum divides once "
        "by the window's item count itself, so every gradient is "
        f"{micro_batches} times too small. Remove the division."
    )


def sum_problem(result: object, items: int) -> str | None:
    """What is wrong if `result` is a plain scalar summed over its rows.

    A torch loss with reduction='sum', or a whole `.sum()` of a tensor with one row per item
    (`kl_div(reduction='sum')` is one), seen through constant factors: a distillation's `T * T`,
    a loss weight. Also a `.sum()` over a value per row however laid out (per-token losses
    flattened, the per-sample weights' `(w * losses).sum()`). Over `items` > 1 rows only: one
    row's sum is that row's loss, a mean over one row; a factor of `1 / items` makes it the row
    mean gradaccum reads.
    """
    node: object = result.grad_fn if isinstance(result, torch.Tensor) else None
    if reciprocal_divisor(node, max(items, 1)):  # `sum * (1 / n)`: a division, `_weighted_mean`
        return None
    for _ in range(4):  # `loss * T * T * weight`: a few constant factors at most
        factor = constant_factor(node)  # a negation too: `-log_p.sum()`
        if factor is None or abs(abs(factor[0]) * items - 1) < 1e-9:
            break
        node = factor[1]
    return _sum_message(node, items) or _per_row_sum_message(node, items)


def _per_row_sum_message(node: object, items: int) -> str | None:
    if items < 2 or type(node).__name__ != "SumBackward0":
        return None
    summed = summed_values(node)
    if summed < items or summed % items:  # not a value per row: a sum of a few heads' losses
        return None
    if _reduced_rows(node.next_functions[0][0]):  # type: ignore[attr-defined]
        return None  # means over the rows, summed: outputs that happen to number the rows
    return _per_row_sum_text(items)


def _per_row_sum_text(items: int) -> str:
    return (
        f"loss_fn returned a plain scalar that is a .sum() over the micro-batch's {items} rows "
        "(SumBackward0, e.g. of reduction='none' losses); a plain scalar is read as a MEAN "
        f"over the rows and weighted by them, so the sum counts {items} times. Return "
        "gradaccum.LossSum(loss, count=number_of_items) (the items the sum covers), or .mean(); "
        "for per-sample weights, LossSum.terms(loss=((w * losses).sum(), w.sum()))."
    )


def _summed_rows(node: object, items: int) -> bool:
    """Whether `node` is a torch loss with reduction='sum' or a `.sum()` over `items` rows."""
    if getattr(node, "_saved_reduction", None) == _SUM:
        return True
    sizes: tuple[int, ...] = getattr(node, "_saved_self_sym_sizes", ())  # SumBackward0: all
    if type(node).__name__ != "SumBackward0" or sizes[:1] != (items,):
        return False
    return not _reduced_rows(node.next_functions[0][0])  # type: ignore[attr-defined]


def _reduced_rows(node: object) -> bool:
    """Whether `node` reduced its input's first dimension (`.mean(0)`, `.amax(0)`).

    The rows are then gone, so a leading dimension equal to the micro-batch's rows is a
    coincidence (8 outputs' means over 8 rows).
    """
    dims = getattr(node, "_saved_dim", None)
    if dims is None:
        return False
    saved = getattr(node, "_saved_self", None)
    sizes = getattr(node, "_saved_self_sym_sizes", None) or getattr(saved, "shape", ())
    if not sizes:
        return True  # unknown: do not warn
    dims = (dims,) if isinstance(dims, int) else dims
    return any((d - 2**64 if d >= 2**63 else d) % len(sizes) == 0 for d in dims)


def _sum_message(node: object, items: int) -> str | None:
    if items < 2 or not _summed_rows(node, items):
        return None
    if type(node).__name__ == "SumBackward0":
        return _per_row_sum_text(items)
    return (
        f"loss_fn returned a plain scalar computed with reduction='sum' or .sum() "
        f"({type(node).__name__}) over a micro-batch of {items} rows; a plain scalar is read "
        f"as a MEAN over the rows and weighted by them, so the sum counts {items} times. "
        "Return gradaccum.LossSum(loss, count=number_of_items) (the items the sum covers), "
        "or use reduction='mean'."
    )


def mean_problem(result: object) -> str | None:
    """What is wrong if `result` is a `LossSum` (or a term of one) whose value is a mean.

    A torch loss with reduction='mean' or a `.mean()` (a Hugging Face model's `outputs.loss`
    without `num_items_in_batch`) given as `LossSum.value`, a sum, with a count above 1: the
    window divides the micro-batches' means by their total count, not the full-batch mean. The
    count is read (a device sync) only for such a value.
    """
    terms = getattr(result, "terms", None)
    if isinstance(terms, Mapping):  # LossSum.terms (a constant denominator has no count)
        parts = [(f"LossSum.terms({k}=...)", t.value, t.count) for k, t in terms.items()]
    else:
        value, count = getattr(result, "value", None), getattr(result, "count", None)
        parts = [("LossSum(value, count)", value, count)]
    for where, value, count in parts:
        grad_fn = value.grad_fn if isinstance(value, torch.Tensor) else None
        node = through_factors(grad_fn, signs_only=True)  # `-log_p.mean()`; not `mean * count`
        mean = getattr(node, "_saved_reduction", None) == _MEAN
        divided = None if mean or count is None else _sum_over(node, read_device=True)
        if not (mean or divided or type(node).__name__ == "MeanBackward0") or count is None:
            continue
        items = float(count)
        if items <= 1 or (divided is not None and not (divided.is_integer() and divided >= items)):
            continue  # `sum / 2` (a convention's scaling) is no mean over the counted items
        if divided is not None:
            return (
                f"loss_fn returned {where} whose value is a SUM divided by {divided:g} (a "
                "model called with num_items_in_batch=n, or sum / count) with a count of "
                f"{items:g}: the window divides by its count again, so every micro-batch is "
                "divided twice, silently. Give the sum itself: num_items_in_batch=1 for a Hugging "
                "Face model's outputs.loss, or drop the division (or use a gradaccum.hf loss)."
            )
        return (
            f"loss_fn returned {where} whose value is a MEAN ({type(node).__name__}) with a "
            f"count of {items:g}, but the value is the SUM of the losses the count covers: the "
            "window divides the micro-batches' means by their total count, which is not the "
            "full-batch mean. Sum the losses (reduction='sum', or mean * count); for a Hugging "
            "Face model's outputs.loss, call it with num_items_in_batch=1, or use a "
            "gradaccum.hf loss (hf.causal_lm, ...)."
        )
    return _mean_counted_once(parts) if isinstance(terms, Mapping) else None


def _mean_counted_once(parts: list[tuple[str, object, object]]) -> str | None:
    """A term that is a mean over as many values as another term counts, itself counted once.

    A z-loss beside the token loss, `z=Term(1e-4 * (lse[scored] ** 2).mean(), count=1)`: per
    micro-batch a mean over its tokens, so the window's term is a mean of the micro-batches'
    means, not the full-batch mean over tokens (2.7e-3 off on a tiny GPT-2, silently). A term
    of the weights alone counted once (AdaLoRA's orthogonality) averages no tokens: not told.
    """
    means = []  # (where, values averaged) of the terms that are a mean: no device sync yet
    for where, value, count in parts:
        node = through_factors(value.grad_fn if isinstance(value, torch.Tensor) else None)
        if type(node).__name__ == "MeanBackward0" and count is not None:
            means.append((where, count, int(getattr(node, "_saved_self_sym_numel", 0))))
    for where, count, averaged in means:
        if averaged < 2 or float(count) != 1:  # type: ignore[arg-type]
            continue
        for other, _, counts in parts:
            if other == where or counts is None or float(counts) != averaged:  # type: ignore[arg-type]
                continue
            return (
                f"loss_fn returned {where} whose value is a MEAN over {averaged:g} values with a "
                f"count of 1, as many values as {other} counts: the window would average the "
                "micro-batches' means, not the values, which is not the full-batch mean when "
                "micro-batches hold different numbers of them. Return their SUM with their "
                "number as the count, e.g. Term((lse[scored] ** 2).sum(), count=scored.sum(), "
                "weight=1e-4) for a z-loss (docs/losses.md)."
            )
    return None


def window_count_problem(result: object, labels: torch.Tensor | None, items: int) -> str | None:
    """What is wrong if the plain scalar `result` divides a sum by more than `labels` can count.

    `labels` are the micro-batch's integer targets (None: nothing to compare with). Reading their
    count, and a divisor on an accelerator, syncs the device: only for a `sum / n` scalar.
    """
    node = through_factors(result.grad_fn) if isinstance(result, torch.Tensor) else None
    divisor = _sum_over(node, read_device=True) if labels is not None else None
    if divisor is None or labels is None:
        return None
    scored = int((labels != _IGNORE_INDEX).sum())
    if divisor == 1.0 and scored > 1:  # `num_items_in_batch=1`: the sum itself, not a mean
        return _sum_message(through_factors(node.next_functions[0][0]), items)  # type: ignore[attr-defined]
    if divisor <= scored:
        return None
    return (
        f"loss_fn returned a plain scalar that divides a summed loss by {divisor:g}, more items "
        f"than the micro-batch's labels can count ({scored}): a count of the whole window (the "
        "model called with num_items_in_batch, as transformers' Trainer calls it) or a constant."
        f" A plain scalar is read as a mean over the micro-batch's {items} rows and weighted by "
        "them, so the step is not the full-batch one. gradaccum divides by the window's count "
        "itself: use a gradaccum.hf loss (hf.causal_lm, ...), or return gradaccum.LossSum("
        "model(**batch, num_items_in_batch=1).loss, count=(batch['labels'][..., 1:] != -100)"
        ".sum()); "
        "for a constant denominator C, LossSum.terms(loss=Term(summed, denominator=C))."
    )


def _scale_factor(value: object) -> torch.Tensor | None:
    """The tensor `value` was last multiplied by, if a GradScaler holds it as its loss scale.

    `GradScaler.scale(loss)` is `loss * scaler._scale`: the node saves that very tensor. Whose it
    is, is asked of the garbage collector (host only, no device sync), and only for a 0-dim or
    one-element float32 factor that needs no grad, which a loss weight rarely is.
    """
    node = value.grad_fn if isinstance(value, torch.Tensor) else None
    if type(node).__name__ != "MulBackward0":
        return None
    factor = getattr(node, "_saved_other", None)
    if (
        not isinstance(factor, torch.Tensor)
        or factor.dtype != torch.float32
        or factor.numel() != 1
        or factor.requires_grad
    ):
        return None
    for owner in gc.get_referrers(factor):
        held = owner if isinstance(owner, dict) else getattr(owner, "__dict__", None)
        if isinstance(held, dict) and held.get("_scale") is factor and "_growth_tracker" in held:
            return factor
    return None


def scaler_problem(result: object) -> str | None:
    """What is wrong if `result` holds a loss multiplied by a `GradScaler`'s scale.

    That is `scaler.scale(loss)` returned from `loss_fn`: as a plain scalar, a `LossSum`'s value
    or a `LossSum.terms` term.
    """
    terms = getattr(result, "terms", None)
    if isinstance(terms, Mapping):
        values = [getattr(term, "value", None) for term in terms.values()]
    else:
        values = [result if isinstance(result, torch.Tensor) else getattr(result, "value", None)]
    factor = next((f for f in map(_scale_factor, values) if f is not None), None)
    if factor is None:
        return None
    scale = float(factor)
    return (
        f"loss_fn returned a loss multiplied by a GradScaler's loss scale ({scale:g}: "
        "`scaler.scale(loss)`, a hand-written fp16 loop's line). gradaccum never unscales a "
        f"scale it did not apply, so every gradient would be {scale:g} times too large (under "
        "precision='fp16', scaled twice, the windows overflow and are skipped). Return the loss "
        "itself: precision='fp16' keeps its own loss scale in acc.scaler (carry a loop's scaler "
        "over with acc.scaler.load_state_dict(scaler.state_dict())); call no scaler.scale(), "
        "scaler.step() or scaler.update() of your own."
    )
