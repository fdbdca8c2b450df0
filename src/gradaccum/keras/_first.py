"""The loss terms a model adds itself, read on the first real batch when `compile()` could not.

`compile()` reads a functional or Sequential model's `add_loss` terms on random rows of its
symbolic inputs (`_added.py`). A subclassed model has none, and some models cannot run on
random rows (string inputs, a fixed batch size, ids out of range): their terms are read on rows
of the first real batch instead, when `fit` or `train_on_batch` starts, before any step (a
sum over rows refused, nothing trained). The batch is peeked without consuming it: arrays are
sliced, a `PyDataset` indexed, a `tf.data.Dataset` read by a fresh iterator, and a generator's
first batch is put back in front of it (if the terms are refused, that batch is gone from the
user's generator, which cannot be peeked: the error says to pass a new one). Anything else (a
torch `DataLoader`) is not read, and a model with code of its own (a subclass or a custom
layer) is then warned about: its terms are weighed like its mean loss, unchecked.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import keras

from gradaccum._warnings import warn_user
from gradaccum.keras._added import ROW_MEAN, check_summed_terms, read_terms

__all__ = ["check_first_batch", "first_inputs"]


def _inputs_of(element: Any) -> Any:
    """A dataset element's inputs: `x` of `(x, y)` or `(x, y, sample_weight)`, as Keras reads it."""
    if isinstance(element, (tuple, list)):
        return keras.utils.unpack_x_y_sample_weight(tuple(element))[0]
    return element


def first_inputs(x: Any) -> tuple[Any, Any]:
    """(inputs of `x`'s first batch, or None if unreadable; `x` to pass on to Keras)."""
    if x is None:
        return None, x
    if isinstance(x, keras.utils.PyDataset):
        return _inputs_of(x[0]), x
    if type(x).__module__.startswith("tensorflow") and hasattr(x, "take"):  # tf.data
        return _inputs_of(next(iter(x.take(1)))), x
    if isinstance(x, (types.GeneratorType, Iterator)):
        try:
            first = next(x)
        except StopIteration:
            return None, x

        def replay() -> Any:  # the peeked batch first: Keras sees the generator unchanged
            yield first
            yield from x

        return _inputs_of(first), replay()
    leaves = keras.tree.flatten(x)
    if leaves and all(len(getattr(leaf, "shape", ())) >= 1 for leaf in leaves):
        return x, x  # arrays or tensors: the first rows are rows of the first batch
    return None, x


def _own_code(model: Any) -> list[str]:
    """Layers (the model included) whose class is not Keras's own: only those call add_loss."""
    return [
        type(layer).__name__
        for layer in model._flatten_layers(include_self=True)
        if not type(layer).__module__.startswith("keras.")
    ]


def _build(model: Any, batch: Any) -> None:
    """Build an unbuilt model symbolically on the batch's shapes, as Keras's `fit` would."""
    from keras.src import backend as keras_backend

    def spec(leaf: Any) -> Any:
        return None if leaf is None else keras.KerasTensor(leaf.shape, leaf.dtype)

    keras_backend.compute_output_spec(model, keras.tree.map_structure(spec, batch), training=False)


def check_first_batch(trainer: Any, x: Any) -> Any:
    """Read the model's added terms on `x`'s first batch if `compile()` could not; return `x`.

    Refuses a sum over rows (`ValueError`, nothing trained); a mean over rows is then checked at
    the first step like an activity regularizer. Warns (once) if the terms cannot be read.
    """
    if trainer._terms_read or trainer._count_fn is not None:
        return x
    given = x
    batch, x = first_inputs(x)
    model = trainer.model
    kinds, why = None, "its inputs are not arrays, a PyDataset, a tf.data.Dataset or a generator"
    if batch is not None:
        if not all(layer.built for layer in model._flatten_layers()):
            try:
                _build(model, batch)
            except Exception as error:  # Keras's own fit reports it
                why = f"{type(error).__name__}: {str(error)[:200]}"
                batch = None
        if batch is not None:
            kinds, why = read_terms(model, batch)
    trainer._terms_read = True
    if kinds is None:
        own = _own_code(model)
        if own:
            shown = ", ".join(own[:3]) + (", ..." if len(own) > 3 else "")
            warn_user(
                UserWarning(
                    f"gradaccum.keras could not read the loss terms that {shown} may add "
                    f"(self.add_loss) on the first batch ({why}); they are weighed like the "
                    "micro-batch's mean loss, unchecked: a term that sums over the rows would "
                    "be about 1/steps of the full-batch one. Write such terms as ops.mean over "
                    "rows, or pass count=... to AccumulatingModel to say you checked them"
                )
            )
        return x
    try:
        check_summed_terms(kinds)
    except ValueError as error:
        trainer._terms_read = False  # refused: the next fit reads again
        if x is not given:  # a generator cannot be peeked: say its first batch was read
            raise ValueError(
                f"{error}. (This was read on the generator's first batch, which it has now "
                "yielded: pass a new generator to the next fit)"
            ) from None
        raise
    if ROW_MEAN in kinds:  # checked at the first step against the compiled loss's count
        trainer._added = trainer._activity = True
    return x
