"""Checks `AccumulatingModel` runs on the model and options it is given, before anything changes.

Each refusal names the fix; a refused wrap or compile leaves the model, its weights and its
optimizer as they were.
"""

from __future__ import annotations

import numbers
from typing import Any

import keras

from gradaccum._batch_sizes import _whole
from gradaccum._warnings import warn_user
from gradaccum.batchnorm import BatchNormAccumulationWarning
from gradaccum.keras._norms import training_norms

__all__ = [
    "PARTIAL_WINDOWS",
    "check_batch_size",
    "check_no_builtin_accumulation",
    "check_options",
    "check_single_replica",
    "check_standard_steps",
    "warn_batchnorm",
]

PARTIAL_WINDOWS = ("step", "drop", "carry")
# The training steps the wrapper runs in the model's place: an override of one of them on the
# wrapped model would be skipped silently, so the wrapper would train a different loss.
_REPLACED = ("train_step", "compute_loss")


def check_options(model: Any, steps: Any, partial_window: Any, count: Any, wrapper: type) -> None:
    """Refuse a model that is not a `keras.Model` (or is wrapped already) and bad options."""
    if not isinstance(model, keras.Model) or isinstance(model, wrapper):
        raise TypeError(
            f"model must be a keras.Model (not yet wrapped), got {type(model).__name__}; "
            "pass the model you would call fit() on"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        # A numpy or float 3 is not refused unexplained: the message names the int to pass.
        fix = (
            ""
            if isinstance(steps, int)
            else f", got {type(steps).__name__}: pass steps={_whole(steps)}"
        )
        raise ValueError(
            f"steps={steps!r} must be a positive int: micro-batches per optimizer step{fix}"
        )
    if partial_window not in PARTIAL_WINDOWS:
        raise ValueError(
            f"partial_window={partial_window!r} must be one of {PARTIAL_WINDOWS}: what the end "
            "of an epoch does to an open window"
        )
    if count is not None and not callable(count):
        raise TypeError(
            f"count must be None or a function (x, y, y_pred, sample_weight) -> count, "
            f"got {type(count).__name__}"
        )
    check_standard_steps(model)


def check_no_builtin_accumulation(optimizer: Any, steps: int) -> None:
    """Refuse an optimizer that accumulates by itself, even inside a `LossScaleOptimizer`.

    The window steps the optimizer once per `steps` micro-batches; Keras's own
    `gradient_accumulation_steps=n` would then average n windows' gradients and step once per n
    windows, silently.
    """
    while optimizer is not None:
        builtin = getattr(optimizer, "gradient_accumulation_steps", None)
        if builtin:
            raise ValueError(
                f"the optimizer {type(optimizer).__name__} has gradient_accumulation_steps="
                f"{builtin}; remove it: AccumulatingModel(steps={steps}) accumulates exactly "
                "instead"
            )
        optimizer = getattr(optimizer, "inner_optimizer", None)


def check_batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a `fit` micro-batch size that is not a positive int, before anything trains.

    Keras's own errors for these are far from the cause (on TensorFlow, `batch_size=0` even
    trains on a batch of all the data).
    """
    size = args[2] if len(args) > 2 else kwargs.get("batch_size")
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError(
            f"batch_size={size!r} must be a positive int (items per micro-batch) or None, got "
            f"{type(size).__name__}; the optimizer steps once per `steps` micro-batches"
        )
    if size < 1:
        raise ValueError(
            f"batch_size={size!r} must be a positive int: the items per micro-batch, e.g. "
            "batch_size=8 (the optimizer steps once per `steps` micro-batches)"
        )


def check_standard_steps(model: Any) -> None:
    """Refuse a model whose class overrides `train_step` or `compute_loss`.

    The wrapper trains with Keras's standard `train_step` and its own `compute_loss` (which
    adds the count probe); the wrapped model's overrides would never run, so its custom loss
    would be silently replaced by the compiled one (or by none).
    """
    overridden = [
        name for name in _REPLACED if getattr(type(model), name) is not getattr(keras.Model, name)
    ]
    if overridden:
        names = " and ".join(f"{type(model).__name__}.{name}" for name in overridden)
        raise TypeError(
            f"{names} would be ignored: AccumulatingModel trains with Keras's standard "
            "train_step and the compiled loss, so accumulation would train a different loss. "
            "Subclass AccumulatingModel and override compute_loss there (return "
            "super().compute_loss(...) plus your terms, each a mean over the compiled loss's "
            "items, else pass count=...), or accumulate by hand with gradaccum.keras.GradientWindow"
        )


def check_single_replica() -> None:
    """Refuse data-parallel training: the counts would be reduced differently from the sums."""
    replicas = 1
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1 or keras.distribution.distribution() is not None:
        raise NotImplementedError(
            "AccumulatingModel runs on one device: under a tf.distribute strategy or a "
            "keras.distribution the gradients are all-reduced every micro-batch and the count "
            "probe is not; compile outside the strategy's scope"
        )


def warn_batchnorm(model: Any, steps: int, warned: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Warn that BatchNormalization normalizes each micro-batch alone (not additive).

    Only trainable layers that run in training mode: a frozen one (`trainable=False`, as in
    transfer learning), or one the model calls with `training=False` itself (a subclassed
    model's fine-tuning recipe), runs on its moving statistics and accumulates exactly. Called
    when wrapping and again at `compile()` (a layer unfrozen in between); layers in `warned` are
    not named again.

    Returns:
        The names of the trainable BatchNormalization layers (warned now or before).
    """
    trainable = [
        layer
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
    ]
    unwarned = [layer for layer in trainable if layer.name not in warned] if steps > 1 else []
    # A layer the model calls with training=False itself runs on its moving statistics: exact.
    norms = [layer.name for layer in training_norms(model, unwarned)]
    new = [name for name in norms if name not in warned]
    if new:
        shown = ", ".join(new[:3]) + (", ..." if len(new) > 3 else "")
        warn_user(
            BatchNormAccumulationWarning(
                f"BatchNormalization layers ({shown}) normalize each micro-batch with its own "
                f"statistics while the optimizer step covers {steps} micro-batches: accumulation "
                "is not exact, and their moving statistics update once per micro-batch. Use "
                "GroupNormalization or LayerNormalization for exact accumulation (frozen layers, "
                "trainable=False, run on their moving statistics and are exact)."
            )
        )
    return tuple(warned) + tuple(new)
