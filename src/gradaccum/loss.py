"""What a loss function reports: the SUM of its per-item losses and the COUNT of items.

A micro-batch's mean cannot be averaged with other micro-batches' means without knowing how many
items each one counted (ragged batches, padding, `ignore_index`). So every loss is read as
`(sum, count)`, and a window divides once, by the total count.

Example:
    >>> import torch
    >>> from gradaccum import LossSum
    >>> logits, labels = torch.randn(4, 7, 10), torch.randint(0, 10, (4, 7))
    >>> labels[:, 5:] = -100  # padding
    >>> value = torch.nn.functional.cross_entropy(
    ...     logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    >>> LossSum(value, count=(labels != -100).sum())
    LossSum(value=..., count=...)
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import torch

from gradaccum._copied_loop import CopiedLoopWarning
from gradaccum._returned import loss_inside
from gradaccum._token_mean import TokenMeanCheck, TokenMeanWarning, warn_if_token_mean

__all__ = [
    "MAX_TERMS",
    "CopiedLoopWarning",
    "LossSum",
    "LossTerms",
    "ReadTerm",
    "Term",
    "TokenMeanCheck",
    "TokenMeanWarning",
    "backward_inside_error",
    "counted_ahead",
    "read_terms",
    "warn_if_token_mean",
]


_TermLike: TypeAlias = "Term | tuple[torch.Tensor, int | torch.Tensor]"


@dataclass(frozen=True)
class LossSum:
    """A loss given as a sum over items together with how many items it counts.

    Attributes:
        value: Scalar tensor, the sum of per-item losses (`reduction="sum"`).
        count: Number of items counted, an int or a 0-dim tensor, >= 0.

    Example:
        >>> import torch
        >>> LossSum(torch.tensor(6.0), 3)
        LossSum(value=tensor(6.), count=3)
    """

    value: torch.Tensor
    count: int | torch.Tensor

    @staticmethod
    def terms(named: Mapping[str, _TermLike] | None = None, /, **terms: _TermLike) -> LossTerms:
        """A loss of several named terms, each divided by its own window count.

        The window's objective is `sum_t weight_t * (sum of value_t) / D_t`, where `D_t` is the
        term's count summed over every micro-batch and rank (or its constant `denominator`).
        A `(value, count)` pair is a `Term` of weight 1. The terms may also come as one dict
        (`LossSum.terms({"ce": (ce_sum, tokens)})`, as a model's dict of losses is built).

        Example:
            >>> import torch
            >>> ce, aux = torch.tensor(12.0), torch.tensor(0.5)
            >>> loss = LossSum.terms(ce=(ce, 30), aux=Term(aux, count=4, weight=0.01))
            >>> sorted(loss.terms)
            ['aux', 'ce']
        """
        if named is not None:
            if not isinstance(named, Mapping) or not all(isinstance(k, str) for k in named):
                raise TypeError(
                    f"LossSum.terms() takes its terms by name (ce=(ce_sum, tokens)) or as one "
                    f"dict of them keyed by str; got a {type(named).__name__}."
                )
            if both := sorted(set(named) & set(terms)):
                raise ValueError(
                    f"LossSum.terms() got the terms {both} twice: in the dict and by name."
                )
            terms = {**named, **terms}
        if not terms:
            raise ValueError("LossSum.terms() needs at least one term, e.g. ce=(ce_sum, tokens).")
        if len(terms) > MAX_TERMS:
            raise ValueError(f"LossSum.terms takes at most {MAX_TERMS} terms, got {len(terms)}.")
        built: dict[str, Term] = {}
        for name, term in terms.items():
            if isinstance(term, tuple) and len(term) == 2:
                term = Term(term[0], count=term[1])
            if not isinstance(term, Term):
                raise TypeError(
                    f"term {name!r} is a {type(term).__name__}; give (value_sum, count) or "
                    "gradaccum.loss.Term(value_sum, count=..., weight=..., denominator=...)."
                )
            built[name] = term
        return LossTerms(built)


MAX_TERMS = 8  # the window exchange between ranks holds a fixed number of terms


@dataclass(frozen=True)
class Term:
    """One term of `LossSum.terms`: a summed loss and what it is divided by.

    Attributes:
        value: Scalar tensor, the term summed over its items in this micro-batch.
        count: Items this micro-batch counts for the term (the window adds them up); for a
            weighted mean, the items' summed weights, a real number >= 0 (e.g. `w[targets].sum()`
            for `cross_entropy(..., weight=w)`, whose mean divides by it).
        weight: A constant factor on the normalized term (a learnable one multiplies `value`).
        denominator: A constant to divide by instead of the window's count (e.g. Dr. GRPO's
            `G * max_len`); then `count` is not needed.

    Example:
        >>> import torch
        >>> Term(torch.tensor(3.0), denominator=512.0).denominator
        512.0
    """

    value: torch.Tensor
    count: int | torch.Tensor | None = None
    weight: float = 1.0
    denominator: float | None = None


@dataclass(frozen=True)
class LossTerms:
    """What `LossSum.terms(...)` returns: the named terms of one micro-batch's loss."""

    terms: Mapping[str, Term]


