"""Which BatchNormalization layers really normalize with batch statistics when `fit` trains.

A trainable `BatchNormalization` is not additive over micro-batches only if it runs in training
mode. A model may call it in inference mode itself: the fine-tuning recipe calls a base model
with `training=False` inside a subclassed model's `call`, and such a layer runs on its moving
statistics, exactly as in a plain `fit`. (In a functional model Keras 3 passes `fit`'s
`training=True` through to the base anyway, so there it does train, in a plain `fit` too.)
The layers' mode is read from one symbolic call of the model with `training=True`: nothing is
computed or changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from keras.src.backend import compute_output_spec

__all__ = ["training_norms"]


def training_norms(model: Any, norms: list[Any]) -> list[Any]:
    """The layers of `norms` that `model(x, training=True)` runs in training mode.

    Read from a symbolic call (the model's input specs, or the shape it was built with); if
    the model cannot be called so (unbuilt, several inputs of unknown kind), all of `norms`.
    """
    if not norms:
        return []
    specs = _input_specs(model)
    if specs is None:
        return list(norms)
    seen: set[int] = set()
    missing = object()
    own = {id(layer): layer.__dict__.get("call", missing) for layer in norms}
    for layer in norms:
        object.__setattr__(layer, "call", _recording(layer, seen))  # not tracked
    try:
        compute_output_spec(lambda x: model(x, training=True), specs)
    except Exception:  # any failure: keep the warning for every layer
        return list(norms)
    finally:
        for layer in norms:
            if own[id(layer)] is missing:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", own[id(layer)])
    return [layer for layer in norms if id(layer) in seen]


def _recording(layer: Any, seen: set[int]) -> Callable[..., Any]:
    original = type(layer).call.__get__(layer)

    def call(*args: Any, **kwargs: Any) -> Any:
        training = kwargs.get("training", args[1] if len(args) > 1 else None)
        if training is not None and training is not False and layer.trainable:
            seen.add(id(layer))
        return original(*args, **kwargs)

    return call


def _input_specs(model: Any) -> Any:
    """The model's symbolic inputs, or one input of the shape it was built with, or None."""
    try:
        return model.input  # functional or Sequential
    except Exception:  # no symbolic inputs (subclassed, or a Sequential without Input)
        shapes = getattr(model, "_build_shapes_dict", None) or {}
        if len(shapes) != 1:
            return None
        (shape,) = shapes.values()
        return keras.KerasTensor(tuple(shape), dtype=keras.config.floatx())
