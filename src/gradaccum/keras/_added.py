"""What the loss terms a model adds itself (`add_loss`, regularizers) weigh, read on tiny batches.

Keras adds `model.losses` to the compiled loss of every batch, once. A window weighs each
micro-batch's whole loss by the compiled loss's count and divides by the window's count, so a
term is exact when it is a constant per batch (a weight penalty) or a mean over the compiled
loss's items. A term that SUMS over the rows (`self.add_loss(ops.sum(...))`) is averaged over the
window's micro-batches instead of summed over its rows: the full-batch step adds the window's sum,
the window about 1/steps of it (a 0.4-0.5 gap, silently). A term that is a mean over rows is exact
beside a compiled loss that counts rows, and not beside one counting other items.

`added_terms` tells them apart without changing any state: it runs the model statelessly
(`stateless_call`, inference mode) on one row, on that row twice, and on another row; then in
training mode too, for the sums a layer adds only when training (`if training: add_loss(...)`),
which inference mode does not show (a 0.2 gap, silently, before the sixteenth round). The rows
are random for a functional or Sequential model at `compile()` (token inputs: ids 1 and 2), or
rows of a real batch (`batch`: a subclassed model, read at its first `fit`/`train_on_batch`). A
sum over rows doubles on the doubled row; a mean over rows does not, but changes with the row;
a constant changes with neither.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

__all__ = ["ROW_MEAN", "SUMMED", "added_terms", "check_summed_terms", "read_terms"]

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


def _real_rows(batch: Any, rows: list[int]) -> Any:
    """Rows `rows` of every input of a real batch (numpy arrays or tensors, nested alike)."""

    def take(leaf: Any) -> Any:
        return None if leaf is None else np.asarray(ops.convert_to_numpy(leaf))[rows]

    return keras.tree.map_structure(take, batch)


def _terms(model: Any, inputs: Any, training: bool = False) -> list[float]:
    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]
    # stateless_call runs `call` itself, which may take no `training` argument, and does not
    # clear the ids of the terms its own call added before: one reused by a sublayer's new term
    # would count that term twice (TensorFlow).
    model._clear_losses()
    if training:  # through __call__: it sets `training` for the layers of a call without one
        mapping = list(zip(model.trainable_variables + model.non_trainable_variables,
                           trainable + frozen, strict=True))  # fmt: skip
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True):
            model(inputs, training=True)
            losses = model.losses
        model._clear_losses()
    else:
        mode = {"training": False} if getattr(model, "_call_has_training_arg", True) else {}
        _, _, losses = model.stateless_call(trainable, frozen, inputs, return_losses=True, **mode)
    return [float(np.sum(ops.convert_to_numpy(term))) for term in losses]


def _rows_of(model: Any, batch: Any, rows: list[int]) -> Any:
    """Rows `rows` of a real `batch`, or random rows of the model's symbolic inputs."""
    return _inputs(model, rows) if batch is None else _real_rows(batch, rows)


def _kinds(one: list[float], twice: list[float], other: list[float]) -> list[str] | None:
    """Classify each term from its values on a row, that row twice, and another row."""
    if not (len(one) == len(twice) == len(other)):
        return None
    if not np.all(np.isfinite(one + twice + other)):  # random rows out of the model's domain
        return None
    kinds = []
    for a, b, c in zip(one, twice, other, strict=True):
        scale = max(abs(a), abs(c), 1e-30)
        if abs(a) > 1e-12 and abs(b - 2 * a) <= 0.05 * abs(a):
            kinds.append(SUMMED)
        elif abs(b - a) <= 1e-3 * scale and abs(c - a) > 1e-6 * scale:
            kinds.append(ROW_MEAN)
    return kinds


def _training_sums(model: Any, batch: Any, second: int) -> int:
    """How many terms sum over rows in training mode: `add_loss` calls under `if training:`.

    Dropout draws other masks for a doubled row, so a term counts as a sum only if it doubles
    on both rows doubled (a mean over rows is not refused by chance); a term it hides is
    unchecked, as before. 0 if training mode cannot run statelessly on these rows.
    """
    try:
        one, twice, other, other_twice = (
            _terms(model, _rows_of(model, batch, r), training=True)
            for r in ([0], [0, 0], [second], [second, second])
        )
    except Exception:  # inference mode was read: what training mode adds stays unchecked
        return 0
    first, again = _kinds(one, twice, other), _kinds(other, other_twice, one)
    if first is None or again is None or len(first) != len(again):
        return 0
    doubled = [
        abs(a) > 1e-12 and abs(b - 2 * a) <= 0.05 * abs(a) and abs(d - 2 * c) <= 0.05 * abs(c)
        for a, b, c, d in zip(one, twice, other, other_twice, strict=True)
    ]
    return sum(doubled)


def read_terms(model: Any, batch: Any = None) -> tuple[list[str] | None, str]:
    """`added_terms`, and why they could not be read (`(None, reason)`) if they could not."""
    if batch is None and (not model.built or not getattr(model, "inputs", None)):
        return None, "the model has no symbolic inputs (a subclassed or unbuilt model)"
    second = 1 if batch is None or len(keras.tree.flatten(batch)[0]) > 1 else 0
    try:
        one, twice, other = (
            _terms(model, _rows_of(model, batch, r)) for r in ([0], [0, 0], [second])
        )
    except Exception as error:  # a model this cannot feed: said so by the caller
        return None, f"{type(error).__name__}: {str(error)[:200]}"
    kinds = _kinds(one, twice, other)
    if kinds is None:
        if len(one) == len(twice) == len(other):
            return None, "a term was not finite on these rows"
        return None, "the model added a different number of terms on different rows"
    extra = _training_sums(model, batch, second) - kinds.count(SUMMED)
    return kinds + [SUMMED] * max(extra, 0), ""


def added_terms(model: Any, batch: Any = None) -> list[str] | None:
    """The kinds of `model`'s added loss terms that depend on the batch (`SUMMED`, `ROW_MEAN`).

    Constants (weight regularizers) are left out. Without `batch` the rows are random rows of
    the model's symbolic inputs; with it, rows of that real batch's inputs (`x`). None when the
    terms cannot be read: a subclassed model without `batch`, or a call that fails.

    Example:
        >>> import keras
        >>> net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
        ...     2, activity_regularizer="l2", kernel_regularizer="l2")])
        >>> added_terms(net)
        ['row_mean']
    """
    return read_terms(model, batch)[0]


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