class ReadTerm(NamedTuple):
    """A checked term: `value` summed over `count` items, normalized by `denominator` if set."""

    name: str
    value: torch.Tensor
    weight: float
    count: float  # type: ignore[assignment]  # shadows tuple.count: items, or summed weights
    denominator: float | None


def read_terms(result: LossTerms) -> list[ReadTerm]:
    """Check every term of `result` (before any backward, so a bad term changes nothing).

    Raises:
        ValueError: For a value that is not a floating scalar, a count that is not a finite
            number >= 0 (a term's count may be a sum of weights), a weight or denominator that
            is not finite (a denominator must be > 0), or a term with both or neither of
            `count` and `denominator`.
    """
    read = []
    for name, term in result.terms.items():
        value = _check_scalar(term.value, f"term {name!r}")
        if (term.count is None) == (term.denominator is None):
            raise ValueError(
                f"term {name!r} needs exactly one of count= (divide by the window's count) and "
                "denominator= (divide by a constant)."
            )
        if isinstance(term.weight, torch.Tensor) and term.weight.requires_grad:
            # float() would drop its graph: the learnable weight would silently never move.
            raise ValueError(
                f"term {name!r} has a weight that requires grad (a learnable weight); a Term's "
                "weight is a constant. Multiply the value instead, Term(value * weight, "
                "count=...), so that its gradient reaches the weight."
            )
        weight = float(term.weight)
        if not math.isfinite(weight):
            raise ValueError(f"term {name!r} has weight={term.weight!r}; it must be finite.")
        denominator = None
        if term.denominator is not None:
            denominator = float(term.denominator)
            if not (math.isfinite(denominator) and denominator > 0):
                raise ValueError(
                    f"term {name!r} has denominator={term.denominator!r}; it must be > 0."
                )
        count = 0.0 if term.count is None else _count_number(term.count, f"term {name!r}'s count")
        if term.count is not None:
            _refuse_nan_over_nothing(value, count, f"term {name!r}")
        read.append(ReadTerm(name, value, weight, count, denominator))
    return read


class ReadLoss(NamedTuple):
    """A checked loss: the summed loss is `value * weight`, over `count` items."""

    value: torch.Tensor  # keeps its graph; a mean for plain tensors, a sum for LossSum
    weight: int  # items the mean stands for (1 for LossSum)
    count: int  # type: ignore[assignment]  # shadows tuple.count on purpose: the item count


