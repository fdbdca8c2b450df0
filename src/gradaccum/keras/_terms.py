"""Loss terms Keras adds beside the compiled loss, and the counts they can share a window with.

Keras adds `model.losses` to the compiled loss of every batch: weight regularizers (one value
per step, exact under any count) and activity regularizers, which Keras 3 divides by the
batch's rows (a mean over rows). A window multiplies each micro-batch's whole loss by the
compiled loss's count, so a per-row term is exact only when that count is the rows (times a
fixed size); next to a loss counting masked tokens, summed sample weights or the entries its
labels keep, the term is weighed by those instead (0.1 off on a token model, silently).
"""

from __future__ import annotations

from typing import Any

import keras

from gradaccum.keras._counts import LABEL_COUNTED, _ignore_class, masked_outputs

__all__ = ["activity_regularized", "check_activity_terms", "compile_time_kind"]


def activity_regularized(model: Any) -> list[str]:
    """The names of `model`'s layers (itself included) that have an `activity_regularizer`."""
    layers = model._flatten_layers(include_self=True)
    return [layer.name for layer in layers if getattr(layer, "activity_regularizer", None)]


def check_activity_terms(model: Any, kind: str | None, *, added: bool = False) -> None:
    """Refuse per-row added terms next to a compiled loss that counts other items than rows.

    Args:
        model: the wrapped model.
        kind: what the compiled loss counts besides rows (`varying_count`'s reason), or None.
        added: the model adds a loss term that is a mean over rows (`self.add_loss(...)` in a
            layer; found by `_added.added_terms`).
    """
    layers = activity_regularized(model) if kind else []
    if kind and added and not layers:
        raise ValueError(
            "the model adds a loss term (self.add_loss(...) in a layer) that is a mean over the "
            f"micro-batch's rows, next to a compiled loss that counts {kind}: one window count "
            "cannot divide both, so accumulation would not be exact. Add the term in a subclass "
            "of AccumulatingModel (compute_loss: super().compute_loss(...) plus the term as a "
            "mean over the compiled loss's items), or pass count=... to AccumulatingModel if you "
            "know the counts stay proportional"
        )
    if layers:
        shown = ", ".join(layers[:3]) + (", ..." if len(layers) > 3 else "")
        raise ValueError(
            f"layers ({shown}) have an activity_regularizer, which Keras divides by the "
            f"micro-batch's rows, next to a compiled loss that counts {kind}: one window count "
            "cannot divide both, so accumulation would not be exact. Remove activity_regularizer= "
            "and add the penalty in a subclass of AccumulatingModel (compute_loss: "
            "super().compute_loss(...) plus the penalty as a mean over the compiled loss's "
            "items), or pass count=... to AccumulatingModel if you know the counts stay "
            "proportional"
        )


def compile_time_kind(model: Any, loss: Any) -> str | None:
    """What the compiled losses count besides rows, as far as `compile()` can tell, or None.

    A functional or Sequential model's output masks are known then, and so is `ignore_class`;
    summed sample weights (`"mean_with_sample_weight"`) are found at the first step.
    """
    if masked_outputs(model, loss, every=True):
        return "a masked output (it counts unmasked entries)"
    if any(_ignore_class(item) is not None for item in keras.tree.flatten(loss) if item):
        return LABEL_COUNTED
    return None
