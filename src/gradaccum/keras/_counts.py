"""The sum and the count behind a Keras loss, so that a window divides once, by its own count.

A Keras loss with a mean reduction returns `sum / divisor` for its batch. The divisor depends on
the reduction, the mask of `y_pred` (`mask_zero=True` embeddings, `Masking` layers) and, for
`"mean_with_sample_weight"`, on the sample weights. `loss_sum` rebuilds that divisor, the
*count*, with Keras's own reduction code, so that `sum(sums) / sum(counts)` over the micro-batches
of a window equals the loss Keras computes on the whole window at once.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops
from keras.src.backend import get_keras_mask
from keras.src.losses.loss import squeeze_or_expand_to_same_rank
from keras.src.trainers.compile_utils import get_loss

from gradaccum._warnings import warn_user

__all__ = [
    "MEAN_REDUCTIONS",
    "LABEL_COUNTED",
    "check_count",
    "count_of",
    "ignoring_losses",
    "loss_count",
    "loss_sum",
    "masked_outputs",
    "resolve_loss",
    "varying_count",
    "warn_whole_batch",
    "whole_batch_losses",
]

#: Reductions whose batch value is a mean, so a window can divide once by its total count.
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
#: `varying_count`'s reason for a loss that drops entries by their label: each such loss counts
#: its own labels' entries, so two of them count different items too.
LABEL_COUNTED = "ignore_class (it counts the entries its labels keep)"


def check_count(count: Any, what: str) -> None:
    """Refuse a count that is not one number, before it reaches a window.

    A string or None fails far from the cause (or, on JAX, a string is read as a number); a
    count with a batch dimension broadcasts: the window's count, or (in `fit`) the loss itself,
    which then repeats once per entry and its gradient with it.

    Args:
        count: the micro-batch's count.
        what: how the message names it (`"count"`, or the `count=` function's result).
    """
    if count is None or isinstance(count, str | bytes | bool):
        raise TypeError(
            f"{what}={count!r} must be a number or a 0-dim tensor: the items the micro-batch's "
            "loss sum covers (loss_sum's second value)"
        )
    try:
        shape = tuple(getattr(count, "shape", ()))
    except (TypeError, ValueError):  # a traced tensor of unknown rank: not checked
        return
    if len(shape) > 0:
        raise ValueError(
            f"{what} has shape {shape}; it must be one number (0-dim), the micro-batch's total: "
            "pass keras.ops.sum(...) of the per-row counts"
        )


def resolve_loss(loss: Any, y_true: Any = None, y_pred: Any = None) -> Any:
    """A `keras.losses.Loss` for `loss`: a `Loss`, a name such as `"mse"`, or a function.

    Raises:
        ValueError: if the loss reduction is not a mean (`"sum"`, `None`, `"none"`), since then
            there is no count to divide by.
    """
    resolved = loss if isinstance(loss, keras.losses.Loss) else get_loss(loss, y_true, y_pred)
    if resolved is None:
        raise ValueError("loss=None has no count; pass a loss such as 'mse' or a keras Loss")
    if resolved.reduction not in MEAN_REDUCTIONS:
        raise ValueError(
            f"loss {resolved.name!r} has reduction={resolved.reduction!r}; gradaccum.keras "
            f"divides each window once by its count, so the reduction must be one of "
            f"{MEAN_REDUCTIONS}; use the default 'sum_over_batch_size'"
        )
    return resolved


def _values_and_mask(loss: Any, y_true: Any, y_pred: Any) -> tuple[Any, Any]:
    """The per-element losses and the mask Keras combines from `y_pred` and from them."""
    in_mask = get_keras_mask(y_pred)
    y_pred = keras.tree.map_structure(lambda v: ops.convert_to_tensor(v, loss.dtype), y_pred)
    y_true = keras.tree.map_structure(lambda v: ops.convert_to_tensor(v, loss.dtype), y_true)
    values = loss.call(y_true, y_pred)
    out_mask = get_keras_mask(values)
    if in_mask is not None and out_mask is not None:
        return values, in_mask & out_mask
    return values, in_mask if in_mask is not None else out_mask


def _size(x: Any, dtype: str) -> Any:
    return ops.cast(ops.prod(ops.convert_to_tensor(ops.shape(x), dtype="int32")), dtype)


def _weights(values: Any, mask: Any, sample_weight: Any) -> Any:
    """Sample weights times the float mask, shaped for `values`, or None (never in place)."""
    dtype = values.dtype
    weights = None if mask is None else ops.cast(mask, dtype)
    if sample_weight is not None:
        sample_weight = ops.cast(sample_weight, dtype)
        if weights is None:
            weights = sample_weight
        else:
            weights, sample_weight = squeeze_or_expand_to_same_rank(weights, sample_weight)
            weights = ops.multiply(sample_weight, weights)
    if weights is not None:
        _, weights = squeeze_or_expand_to_same_rank(values, weights)
    return weights


def _rows(y_pred: Any, dtype: str) -> Any:
    first = keras.tree.flatten(y_pred)[0]
    return ops.cast(ops.shape(first)[0], dtype)


def _count(loss: Any, values: Any, mask: Any, sample_weight: Any, y_pred: Any) -> Any:
    """The divisor Keras's reduction applies to `values` (see `keras.src.losses.loss`)."""
    dtype = values.dtype
    if len(values.shape) == 0:
        # A loss function that reduces the batch itself (`ops.mean(...)` over everything):
        # Keras does not divide it again. It is a mean over the rows (times a fixed size) for
        # the usual such function, so count the rows: a micro-batch then weighs by its size,
        # and a short last micro-batch is not weighed as a full one.
        return _rows(y_pred, dtype)
    if loss.reduction == "mean_with_sample_weight":
        weights = _weights(values, mask, sample_weight)
        return _size(values, dtype) if weights is None else ops.sum(weights)
    if mask is None:
        return _size(values, dtype)
    # Keras weighs valid entries by size(mask) / valid, then divides by size(values).
    valid = ops.sum(ops.cast(mask, dtype))
    return ops.divide(ops.multiply(_size(values, dtype), valid), _size(mask, dtype))


def loss_count(loss: Any, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
    """The count of items Keras divides `loss`'s sum by on this batch, as a scalar tensor.

    Args:
        loss: a `keras.losses.Loss`, a loss name (`"sparse_categorical_crossentropy"`) or a
            loss function; its reduction must be a mean (`MEAN_REDUCTIONS`).
        y_true: the targets.
        y_pred: the predictions; a Keras mask on them (for example from
            `Embedding(mask_zero=True)`) excludes the masked entries from the count.
        sample_weight: optional weights; they change the count only for
            `reduction="mean_with_sample_weight"`, as in Keras.

    Returns:
        A 0-dim float tensor: the number of loss entries (or the summed weights) counted.

    Example:
        >>> import numpy as np
        >>> float(loss_count("mse", np.zeros((3, 2)), np.ones((3, 2))))
        3.0
    """
    warn_whole_batch(loss)
    return count_of(loss, y_true, y_pred, sample_weight)


def count_of(loss: Any, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
    """`loss_count` without its warning: `fit` warned about a batch Dice at `compile()`."""
    loss = resolve_loss(loss, y_true, y_pred)
    values, mask = _values_and_mask(loss, y_true, y_pred)
    return _count(loss, values, mask, sample_weight, y_pred)


def loss_sum(loss: Any, y_true: Any, y_pred: Any, sample_weight: Any = None) -> tuple[Any, Any]:
    """The sum and the count of `loss` on a batch: Keras's value for it is `sum / count`.

    Use it in a hand-written loop: differentiate the sum, add the counts, and divide the window's
    summed gradient once by the window's count (`GradientWindow` does that). Masks on `y_pred`
    and sample weights are counted exactly as Keras counts them.

    Args:
        loss: a `keras.losses.Loss`, a loss name or a loss function (mean reduction).
        y_true: the targets.
        y_pred: the predictions (a Keras mask on them is honoured).
        sample_weight: optional per-item or per-token weights.

    Returns:
        `(sum, count)`, two 0-dim tensors.

    Example:
        >>> import numpy as np
        >>> total, count = loss_sum("mse", np.zeros((4, 1)), np.full((4, 1), 2.0))
        >>> float(total), float(count)
        (16.0, 4.0)
    """
    warn_whole_batch(loss)
    loss = resolve_loss(loss, y_true, y_pred)
    values, mask = _values_and_mask(loss, y_true, y_pred)
    weights = _weights(values, mask, sample_weight)
    count = _count(loss, values, mask, sample_weight, y_pred)
    if len(values.shape) == 0:  # a batch mean already: Keras's value on it, times its rows
        return ops.multiply(loss(y_true, y_pred, sample_weight=sample_weight), count), count
    total = ops.sum(values if weights is None else ops.multiply(values, weights))
    return total, count


def _ignore_class(loss: Any) -> Any:
    """The class a Keras loss drops by label (`SparseCategoricalCrossentropy(ignore_class=0)`)."""
    found = getattr(loss, "ignore_class", None)
    if found is None:
        found = (getattr(loss, "_fn_kwargs", None) or {}).get("ignore_class")
    return found


def ignoring_losses(loss: Any) -> list[str]:
    """The losses, among several compiled ones, that drop entries by label (`ignore_class`).

    Each counts the entries its own labels keep, which no other loss counts alike, so one
    window count cannot divide them all: found at `compile()` from the loss structure alone.
    """
    if isinstance(loss, dict):
        items = [(str(key), item) for key, item in loss.items() if item is not None]
    elif isinstance(loss, list | tuple):
        items = [(f"loss[{i}]", item) for i, item in enumerate(loss) if item is not None]
    else:
        return []
    if len(items) < 2:
        return []
    return [name for name, item in items if _ignore_class(item) is not None]


def varying_count(
    loss: Any, y_pred: Any, sample_weight: Any = None, y_true: Any = None
) -> str | None:
    """Why `loss`'s count may not be its batch's rows times a fixed size, or None if it is.

    Read when a step is traced: a Keras mask on `y_pred` (unmasked entries), a loss that drops
    entries by label (`ignore_class`, or a mask the loss puts on its values, read when `y_true`
    is given: `LABEL_COUNTED`) or the `"mean_with_sample_weight"` reduction (summed weights)
    make the count vary from batch to batch apart from the rows; several such losses cannot
    share one window count.

    Example:
        >>> import numpy as np
        >>> varying_count("mse", np.ones((2, 1))) is None
        True
    """
    resolved = resolve_loss(loss)
    if _ignore_class(resolved) is not None:
        return LABEL_COUNTED
    if y_true is not None:
        values, _ = _values_and_mask(resolved, y_true, y_pred)
        if get_keras_mask(values) is not None:  # a loss function that masks by label itself
            return LABEL_COUNTED
    if get_keras_mask(y_pred) is not None:
        return "a masked output (it counts unmasked entries)"
    if resolved.reduction == "mean_with_sample_weight" and sample_weight is not None:
        return "reduction='mean_with_sample_weight' (it counts the summed weights)"
    return None


def masked_outputs(model: Any, loss: Any, *, every: bool = False) -> list[str]:
    """The masked outputs next to unmasked ones that `loss` scores, from a built model's graph.

    A functional or Sequential model knows its outputs' Keras masks before any data flows, so
    losses that would count differently (see `varying_count`) are found at `compile()`.
    Models without symbolic outputs (subclassed) return [] here and are checked at the first
    step instead. With `every`, the scored outputs that are masked, even if all are.
    """
    try:
        outputs = model.output
    except (AttributeError, ValueError):  # a Sequential's are in `outputs`; subclassed: none
        outputs = getattr(model, "outputs", None)
        if not outputs:
            return []
    names = list(getattr(model, "output_names", None) or [])
    flat = keras.tree.flatten(outputs)
    if isinstance(outputs, dict):
        named = dict(outputs)
    else:
        named = {names[i] if i < len(names) else str(i): out for i, out in enumerate(flat)}
    if isinstance(loss, dict):
        scored = [key for key, item in loss.items() if item is not None and key in named]
    elif isinstance(loss, list | tuple):
        scored = [key for key, item in zip(named, loss, strict=False) if item is not None]
    else:
        scored = list(named) if loss is not None else []
    masked = [key for key in scored if get_keras_mask(named[key]) is not None]
    if every:  # the masked ones, even if all are (they count unmasked entries, not rows)
        return masked
    return masked if 0 < len(masked) < len(scored) else []  # all masked: alike


def whole_batch_losses(loss: Any) -> list[str]:
    """Keras's Dice and Tversky losses left at `axis=None`, in a compile `loss=` structure.

    With `axis=None` (their default) they return one ratio of sums over the whole batch, which
    does not add up over micro-batches: a window weighs each micro-batch's ratio by its rows.

    Example:
        >>> import keras
        >>> whole_batch_losses({"mask": keras.losses.Dice(), "cls": "mse"})
        ['dice']
        >>> whole_batch_losses(keras.losses.Dice(axis=(1, 2)))
        []
    """
    found = []
    for item in keras.tree.flatten(loss):
        if isinstance(item, str):
            try:
                item = keras.losses.get(item)
            except ValueError:  # Keras's compile reports an unknown name
                continue
        fn = getattr(item, "fn", item)
        axis = (getattr(item, "_fn_kwargs", None) or {}).get("axis")
        if fn in (keras.losses.dice, keras.losses.tversky) and axis is None:
            found.append(str(getattr(item, "name", None) or fn.__name__))
    return found


def warn_whole_batch(loss: Any) -> None:
    """Warn about each batch Dice or Tversky (`axis=None`) in `loss`: it does not accumulate.

    `compile()` warns for `fit`; `loss_sum` and `loss_count` warn for a hand-written loop, which
    otherwise took the batch ratio for a row mean and weighed each micro-batch's by its rows.
    """
    for name in whole_batch_losses(loss):
        warn_user(
            UserWarning(
                f"loss {name!r} with axis=None is one ratio of sums over the whole batch (a "
                "batch Dice), which does not add up over micro-batches: each window weighs "
                "its micro-batches' ratios by their rows, not the full batch's ratio. Pass "
                "axis= the per-sample axes (keras.losses.Dice(axis=(1, 2, 3)) for images) "
                "for a per-sample loss that accumulates exactly"
            )
        )
