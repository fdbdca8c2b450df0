"""A plain-scalar loss that divides a per-item sum by something other than the rows.

A scalar loss is read as a mean over the micro-batch's rows. The everyday per-sample weighted
mean, `(w * F.cross_entropy(..., reduction="none")).sum() / w.sum()`, divides by the summed
weights instead, and so does a masked mean (`(m * loss).sum() / m.sum()`) by its kept items:
each micro-batch's denominator differs, and weighting each quotient by rows is not the
full-batch mean. Nothing in the batch says so (the weights may not even be in it); the loss's
last autograd node does: a `DivBackward0` whose numerator sums a tensor with a value per row
(`.sum()`, or a loss with reduction='sum') and whose divisor, a constant tensor, is not a whole
multiple of the rows (`sum / len(x)`, `sum / (rows * tokens)` and `kl_div(reduction=
"batchmean")` are row means, read exactly).

A mean of values picked by a mask (`F.mse_loss(pred[mask], y[mask])`) divides by the kept
values likewise: `masked_mean_problem` tells it when their number is not a whole multiple of the
rows. Both read through constant factors and negations (`-(w * log_p).sum() / w.sum()`).

Reading the divisor syncs an accelerator, so the caller looks only at the first few
micro-batches, as it does for the -100 labels.

Example:
    >>> import torch
    >>> losses = torch.rand(4, requires_grad=True)
    >>> weights = torch.tensor([0.5, 1.0, 2.0, 0.25])
    >>> "weighted" in divided_sum_problem((weights * losses).sum() / weights.sum(), rows=4)
    True
    >>> divided_sum_problem(losses.sum() / 4, rows=4) is None
    True
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "constant_factor",
    "divided_sum_problem",
    "masked_mean_problem",
    "masked_means_per_row",
    "per_row_change_problem",
    "reciprocal_divisor",
    "summed_values",
    "through_factors",
]

_MEAN, _SUM = 1, 2  # torch's Reduction::Mean and ::Sum, as a loss node saves them


def constant_factor(node: object, *, any_device: bool = False) -> tuple[float, object] | None:
    """`(c, inner)` if `node` multiplies `inner` by a number `c` on the CPU (no device read).

    A negation is a factor of -1: hand-written log-likelihoods are negated sums
    (`-(w * log_p).sum() / w.sum()`, BPR's `-F.logsigmoid(diff).sum()`), and a detector that
    stopped at the `NegBackward0` node missed them, silently. With `any_device`, a factor on
    an accelerator is read too (a device sync: `sum * (1 / mask.sum())` is a division).
    """
    name = type(node).__name__
    if name == "NegBackward0":
        return -1.0, node.next_functions[0][0]  # type: ignore[attr-defined]
    if name != "MulBackward0":
        return None
    (first, _), (second, _) = node.next_functions  # type: ignore[attr-defined]
    if (first is None) == (second is None):  # two graphs, or two constants
        return None
    constant = getattr(node, "_saved_self" if first is None else "_saved_other", None)
    if not isinstance(constant, torch.Tensor) or constant.dim() or constant.is_complex():
        return None
    if constant.device.type != "cpu" and not any_device:
        return None
    return float(constant), second if first is None else first


def through_factors(node: object, limit: int = 4, *, signs_only: bool = False) -> object:
    """`node` past up to `limit` constant factors and negations (`-0.5 * loss`).

    With `signs_only`, past negations only: `LossSum(mean * count, count)` is a sum.
    """
    for _ in range(limit):
        factor = constant_factor(node)
        if factor is None or (signs_only and factor[0] != -1.0):
            break
        node = factor[1]
    return node


def summed_values(node: object) -> int:
    """How many values the numerator node sums (0 if it is not a sum)."""
    if type(node).__name__ == "SumBackward0":  # `.sum()` of the whole tensor
        sizes = getattr(node, "_saved_self_sym_sizes", None)
        return math.prod(int(s) for s in sizes) if sizes is not None else 0
    if type(node).__name__ == "NansumBackward0" and not getattr(node, "_saved_dim", None):
        saved = getattr(node, "_saved_self", None)  # `nanmean()`: nansum / the values not NaN
        return saved.numel() if isinstance(saved, torch.Tensor) else 0
    saved = getattr(node, "_saved_self", None)
    if getattr(node, "_saved_reduction", None) == _SUM and isinstance(saved, torch.Tensor):
        return saved.numel()  # a torch loss with reduction='sum': its input's values
    return 0


def divided_sum_problem(loss: torch.Tensor, rows: int) -> str | None:
    """Why the plain scalar `loss` is not a mean over its `rows` rows (with the fix), or None.

    Args:
        loss: The scalar `loss_fn` returned, with its graph (before its backward).
        rows: The micro-batch's rows (0 if not known: nothing is said).

    Returns:
        A message naming `LossSum.terms` when `loss` divides a sum with a value per row by a
        constant that is not a whole multiple of `rows`; None otherwise.
    """
    if rows < 1 or loss.grad_fn is None:
        return None
    divisions = _divisions(loss, rows)
    value = next((value for value, _ in divisions if not _whole(value, rows)), None)
    if value is None:
        return None
    return (
        f"loss_fn returned a plain scalar that divides a sum over the micro-batch by {value:g}, "
        f"which is not a whole multiple of its {rows} rows: a weighted or masked mean "
        "(sum(w * loss) / sum(w): per-sample weights, a mask), or a mean over another count. "
        "A plain scalar is read as a mean over the rows and weighted by them, so the step is "
        "not the full-batch one. Return gradaccum.LossSum.terms(loss=(summed_loss, divisor)) "
        "instead, e.g. LossSum.terms(loss=((w * loss).sum(), w.sum())) (a term's count may "
        "be a sum of weights): the window then divides once by the whole batch's total; for "
        "a constant denominator C, LossSum.terms(loss=Term(summed_loss, denominator=C)) "
        "(from gradaccum.loss import Term; docs/losses.md)."
    )


def reciprocal_divisor(node: object, rows: int) -> tuple[float, object] | None:
    """`(d, inner)` if `node` multiplies `inner` by `1 / d`, a division by `d >= rows`.

    A token mean written as a product, `(l * k).sum() * (1 / k.sum())` or
    `* torch.reciprocal(k.sum())`, is the division `sum / k.sum()`; the factors below 1 in a
    chain (`0.5 * sum * (1 / n)`) make `d`, larger ones are weights (`T * T`). Below `rows`
    (a weight such as `0.5 * ce_sum` over 5 rows) it is a sum weighted, not a mean.
    """
    fraction, inner = 1.0, node
    for _ in range(4):
        factor = constant_factor(inner, any_device=True)
        if factor is None:
            break
        fraction *= abs(factor[0]) if 0 < abs(factor[0]) < 1 else 1.0
        inner = factor[1]
    divisor = 1 / fraction if fraction > 0 else math.inf
    if abs(divisor - round(divisor)) <= 1e-6 * divisor:  # a count's float32 reciprocal
        divisor = round(divisor)
    if fraction == 1.0 or not math.isfinite(divisor) or divisor < rows:
        return None
    return divisor, inner


def _quotient(node: object, rows: int) -> tuple[float, object] | None:
    """`(divisor, numerator)` of `node` written as a division by a constant.

    As `a / d`, `a.div(d)`, `torch.true_divide(a, d)`, or `a * (1 / d)` (`reciprocal_divisor`).
    """
    top = through_factors(node)
    if type(top).__name__ != "DivBackward0":
        return reciprocal_divisor(node, rows)
    divisor = getattr(top, "_saved_other", None)
    if (
        not isinstance(divisor, torch.Tensor)
        or divisor.numel() != 1
        or divisor.requires_grad
        or divisor.is_complex()
    ):
        return None
    return abs(float(divisor)), top.next_functions[0][0]  # type: ignore[attr-defined]


def _divided(node: object, rows: int, per_row: bool) -> tuple[float, int] | None:
    """`(divisor, values summed)` if `node` divides a sum over the items by a constant.

    The values summed are negative when a mask picked them (`loss[mask].sum() / mask.sum()`).
    `sum(w * log_p) / -sum(w)` is a weighted mean too: the divisor's sign is dropped.
    """
    quotient = _quotient(node, rows)
    if quotient is None:
        return None
    value, numerator = quotient
    summed = _sum_over_items(numerator, rows, per_row=per_row)
    return None if not summed or not math.isfinite(value) or value <= 0 else (value, summed)


def _whole(value: float, rows: int) -> int:
    """`value / rows` if it is a whole number >= 1, else 0."""
    share = value / rows
    return round(share) if round(share) >= 1 and abs(share - round(share)) <= 1e-9 * share else 0


def _divisions(loss: torch.Tensor, rows: int) -> list[tuple[float, int]]:
    """The hand-divided sums over the items `loss` is (or adds up), past constant factors."""
    top = loss.grad_fn  # `-(sum / W)`, `0.5 * sum / W`, `sum * (1 / W)`
    # Each term of a sum too (`dpo.mean() - log_p.sum() / tokens`: a token mean beside a row
    # mean), if it sums a tensor of a value per row: a regularizer summing weights is no mean.
    nodes = [top] if _quotient(top, rows) else _mean_terms(loss, factors=True)
    return [d for node in nodes if (d := _divided(node, rows, node is not top))]


_SELECTS = frozenset({"IndexBackward0", "MaskedSelectBackward0"})
_ADDS = frozenset({"AddBackward0", "SubBackward0"})


def _leading(node: object) -> int:
    """The first dimension of the tensor a sum node sums (0 if not known)."""
    sizes: tuple[int, ...] = tuple(getattr(node, "_saved_self_sym_sizes", None) or ())
    saved = getattr(node, "_saved_self", None)
    if not sizes and isinstance(saved, torch.Tensor):
        sizes = tuple(saved.shape)
    return int(sizes[0]) if sizes else 0


def _sum_over_items(numerator: object, rows: int, limit: int = 64, *, per_row: bool = False) -> int:
    """How many values `numerator` sums if it sums the items (a hand-divided mean's), else 0.

    Negative when a mask or an index picked them (`loss[mask].sum()`).

    A `.sum()` (`nansum`, a loss with reduction='sum') over a value per row; over values a mask
    or an index picked (`loss[mask].sum()`: their number is the mask's, no multiple of the
    rows); or several such sums added up (a cross-entropy computed in chunks over the sequence
    to save memory, `sum(ce(chunk, reduction='sum') for chunk in ...)`). Not a sum of a few
    heads' losses (`stack(...).sum()`: fewer values than rows, no mask). With `per_row`, a
    sum not over a mask's picks must sum a tensor of the micro-batch's rows first.
    """
    parts, queue, selected, summed = 0, [through_factors(numerator)], False, 0
    while queue:
        node = queue.pop()
        if type(node).__name__ in _ADDS or type(node).__name__ == "AddBackward1":
            below = [through_factors(f) for f, _ in node.next_functions if f is not None]  # type: ignore[attr-defined]
            queue.extend(below)
            parts += len(below) - 1
            if parts > limit:
                return 0
            continue
        values = summed_values(node)
        if values < 1:
            return 0
        picked = _selected(node)
        if per_row and not picked and _leading(node) != rows:
            return 0
        summed += values
        selected = selected or picked
    if selected:
        return -summed  # negative: values a mask picked
    return summed if summed >= rows and summed % rows == 0 else 0


_NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
_BELOW = 4  # nodes under a mean searched for the selection: `(p[m] - y[m]).abs().mean()`


def _mean_terms(loss: torch.Tensor, limit: int = 8, *, factors: bool = False) -> list[object]:
    """The terms a loss adds up (`a + 0.5 * b - c`), each past its constant factors.

    With `factors`, each term keeps them: `s * (1 / n)` is a division.
    """
    queue: list[object] = [loss.grad_fn]
    terms: list[object] = []
    while queue and len(terms) + len(queue) <= limit:
        raw = queue.pop(0)
        node = through_factors(raw)
        if type(node).__name__ in _ADDS:
            queue.extend(f for f, _ in node.next_functions if f is not None)  # type: ignore[attr-defined]
        else:
            terms.append(raw if factors else node)
    return terms


def _averaged(node: object) -> int:
    """How many values the mean node `node` divides by (0 if it is no mean)."""
    if type(node).__name__ == "MeanBackward0":
        sizes = getattr(node, "_saved_self_sym_sizes", None)
        return math.prod(int(s) for s in sizes) if sizes is not None else 0
    if getattr(node, "_saved_reduction", None) != _MEAN:
        return 0
    name = type(node).__name__
    saved = getattr(node, "_saved_target" if name.startswith("NllLoss") else "_saved_self", None)
    return saved.numel() if isinstance(saved, torch.Tensor) else 0


def _selected(node: object) -> bool:
    """Whether `node` averages values picked by a mask or an index (`p[mask]`) near it."""
    queue = [(f, 1) for f, _ in getattr(node, "next_functions", ())]
    while queue:
        below, depth = queue.pop(0)
        if below is None:
            continue
        if type(below).__name__ in _SELECTS:
            return True
        if depth < _BELOW:
            queue.extend((f, depth + 1) for f, _ in below.next_functions)
    return False


def masked_mean_problem(loss: torch.Tensor, rows: int) -> str | None:
    """Why the plain scalar `loss` is a mean over masked values, not rows (with the fix), or None.

    A mean (`.mean()`, a torch loss with reduction='mean') of values picked by a mask or an
    index (`F.mse_loss(pred[mask], y[mask])`: labels missing for some rows or outputs) divides
    by how many the mask keeps, which differs between micro-batches. Told when that count is
    not a whole multiple of the micro-batch's `rows` (a multiple may be a row mean); the means
    a loss adds up (several tasks) are each looked at.
    """
    if rows < 2 or loss.grad_fn is None:
        return None
    for node in _mean_terms(loss):
        values = _averaged(node)
        if values < 1 or values % rows == 0:
            continue
        # Class-index targets are data; another mean may be a regularizer's, over weights.
        # (Fewer than the rows: a loss of the micro-batch as a whole, not a mean over items.)
        if not ((type(node).__name__ in _NLL and values > rows) or _selected(node)):
            continue
        return (
            f"loss_fn returned a plain scalar holding a mean over {values} value"
            f"{'s' if values > 1 else ''} "
            f"({type(node).__name__}), which is not a whole multiple of the micro-batch's "
            f"{rows} rows: a masked mean (`F.mse_loss(pred[mask], y[mask])`, "
            "`loss[mask].mean()`: labels missing for some rows or outputs), or a mean over "
            "targets whose number varies per item (the nodes of a list of graphs, the boxes "
            "of images, sequences concatenated end to end), divides by a count "
            "that differs between micro-batches, and a plain scalar is read as a mean over the "
            "rows and weighted by them, so the step is not the full-batch one. Return "
            "gradaccum.LossSum(summed_loss, count=mask.sum()) (reduction='sum'; the count: the "
            "values averaged); for several "
            "masked tasks, LossSum.terms(task=(summed_loss, mask.sum()), ...), each divided "
            "once by the whole batch's count (docs/losses.md)."
        )
    return None


def masked_means_per_row(loss: torch.Tensor, rows: int) -> tuple[int, ...] | None:
    """The values per row each masked mean of `loss` averages, when all are whole multiples.

    `loss[mask].mean()` with the same number of kept values in each row of a micro-batch (a
    fixed number of valid tokens per row, the same in all its rows) divides by a whole multiple
    of the rows, which `masked_mean_problem` takes for a row mean. It is one only if that number
    per row stays the same in every micro-batch of the window: the caller compares them.
    None when `loss` has no such mean (or one that is no multiple: already told).
    """
    if rows < 1 or loss.grad_fn is None:
        return None
    # A hand-divided mean too (`log_p.sum() / tokens` over one row: a whole multiple of it),
    # unless it divides by the values it sums (`l.sum() / l.numel()`: `l.mean()` by hand).
    counts = [_whole(v, rows) for v, summed in _divisions(loss, rows) if v != summed]
    # (`summed` is negative for a mask's picks: `l[mask].sum() / mask.sum()` is compared.)
    if not all(counts):
        return None  # no multiple: already told
    for node in _mean_terms(loss):
        values = _averaged(node)
        if values < 1 or not _selected(node):
            continue
        if values % rows:
            return None
        counts.append(values // rows)
    return tuple(counts) or None


def per_row_change_problem(before: tuple[int, ...], now: tuple[int, ...]) -> str:
    """The message for masked means whose values per row changed between two micro-batches."""
    return (
        f"loss_fn returned a plain scalar holding a mean over values picked by a mask or an "
        f"index (`loss[mask].mean()`, `F.mse_loss(pred[mask], y[mask])`), or a sum divided by "
        f"their count (`log_p.sum() / n_tokens`), that kept {before[0]} "
        f"per row in one micro-batch and {now[0]} per row in another: a mean over the kept "
        "values (valid tokens, known labels), not over the rows, so weighting each micro-batch "
        "by its rows is not the full-batch mean. Return gradaccum.LossSum(summed_loss, "
        "count=mask.sum()) (reduction='sum'; the count: the values averaged); for several "
        "masked tasks, LossSum.terms(task=(summed_loss, mask.sum()), ...) (docs/losses.md)."
    )