def read_loss(result: object, batch_items: int, *, needs_graph: bool = False) -> ReadLoss:
    """Turn a `loss_fn` result into `(value, weight, count)` after checking it.

    A scalar tensor is a mean over the micro-batch's `batch_items` samples (its sum is
    `value * batch_items`); a `LossSum` is taken as it is. The check runs before any backward, so
    a bad result changes no gradient. The product is left to the caller, which folds it into the
    one multiply it needs anyway.

    Args:
        result: What `loss_fn(model, micro_batch)` returned.
        batch_items: The micro-batch's leading dimension, the weight of a plain mean.
        needs_graph: Refuse a loss that counts items but has no graph to differentiate.

    Returns:
        The loss tensor (with its graph), its weight and the item count as an int.

    Raises:
        TypeError: If `result` is neither a tensor nor a `LossSum`.
        ValueError: If the value is not a scalar, the count is negative or not whole, or (with
            `needs_graph`) a loss that counts items has no graph (`torch.no_grad()`, detached),
            or one that counts none is not finite (a mean over nothing, times 0).
    """
    if (  # the common case, checked in one look (it runs cold, after the forward's kernels)
        type(result) is torch.Tensor
        and result.requires_grad
        and result.dim() == 0
        and result.is_floating_point()
    ):
        return ReadLoss(result, batch_items, batch_items)
    if isinstance(result, LossSum):
        value = _check_scalar(result.value, "LossSum.value")
        count = _read_count(result.count)
        if needs_graph:
            _require_graph(value, count)
            _refuse_nan_over_nothing(value, count, "LossSum.value")
        return ReadLoss(value, 1, count)
    if isinstance(result, LossTerms):
        # Only for what needs a backward and nothing exact (memory probes, FSDP2's settle):
        # the engine reads terms with `read_terms`.
        terms = read_terms(result)
        total = functools.reduce(torch.add, [t.value * t.weight for t in terms])
        return ReadLoss(total, 1, math.ceil(sum(t.count for t in terms)))
    if isinstance(result, torch.Tensor):
        value = _check_scalar(result, "the loss")
        if needs_graph:
            _require_graph(value, batch_items)
        return ReadLoss(value, batch_items, batch_items)
    raise TypeError(
        f"loss_fn returned {type(result).__name__}; return a scalar tensor (the mean over the "
        "micro-batch) or gradaccum.LossSum(value=sum_of_losses, count=items_counted)"
        f"{loss_inside(result)}."
    )


def _require_graph(value: torch.Tensor, count: int) -> None:
    """Raise if a loss that counts items has no graph to differentiate (no_grad, detached)."""
    if count > 0 and not value.requires_grad:
        raise ValueError(
            "the loss does not require grad: it was computed under torch.no_grad(), "
            "detached, or from frozen parameters only; return the loss with its graph. "
            "(torch.utils.checkpoint(..., use_reentrant=True) around the trainable layers "
            "also returns no graph when none of its inputs requires grad, as torch warned: "
            "pass use_reentrant=False. A PEFT model left merged, merge_adapter(), runs its "
            "adapters folded into frozen weights: call unmerge_adapter() before training.)"
        )


def _refuse_nan_over_nothing(value: torch.Tensor, count: float, what: str) -> None:
    """Raise if a loss counting no item is not finite: a mean over nothing, times the count 0.

    `cross_entropy(..., ignore_index=-100) * n` on a micro-batch whose targets are all ignored
    is `nan * 0`: its backward would make the whole window non-finite (skipped), where the full
    batch steps. Read only for micro-batches that count nothing (one device read).
    """
    if count == 0 and not bool(torch.isfinite(value.detach())):
        raise ValueError(
            f"{what} counts 0 items but is {value.item()}: a mean over no item (e.g. "
            "cross_entropy(..., ignore_index=-100) on targets that are all ignored) times the "
            "count 0 is nan. Return the sum itself, reduction='sum', which is 0 over no item."
        )


def backward_inside_error() -> ValueError:
    """The error for a `loss_fn` that ran a backward itself (gradients changed inside it)."""
    return ValueError(
        "loss_fn ran a backward itself (loss.backward() inside loss_fn) or changed .grad (an "
        "optimizer.zero_grad() or model.zero_grad() inside loss_fn): gradaccum runs the "
        "backward of the loss loss_fn returns, scaled for the window, so these gradients would "
        "be counted twice, or the window's earlier micro-batches dropped. Remove the "
        ".backward() and zero_grad() calls from loss_fn and return the loss."
    )


