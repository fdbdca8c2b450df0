"""A loss that uses a statistic of its own micro-batch with no gradient: the split changes it.

Two everyday losses compute something over the batch they are given that needs no gradient:
PPO's advantage normalization, `adv = (adv - adv.mean()) / (adv.std() + 1e-8)`, and mixup or
CutMix drawn inside `loss_fn`, which mixes each item with another item of the same batch
(`lam * ce(out, y) + (1 - lam) * ce(out, y[perm])`). Inside `loss_fn` that batch is the
micro-batch: each micro-batch is normalized with its own mean and std, or mixed only within
itself, and the step depends on the split, silently. Both are read from the loss's graph near
its top, in a split window (the first few micro-batches, as the other loss checks are):

- a tensor without gradient, one value per row, not all whole numbers, that the graph
  multiplies by, with mean 0 over the micro-batch (to rounding): centered or standardized over
  the micro-batch (a batch-mean baseline `R - R.mean()` too);
- two class-index `cross_entropy`/`nll_loss` terms over the micro-batch's rows whose targets
  are each other's permutation, not equal: labels mixed within the micro-batch.

Example:
    >>> import torch
    >>> logp = torch.randn(6, requires_grad=True)
    >>> adv = torch.randn(6)
    >>> loss = -(logp * (adv - adv.mean()) / (adv.std() + 1e-8)).mean()  # centered, then divided
    >>> batch_statistic_problem(loss, rows=6, micro_batches=2)[0]
    'centered'
    >>> batch_statistic_problem(-(logp * adv).mean(), rows=6, micro_batches=2) is None
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

__all__ = ["batch_statistic_problem"]

_NODES = 64  # graph nodes searched from the loss: both are near its top
_NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
_MIX_ROWS = 4  # fewer rows reorder the same few labels by chance too often


def _values(result: object) -> Iterator[torch.Tensor]:
    """The loss tensors of a plain scalar, a `LossSum` or each term of `LossSum.terms`."""
    terms = getattr(result, "terms", None)  # LossTerms' mapping (LossSum.terms: a classmethod)
    found = (
        [getattr(t, "value", None) for t in terms.values()]
        if isinstance(terms, Mapping)
        else [result]
    )
    for value in found:
        value = value if isinstance(value, torch.Tensor) else getattr(value, "value", None)
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            yield value


def _nodes(value: torch.Tensor) -> Iterator[object]:
    queue, seen, count = [value.grad_fn], set(), 0
    while queue and count < _NODES:
        node = queue.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        count += 1
        yield node
        queue.extend(f for f, _ in getattr(node, "next_functions", ()))


def _centered(t: torch.Tensor) -> bool:
    """Whether `t` (no gradient, one value per row) has mean 0 to rounding.

    Whole numbers are labels or signs (a margin loss's balanced +-1 targets), not a
    statistic's result: not told.
    """
    values = t.detach().double().flatten()
    scale = float(values.abs().max())
    if not scale or not torch.isfinite(values).all() or torch.equal(values, values.round()):
        return False
    return abs(float(values.mean())) <= 1e-5 * scale


_WEIGHTS = (
    "loss_fn weighs its cross-entropy by class weights from this micro-batch's own label counts "
    "(weight=1 / counts, or n / (classes * counts) from torch.bincount(y)): each micro-batch "
    "weighs its classes by its own counts, not the batch's, so the step depends on the split. "
    "Count the labels over the whole dataset (or the whole batch, before acc.step()) and pass "
    "those weights; then return LossSum.terms(loss=(ce_sum, w[y].sum())) for the weighted mean "
    "(docs/losses.md, 'Everyday torch.nn losses')."
)


def _counted_weights(node: object, target: object) -> tuple[float, ...] | None:
    """An NLL node's `weight=` if it is inverse to its own targets' class counts, else None.

    `w[c] * count[c]` equal over the classes present (at least two, with unequal weights):
    `1 / bincount(y)` or sklearn's "balanced" `n / (classes * bincount(y))`, drawn in loss_fn.
    Fixed weights may fit one micro-batch's counts too (a micro-batch as balanced as the
    data): the caller tells only weights that fit and CHANGE between micro-batches.
    """
    weight = getattr(node, "_saved_weight", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if weight.dim() != 1 or target.is_floating_point() or weight.numel() < 2:
        return None
    ignore = getattr(node, "_saved_ignore_index", -100)
    labels = target[(target != ignore) & (target >= 0) & (target < weight.numel())]
    counts = torch.bincount(labels.flatten(), minlength=weight.numel()).to(weight.dtype)
    present = counts > 0
    if int(present.sum()) < 2:
        return None
    per_class = (weight * counts)[present].double()
    if torch.allclose(weight[present], weight[present][:1].expand(int(present.sum()))):
        return None  # equal weights: a plain mean
    if not torch.allclose(per_class, per_class[:1].expand_as(per_class), rtol=1e-6):
        return None
    return tuple(float(w) for w in weight.detach().double())


def _soft_target(t: torch.Tensor, rows: int) -> bool:
    """Whether `t` may be soft class targets: rows x classes, floating, without gradient."""
    return (
        not t.requires_grad and t.is_floating_point() and t.dim() == 2 and t.shape[0] == rows
    ) and t.shape[1] >= 2


def _mixed(targets: list[torch.Tensor]) -> bool | None:
    """Whether two of `targets` are each other's permutation (the same labels, reordered).

    False if two of one shape hold other labels (mixed with items outside the micro-batch,
    before the split); None if none differ (one target, or a permutation that kept them).
    """
    mixed = None
    for i, a in enumerate(targets):
        for b in targets[i + 1 :]:
            if a.shape == b.shape and not torch.equal(a, b):
                if not torch.equal(a.sort().values, b.sort().values):
                    return False
                mixed = True
    return mixed


def _soft_mixed(target: torch.Tensor) -> bool | None:
    """Whether the soft targets `target` (rows x classes) mix the micro-batch's own labels.

    `lam * onehot(y) + (1 - lam) * onehot(y[perm])`, a permutation within the micro-batch, keeps
    each class's column sum a whole number (its count of labels); label smoothing (`off` on
    every class, `1 - classes * off` added on the label) keeps `(sum - rows * off) / (1 -
    classes * off)` whole. Teacher probabilities, or targets mixed across the batch before the
    split, give fractions: False. None if no row mixes two labels (one-hot, smoothed, lam 0/1).
    """
    rows, classes = target.shape
    sums = target.detach().sum(1, dtype=torch.float64)  # rows only: no copy of the targets
    if not torch.isfinite(sums).all() or not torch.allclose(sums, sums[:1].expand(rows)):
        return None  # not one distribution per row (a dropout mask, activations)
    t = target.detach().double().abs()  # `-ys * log_softmax(out)` saves `-ys`
    if torch.equal(t, t.round()):
        return None  # hard labels (multi-label 0/1 targets): nothing mixed by a fraction
    off = float(t.min()) if classes > 2 else 0.0
    above = (t > off + 1e-9).sum(1)
    if not bool((above >= 2).any()) or float(t.sum(1)[0]) <= 0:
        return None
    counts = (t.sum(0) - rows * off) / (float(t.sum(1)[0]) - classes * off)
    return bool(((counts - counts.round()).abs() <= 1e-6 * rows).all())


def batch_statistic_problem(
    result: object, rows: int, micro_batches: int
) -> tuple[str, str] | None:
    """`(kind, why)`: why `result` depends on how the window was split (with the fix), or None.

    `kind` is "centered" or "mixed" (or "not mixed", with no message: two targets with
    other labels). Labels reordered may match by chance in a small micro-batch mixed correctly
    (before the split): the caller warns of "mixed" on its second micro-batch, and not at all
    once one was "not mixed". (A micro-batch of fewer than 4 rows is not looked at for it.)

    Args:
        result: What `loss_fn` returned for one micro-batch, with its graph.
        rows: The micro-batch's rows.
        micro_batches: The window's micro-batches when `step()` split a batch (else 0).
    """
    if micro_batches < 2 or rows < 2:
        return None
    for value in _values(result):
        targets: list[torch.Tensor] = []
        soft: list[torch.Tensor] = []  # soft targets, one distribution per row (mixup's)
        for node in _nodes(value):
            target = getattr(node, "_saved_target", None)  # also BCE's (rows x classes)
            if type(node).__name__ in _NLL:
                if isinstance(target, torch.Tensor) and tuple(target.shape) == (rows,):
                    targets.append(target)
                weights = _counted_weights(node, target)
                if weights is not None:  # the caller compares them between micro-batches
                    return f"weights {weights}", _WEIGHTS
                continue
            if isinstance(target, torch.Tensor) and _soft_target(target, rows):
                soft.append(target)
            if type(node).__name__ not in ("MulBackward0", "DivBackward0"):
                continue
            for name in ("_saved_other", "_saved_self"):
                saved = getattr(node, name, None)
                if isinstance(saved, torch.Tensor) and _soft_target(saved, rows):
                    soft.append(saved)  # `-(ys * log_softmax(out)).sum(1)`, soft-target CE
                if (
                    isinstance(saved, torch.Tensor)
                    and not saved.requires_grad
                    and saved.is_floating_point()
                    and saved.shape[:1] == (rows,)
                    and saved.numel() == rows
                    and _centered(saved)
                ):
                    return "centered", (
                        f"loss_fn multiplies by a tensor without gradient that has mean 0 over "
                        f"this micro-batch's {rows} rows: centered or normalized inside loss_fn "
                        "(PPO's advantage normalization, (adv - adv.mean()) / (adv.std() + "
                        "1e-8); a batch-mean baseline, R - R.mean()), each micro-batch with its "
                        "own statistics, not the batch's, so the step depends on the split. "
                        "Normalize over the whole batch before acc.step() and pass the result "
                        "in the batch (batch['adv'] = (adv - adv.mean()) / (adv.std() + 1e-8)); "
                        "loss_fn then reads it as it is "
                        "(docs/losses.md, 'PPO, A2C and REINFORCE over a rollout')."
                    )
        mixed = _mixed(targets) if rows >= _MIX_ROWS else None
        for target in soft if mixed is None and rows >= _MIX_ROWS else ():
            mixed = _soft_mixed(target) if mixed is None else mixed
        if mixed is False:
            return "not mixed", ""
        if mixed:
            return "mixed", (
                "loss_fn scores its micro-batch against two sets of class targets that are the "
                "same labels reordered, or soft targets mixing its own labels (mixup or CutMix "
                "drawn in loss_fn: lam * ce(out, y) + (1 - lam) * ce(out, y[perm]), or "
                "ce(out, lam * onehot(y) + (1 - lam) * onehot(y[perm]))): each item is mixed "
                "only with items of its own micro-batch, not of the batch, so the step depends "
                "on the split. Mix the whole batch before acc.step() (in the collate function), "
                "passing the mixed inputs and targets (both targets and lam, or the soft "
                "targets) in the batch, so loss_fn only scores them (docs/losses.md, 'Mixup and "
                "CutMix')."
            )
    return None
