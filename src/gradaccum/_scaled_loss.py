"""`loss * (1 / accumulation_steps)`: the copied loop's division, spelled as a multiplication.

`_copied_loop.division_problem` reads a loss divided by the window's number of micro-batches
(`loss / k`, `loss /= k`, `torch.div(loss, k)`). The same line is as often a multiplication:
`loss * (1 / accumulation_steps)`, `loss * 0.25` for 4 micro-batches, `loss * cfg.scale`, a
factor as a tensor, or each term divided on its own (`ce / k + aux / k`). Each makes every
gradient `k` times too small, silently (0.13 off an SGD step on 4 micro-batches). They are read
from the loss's top nodes (constant factors on the CPU, no device sync): the product of the
factors and divisors above the loss is `1 / k`.

A multiplication by 0.5 on two micro-batches is not told: `0.5 * F.mse_loss(...)` is a common
convention, as likely as a copied `loss * (1 / 2)`. Neither is a mean of `k` terms (`(a + b +
c) / 3`, `sum(head_losses) * (1 / len(heads))` with three heads on three micro-batches), nor a
sum over `k` rows divided by the rows (`.sum() * (1 / len(x))`): both are means read correctly.

Example:
    >>> import torch
    >>> logits = torch.randn(4, 3, requires_grad=True)
    >>> loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 1]))
    >>> scale_problem(loss * (1 / 4), micro_batches=4) is not None
    True
    >>> scale_problem(loss * 0.5, micro_batches=2) is None
    True
"""

from __future__ import annotations

from gradaccum._copied_loop import _addends, _divisor, _row_sum
from gradaccum._weighted_mean import constant_factor

__all__ = ["scale_problem"]

_LIMIT = 4  # constant factors and divisions read above the loss: `loss / k * w` at most


def _scale(node: object) -> tuple[float, bool, object]:
    """`(s, multiplied, inner)`: `node` is `inner` times the constant `s`.

    `multiplied` says whether one of the factors was a multiplication (a negation is not).
    """
    scale, multiplied = 1.0, False
    for _ in range(_LIMIT):
        factor = constant_factor(node)
        if factor is not None:
            scale, node = scale * factor[0], factor[1]
            multiplied = multiplied or factor[0] != -1.0
            continue
        divisor = _divisor(node)
        if not divisor:
            break
        scale, node = scale / divisor, node.next_functions[0][0]  # type: ignore[attr-defined]
    return scale, multiplied, node


def _is(scale: float, micro_batches: float) -> bool:
    return abs(abs(scale) * micro_batches - 1) < 1e-9


def _each_term_scaled(node: object, micro_batches: int) -> bool:
    """Whether `node` adds two terms, each divided by `micro_batches` (`ce / k + w * aux / k`).

    A factor of `1 / k` counts as such a division (not 0.5 on two micro-batches).
    """
    if type(node).__name__ != "AddBackward0":
        return False
    terms = [f for f, _ in node.next_functions if f is not None]  # type: ignore[attr-defined]
    return len(terms) == 2 and all(_divided_by(term, micro_batches) for term in terms)


def _divided_by(node: object, micro_batches: int) -> bool:
    for _ in range(_LIMIT):
        factor = constant_factor(node)
        if factor is not None:
            if micro_batches > 2 and _is(factor[0], micro_batches):
                return True
            node = factor[1]
            continue
        divisor = _divisor(node)
        if not divisor:
            return False
        if divisor == micro_batches:
            return True
        node = node.next_functions[0][0]  # type: ignore[attr-defined]
    return False


def scale_problem(result: object, micro_batches: int, items: int = 0) -> str | None:
    """What is wrong if `result` is scaled by `1 / micro_batches` with a multiplication.

    `micro_batches` is the window's number of micro-batches when known up front (else 0); the
    caller warns only when it holds on the first two micro-batches, as for a division.
    """
    value = getattr(result, "value", result)
    node = getattr(value, "grad_fn", None)
    if micro_batches < 2 or node is None:
        return None
    scale, multiplied, inner = _scale(node)
    if _is(scale, micro_batches):
        if not multiplied or (micro_batches == 2 and abs(scale) == 0.5):
            return None  # a division alone is `division_problem`'s; 0.5 * mse a convention
        if type(inner).__name__ == "AddBackward0" and _addends(inner) == micro_batches:
            return None  # a mean of `k` terms
        if items == micro_batches and _row_sum_scaled(inner, items):
            return None  # `.sum() * (1 / len(x))`: the row mean a plain scalar is
    elif not (_is(scale, 1.0) and _each_term_scaled(inner, micro_batches)):
        return None
    return (
        f"loss_fn scales its loss by 1/{micro_batches}, one over the window's number of "
        "micro-batches (a hand-written loop's `loss = loss * (1 / accumulation_steps)`, or "
        "each term divided by it): gradaccum divides once by the window's item count itself, "
        f"so every gradient is {micro_batches} times too small. Remove the factor (if it is a "
        "loss weight that happens to equal it, fold it into the learning rate)."
    )


def _row_sum_scaled(node: object, items: int) -> bool:
    """Whether `node` sums the micro-batch's `items` rows (the factor makes it a row mean)."""
    name = type(node).__name__
    if name == "SumBackward0" or getattr(node, "_saved_reduction", None) == 2:
        sizes = getattr(node, "_saved_self_sym_sizes", None)
        return sizes is None or int(sizes[0]) == items
    return (name == "AddBackward0" and _addends(node) == items) or _row_sum(node, items)
