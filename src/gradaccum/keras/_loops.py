"""`GradientWindow`: exact accumulation in hand-written `tf.GradientTape` and `jax.grad` loops.

The loop differentiates each micro-batch's loss *sum* (`loss_sum` gives it, with its count),
adds the gradients and the counts to the window, and divides once when the window closes. The
window is an immutable named tuple of tensors, so it works eagerly, inside `tf.function` and
through `jax.jit` (a named tuple is a JAX pytree).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
from keras import ops

from gradaccum.keras._counts import check_count
from gradaccum.keras._optimizer import dense

__all__ = ["GradientWindow"]


class GradientWindow(NamedTuple):
    """Summed micro-batch gradients, their summed count and how many micro-batches were added.

    Example:
        >>> import numpy as np
        >>> window = GradientWindow.zeros([np.zeros(2)])
        >>> window = window.add([np.array([2.0, 4.0])], count=2)   # gradient of a loss SUM
        >>> window = window.add([np.array([1.0, 2.0])], count=1)
        >>> [keras.ops.convert_to_numpy(g).tolist() for g in window.mean()]
        [[1.0, 2.0]]
    """

    sums: Any
    count: Any
    micro_batches: Any

    @classmethod
    def zeros(cls, like: Any, count_dtype: str | None = None) -> GradientWindow:
        """An empty window shaped like `like` (the variables, or one set of gradients).

        Args:
            like: a structure (list, dict, pytree) of variables or tensors.
            count_dtype: the count's dtype; defaults to `keras.config.floatx()`.
        """
        sums = keras.tree.map_structure(
            lambda v: ops.zeros(tuple(v.shape), dtype=keras.backend.standardize_dtype(v.dtype)),
            like,
        )
        dtype = count_dtype or keras.config.floatx()
        return cls(sums, ops.zeros((), dtype), ops.zeros((), "int32"))

    def add(self, grads: Any, count: Any) -> GradientWindow:
        """This window plus one micro-batch.

        Args:
            grads: the gradients of the micro-batch's loss **sum** (not its mean), shaped like
                `sums`; None entries (unused variables) add nothing.
            count: the items that sum covers (`loss_sum`'s count; a row count for per-row losses).
        """
        flat_sums = keras.tree.flatten(self.sums)
        flat_grads = keras.tree.flatten(grads)
        if len(flat_grads) != len(flat_sums):
            raise ValueError(
                f"got {len(flat_grads)} gradients for a window of {len(flat_sums)} tensors; pass "
                "the gradients of the same variables the window was made for"
            )
        check_count(count, "count")
        dense_grads = [None if g is None else dense(g) for g in flat_grads]
        _check_shapes(flat_sums, dense_grads)
        summed = [
            s if g is None else ops.add(s, ops.cast(g, s.dtype))
            for s, g in zip(flat_sums, dense_grads, strict=True)
        ]
        return GradientWindow(
            keras.tree.pack_sequence_as(self.sums, summed),
            ops.add(self.count, ops.cast(count, self.count.dtype)),
            ops.add(self.micro_batches, 1),
        )

    def mean(self) -> Any:
        """The window's gradient: `sums / count` (zeros for a window that counted nothing)."""
        return keras.tree.map_structure(
            lambda s: ops.divide_no_nan(s, ops.cast(self.count, s.dtype)), self.sums
        )

    def ok(self) -> Any:
        """A boolean tensor: the window counted something and every gradient is finite."""
        finite = [ops.all(ops.isfinite(s)) for s in keras.tree.flatten(self.sums)]
        return ops.logical_and(ops.all(ops.stack(finite)), ops.greater(self.count, 0))

    def apply(self, optimizer: Any, variables: Any) -> bool:
        """Eagerly step `optimizer` once on `mean()` unless the window is empty or non-finite.

        Args:
            optimizer: a `keras.optimizers.Optimizer`.
            variables: the variables, in the order of `sums`.

        Returns:
            True if the optimizer stepped; a skipped window leaves everything untouched.
        """
        if not bool(ops.convert_to_numpy(self.ok())):
            return False
        optimizer.apply(keras.tree.flatten(self.mean()), keras.tree.flatten(variables))
        return True


def _check_shapes(sums: list[Any], grads: list[Any]) -> None:
    """Refuse gradients shaped unlike their slots, which adding would broadcast silently.

    Swapped gradients added a bias gradient to every row of a kernel's slot and grew the bias's
    slot to the kernel's shape. Dimensions unknown while tracing are not compared.
    """
    for index, (total, grad) in enumerate(zip(sums, grads, strict=True)):
        if grad is None:
            continue
        try:
            want, got = tuple(total.shape), tuple(grad.shape)
        except (TypeError, ValueError):  # a traced tensor of unknown rank: not checked
            continue
        if len(want) != len(got) or any(
            a is not None and b is not None and a != b for a, b in zip(want, got, strict=True)
        ):
            raise ValueError(
                f"gradient {index} has shape {got} but the window's tensor {index} has shape "
                f"{want}; pass the gradients in the order of the variables the window was made "
                "for (GradientWindow.zeros(variables), then tape.gradient(total, variables))"
            )