def counted_ahead(loss_fn: object, micro_batches: Sequence[Any]) -> int | dict[str, float] | None:
    """The items `loss_fn` will count over `micro_batches`, when it can say so before running.

    A loss function may have an `items_counted(micro_batch)` method (the `gradaccum.hf` losses
    do) returning the count its `LossSum` will report, from the batch alone, or for
    `LossSum.terms` a mapping of term name to count. A window that knows its count up front
    divides each backward by it, exactly where a full-batch mean divides, instead of by a power
    of two corrected at the boundary: the same result in exact arithmetic, and the same
    rounding as the full-batch step in models that compute parts of their backward in float32
    (RMSNorm in Llama and T5). For terms it also saves the extra backward pass a term whose
    count is unknown needs. A wrong single count costs no exactness (the boundary divides by
    what the window really counted over the denominator used); a wrong term count is refused
    at the boundary.

    Returns:
        The summed count (per term for a mapping), or None if `loss_fn` has no such method or
        it counts no item.
    """
    count_items = getattr(loss_fn, "items_counted", None)
    if not callable(count_items):
        return None
    counts = [count_items(micro_batch) for micro_batch in micro_batches]
    if counts and all(isinstance(c, Mapping) for c in counts):
        per_term: dict[str, float] = {}
        for count in counts:
            for name, items in count.items():
                per_term[name] = per_term.get(name, 0) + _count_number(items, f"{name!r} count")
        return per_term
    total = sum(_read_count(count) for count in counts)
    return total or None


def _check_scalar(value: object, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} is a {type(value).__name__}; it must be a scalar torch.Tensor.")
    if value.numel() != 1 or value.dim() > 1:
        raise ValueError(
            f"{what} has shape {tuple(value.shape)}; it must be a scalar. Reduce it with "
            "reduction='sum' (and return LossSum) or reduction='mean'."
        )
    if not value.is_floating_point():
        raise ValueError(f"{what} has dtype {value.dtype}; it must be a floating-point tensor.")
    return value if value.dim() == 0 else value.reshape(())  # no extra autograd node


def _read_count(count: object) -> int:
    number = _count_number(count, "LossSum.count")
    if not number.is_integer():
        raise ValueError(
            f"LossSum.count={number!r} must be a whole number of items. A weighted mean (e.g. "
            "cross_entropy(..., weight=w), which divides by the targets' summed weights "
            "w[targets].sum()) is exact as LossSum.terms(loss=(weighted_sum, summed_weights)): "
            "a term's count may be a sum of weights."
        )
    return int(number)


_PLAIN_NUMBERS = (int, float)


def _count_number(count: object, what: str) -> float:
    """`count` as a finite number >= 0 (a Python or numpy number, or a one-element tensor)."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(
                f"{what} has shape {tuple(count.shape)}; it must be an int or a 0-dim "
                "tensor, e.g. (labels != ignore_index).sum()."
            )
        dtype = count.dtype
        count = count.item()  # one host read per micro-batch: validated before any backward
        if dtype.is_floating_point and abs(count) > 2 / torch.finfo(dtype).eps:
            raise ValueError(
                f"LossSum.count={count!r} is a {dtype} tensor, which is exact only up to "
                f"{2 / torch.finfo(dtype).eps:.0f} items: the sum that made it may have rounded. "
                "Count in integers, e.g. (labels != ignore_index).sum() or mask.bool().sum(), "
                "not mask.to(logits.dtype).sum()."
            )
    if type(count) not in _PLAIN_NUMBERS:  # a tensor's item is one: no ABC checks then
        if isinstance(count, numbers.Integral) and not isinstance(count, bool):
            count = int(count)  # numpy integers too
        elif isinstance(count, numbers.Real) and not isinstance(count, bool):
            count = float(count)  # numpy floats too
    if isinstance(count, bool) or not isinstance(count, (int, float)):
        raise TypeError(f"{what}={count!r} must be an int or a 0-dim tensor.")
    if not math.isfinite(count):
        raise ValueError(
            f"{what}={count!r} must be finite: a whole number of items (a term's count may "
            "also be a sum of weights)."
        )
    if count < 0:
        raise ValueError(f"{what}={count!r} must be >= 0: it counts the items summed.")
    return float(count)
