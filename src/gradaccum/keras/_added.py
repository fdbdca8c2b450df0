"""What the loss terms a model adds itself (`add_loss`, regularizers) weigh, read on tiny batches.

Keras adds `model.losses` to the compiled loss of every batch, once. A window weighs each
micro-batch's whole loss by the compiled loss's count and divides by the window's count, so a
term is exact when it is a constant per batch (a weight penalty) or a mean over the compiled
loss's items. A term that SUMS over the rows (`self.add_loss(ops.sum(...))`) is averaged over the
window's micro-batches instead of summed over its rows: the full-batch step adds the window's sum,
the window about 1/steps of it (a 0.4-0.5 gap, silently). A term that is a mean over rows is exact
beside a compiled loss that counts rows, and not beside one counting other items.

`added_terms` tells them apart on a functional or Sequential model without changing any state:
it runs the model statelessly (`stateless_call`, inference mode) on one random row, on that row
twice, and on another row (token inputs: ids 1 and 2). A sum over rows doubles on the doubled
row; a mean over rows does not, but changes with the row; a constant changes with neither.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

__all__ = ["ROW_MEAN", "SUMMED", "added_terms", "check_summed_terms"]

SUMMED = "summed"  # a term that grows with the batch's rows
ROW_MEAN = "row_mean"  # a term that is a mean over the batch's rows


def _inputs(model: Any, rows: list[Any]) -> Any:
    """A batch of `len(rows)` rows for `model`'s symbolic inputs, `rows` drawing each row."""
    flat = keras.tree.flatten(model.inputs)
    made = []
    for k, spec in enumerate(flat):
        shape = tuple(3 if d is None else int(d) for d in spec.shape[1:])
        dtype = str(spec.dtype)
        parts = []
        for seed in rows:
            if "int" in dtype or "bool" in dtype:
                row = np.full(shape, 1 + seed, dtype=dtype)  # token ids 1, 2: not padding
            else:
                row = np.random.default_rng([seed, k]).normal(size=shape).astype(dtype)
            parts.append(row[None])
        made.append(np.concatenate(parts))
    struct = getattr(model, "_inputs_struct", None)
    if struct is not None and keras.tree.is_nested(struct):
        return keras.tree.pack_sequence_as(struct, made)
    return made[0] if len(made) == 1 else made


def _terms(model: Any, rows: list[Any]) -> list[float]:
    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]
    _, _, losses = model.stateless_call(
        trainable, frozen, _inputs(model, rows), training=False, return_losses=True
    )
    return [float(np.sum(ops.convert_to_numpy(term))) for term in losses]


def added_terms(model: Any) -> list[str]:
    """The kinds of `model`'s added loss terms that depend on the batch (`SUMMED`, `ROW_MEAN`).

    Constants (weight regularizers) are left out, and so is anything this cannot read: a
    subclassed model without symbolic inputs, an unbuilt model, or a call that fails on random
    rows returns [] (nothing refused).

    Example:
        >>> import keras
        >>> net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
        ...     2, activity_regularizer="l2", kernel_regularizer="l2")])
        >>> added_terms(net)
        ['row_mean']
    """
    try:
        if not model.built or not model.inputs:
            return []
        one, twice, other = _terms(model, [0]), _terms(model, [0, 0]), _terms(model, [1])
    except Exception:  # a model this cannot feed: checked by nothing, as before
        return []
    if not (len(one) == len(twice) == len(other)):
        return []
    kinds = []
    for a, b, c in zip(one, twice, other, strict=True):
        scale = max(abs(a), abs(c), 1e-30)
        if abs(a) > 1e-12 and abs(b - 2 * a) <= 0.05 * abs(a):
            kinds.append(SUMMED)
        elif abs(b - a) <= 1e-3 * scale and abs(c - a) > 1e-6 * scale:
            kinds.append(ROW_MEAN)
    return kinds


def check_summed_terms(kinds: list[str]) -> None:
    """Refuse added loss terms that sum over the rows: no window count weighs them exactly."""
    summed = kinds.count(SUMMED)
    if summed:
        raise ValueError(
            f"{summed} loss term(s) the model adds itself (self.add_loss(...) in a layer, or a "
            "regularizer) grow with the micro-batch's rows (a sum over rows): a full-batch step "
            "adds the window's sum, but accumulation weighs each micro-batch's term like its "
            "mean loss, so the window would add about 1/steps of it. Add the term as a mean "
            "over rows (ops.mean instead of ops.sum, and scale its coefficient by the batch "
            "size you tuned it for); pass count=... to AccumulatingModel only if you weigh "
            "it yourself"
        )
