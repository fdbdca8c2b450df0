"""`WindowOptimizer`: sums micro-batch gradients and counts, and steps the inner optimizer once.

Keras's trainers call `optimizer.apply` (TensorFlow, torch) or `optimizer.stateless_apply` (JAX)
once per micro-batch. This optimizer receives, besides the model's gradients, the gradient of the
count probe (see `_model.py`): the micro-batch's count times the loss scale. It adds
`count * gradient` to a running sum (the gradient of the micro-batch's loss *sum*) and the count
to a running count. When the window closes (`steps` micro-batches, or the end of an epoch) it
calls the inner optimizer once on `sum / count`: the gradient of the window's mean loss. So
schedules, EMA, bias correction, weight decay and clipping see one step per window.

Under `mixed_float16` the dynamic loss scale stays fixed inside a window; a window with a
non-finite gradient is skipped whole (no inner step) and the scale halves once. It subclasses
`LossScaleOptimizer` so Keras treats it as the model's loss-scaling optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import keras
from keras import ops
from keras.src.backend import StatelessScope
from keras.src.utils import tracking

__all__ = ["WindowOptimizer", "dense"]

_F = TypeVar("_F", bound=Callable[..., Any])
# Lists of variables assigned in `build` are not re-tracked (each is tracked by add_variable).
_untracked = cast(Callable[[_F], _F], tracking.no_automatic_dependency_tracking)


def dense(grad: Any) -> Any:
    """`grad` as a dense tensor: TensorFlow's IndexedSlices (embedding gradients) are expanded.

    A window adds gradients of several micro-batches; a dense sum is also what the full-batch
    optimizer step must see (Keras's Adam squares an IndexedSlices' duplicate rows one by one).

    Example:
        >>> import numpy as np
        >>> tuple(dense(np.ones((2, 3))).shape)
        (2, 3)
    """
    if type(grad).__name__ == "IndexedSlices":
        import tensorflow as tf

        return tf.convert_to_tensor(grad)
    return ops.convert_to_tensor(grad)


def _after(tensor: Any) -> contextlib.AbstractContextManager[Any]:
    """Run the block's ops only once `tensor` exists (TensorFlow), so they need the batch.

    At the end of a dataset of unknown length (a generator, a filtered `tf.data`), Keras's
    TensorFlow trainer calls the train function once more; fetching the batch fails, but
    inside the inlined step the variable updates that read no batch value (the window's
    micro-batch counter) still run. Tied to the batch's count, they no longer count a
    micro-batch that never came. Other backends run the step only for a real batch.
    """
    if keras.backend.backend() != "tensorflow":
        return contextlib.nullcontext()
    import tensorflow as tf

    dependencies: contextlib.AbstractContextManager[Any] = tf.control_dependencies([tensor])
    return dependencies


class WindowOptimizer(keras.optimizers.LossScaleOptimizer):
    """Accumulates a window of micro-batch gradients and steps `inner_optimizer` once on it.

    Built by `AccumulatingModel.compile`, around the optimizer given to it; not meant to be
    constructed by hand.

    Args:
        inner_optimizer: the optimizer that takes the real steps.
        steps: micro-batches per window.
        partial_window: what the end of an epoch does to an open window: `"step"`, `"drop"` or
            `"carry"`.
        probe_id: `id()` of the count probe variable, found among the variables at `build`.
        dynamic: dynamic loss scaling (`mixed_float16`); otherwise the scale is `static_scale`.
        initial_scale: the first dynamic loss scale.
        dynamic_growth_steps: finite windows after which the dynamic scale doubles.
        static_scale: a fixed loss scale (the inner optimizer's `loss_scale_factor`), or None.

    Example:
        >>> import keras
        >>> from gradaccum.keras import accumulate
        >>> net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> trainer = accumulate(net, steps=3)
        >>> trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        >>> type(trainer.optimizer).__name__, trainer.optimizer.steps
        ('WindowOptimizer', 3)
    """

    def __init__(
        self,
        inner_optimizer: Any,
        *,
        steps: int,
        partial_window: str,
        probe_id: int,
        dynamic: bool,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        static_scale: float | None = None,
    ) -> None:
        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale if dynamic else float(static_scale or 1.0),
            dynamic_growth_steps=dynamic_growth_steps,
            name="gradaccum_window",
        )
        self.steps = steps
        self.partial_window = partial_window
        self.dynamic = dynamic
        self._probe_id = probe_id
        self._initial_epoch_length = 0  # set_epoch_length before build: the first step builds

    # --- state ------------------------------------------------------------------------------

    def build(self, var_list: Sequence[Any]) -> None:
        """Create the window's variables; the inner optimizer is built on the model's variables."""
        self._build_window(list(var_list))
        # Outside the untracked scope: variables the inner optimizer creates as plain attributes
        # (Nadam's `_u_product`) must join its `variables`, which JAX's stateless step carries.
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(self._model_variables)

    @_untracked
    def _build_window(self, var_list: list[Any]) -> None:
        index = [i for i, v in enumerate(var_list) if id(v) == self._probe_id]
        if len(index) != 1:
            raise ValueError(
                "the count probe is not among the trainable variables; build the optimizer "
                "through AccumulatingModel.compile and keep the wrapper trainable"
            )
        self._probe_index = index[0]
        self._model_variables = var_list[: index[0]] + var_list[index[0] + 1 :]
        probe = var_list[index[0]]
        self.step_counter = self.add_variable((), dtype="int", name="step_counter")
        self.dynamic_scale = self.add_variable(
            (), dtype="float32", initializer=keras.initializers.Constant(self.initial_scale),
            name="dynamic_scale",
        )  # fmt: skip
        self._sums = [
            self.add_variable_from_reference(v, name="window_sum") for v in self._model_variables
        ]
        self._count = self.add_variable((), dtype=probe.dtype, name="window_count")
        int_names = ("window_micro_batches", "window_finite", "epoch_micro_batches",
                     "epoch_length", "windows_stepped", "windows_skipped")  # fmt: skip
        # Initial values through initializers, not assigns: TensorFlow builds the optimizer while
        # tracing the first step (`train_on_batch`, a model unbuilt until its first batch), where
        # an assign is a graph op (the first window was skipped as non-finite).
        start = {"window_finite": 1, "epoch_length": self._initial_epoch_length}
        ints = [
            self.add_variable(
                (),
                dtype="int",
                name=name,
                initializer=keras.initializers.Constant(start.get(name, 0)),
            )
            for name in int_names
        ]
        (self._micro, self._finite, self._epoch_micro, self._epoch_length) = ints[:4]
        (self._stepped, self._skipped) = ints[4:]
        super(keras.optimizers.LossScaleOptimizer, self).build(var_list)

    def scale_loss(self, loss: Any) -> Any:
        """Multiply the loss by the current (window-fixed) loss scale."""
        if not self.dynamic and self.initial_scale == 1.0:
            return loss
        scale = self.dynamic_scale.value if self.built else self.initial_scale
        return ops.multiply(loss, ops.cast(scale, loss.dtype))

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Let the inner optimizer finalize (EMA overwrite) the model's variables only."""
        keep = {id(v) for v in self._model_variables} if self.built else set()
        self.inner_optimizer.finalize_variable_values([v for v in var_list if id(v) in keep])

    # --- one micro-batch --------------------------------------------------------------------

    def _accumulate(self, grads: Sequence[Any], probe_index: int) -> tuple[Any, Any]:
        """Add one micro-batch; return (close the window now, drop it) as boolean tensors."""
        grads = list(grads)
        scaled_count = grads.pop(probe_index)
        if scaled_count is None:
            raise ValueError(
                "the loss does not depend on the count probe: AccumulatingModel.compute_loss "
                "must add `probe * count` to the loss; do not override it without calling super()"
            )
        scale = ops.cast(self.dynamic_scale.value, self._count.dtype)
        count = ops.divide(ops.cast(scaled_count, self._count.dtype), scale)
        finite = self.check_finite([g for g in grads if g is not None] + [scaled_count])
        for total, grad in zip(self._sums, grads, strict=True):
            if grad is not None:
                grad = dense(grad)
                total.assign_add(
                    ops.multiply(ops.cast(grad, total.dtype), ops.cast(count, total.dtype))
                )
        self._count.assign_add(count)
        self._finite.assign(ops.where(finite, self._finite.value, 0))
        with _after(scaled_count):  # TensorFlow: never for a step whose batch never came
            self._micro.assign_add(1)
            epoch_micro = ops.add(self._epoch_micro.value, 1)
            length = self._epoch_length.value
            epoch_end = ops.logical_and(
                ops.greater(length, 0), ops.greater_equal(epoch_micro, length)
            )
            self._epoch_micro.assign(ops.where(epoch_end, ops.zeros_like(epoch_micro), epoch_micro))
        full = ops.greater_equal(self._micro.value, self.steps)
        if self.partial_window == "carry":
            return full, ops.zeros((), "bool")
        drop = ops.logical_and(epoch_end, ops.logical_not(full))
        if self.partial_window == "step":
            drop = ops.zeros((), "bool")
        return ops.logical_or(full, epoch_end), drop

    # --- the window boundary ----------------------------------------------------------------

    def _inner_step(self) -> None:
        scale = ops.cast(self.dynamic_scale.value, self._count.dtype)
        divisor = ops.multiply(self._count.value, scale)
        grads = [ops.divide_no_nan(s, ops.cast(divisor, s.dtype)) for s in self._sums]
        self.inner_optimizer.apply(grads, self._model_variables)

    def _close(self, drop: Any, *, select: bool) -> None:
        """Close the window: step on it unless dropped, non-finite or empty; then reset it.

        `select=True` (JAX, inside a StatelessScope) runs the inner step and keeps its result only
        where the window is good; otherwise a conditional runs it only then.
        """
        finite = ops.equal(self._finite.value, 1)
        ok = ops.logical_and(
            ops.logical_and(finite, ops.greater(self._count.value, 0)), ops.logical_not(drop)
        )
        if select:
            touched = self._model_variables + self.inner_optimizer.variables
            before = [v.value for v in touched]
            self._inner_step()
            for v, old in zip(touched, before, strict=True):
                v.assign(ops.where(ok, v.value, old))
        else:
            ops.cond(ok, self._inner_step, lambda: None)
        if self.dynamic:
            overflow = ops.logical_and(ops.logical_not(finite), ops.logical_not(drop))
            grow = ops.logical_and(
                ok, ops.equal(self.step_counter.value, self.dynamic_growth_steps - 1)
            )
            counter = ops.where(ok, ops.add(self.step_counter.value, 1), self.step_counter.value)
            self.step_counter.assign(ops.where(ops.logical_or(grow, overflow), 0, counter))
            factor = ops.where(grow, 2.0, ops.where(overflow, 0.5, 1.0))
            self.dynamic_scale.assign(
                ops.multiply(self.dynamic_scale.value, ops.cast(factor, "float32"))
            )
        skipped = ops.logical_and(ops.logical_not(ok), ops.logical_not(drop))
        self._stepped.assign_add(ops.cast(ok, self._stepped.dtype))
        self._skipped.assign_add(ops.cast(skipped, self._skipped.dtype))
        for total in self._sums:
            total.assign(ops.zeros(total.shape, total.dtype))
        self._count.assign(ops.zeros((), self._count.dtype))
        self._micro.assign(0)
        self._finite.assign(1)

    # --- the entry points Keras calls ---------------------------------------------------------

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Add one micro-batch's gradients (TensorFlow, torch); close the window when due."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables or [])
        if keras.backend.backend() == "jax":
            self._jax_apply(list(grads))
            return
        index = self._probe_index
        if trainable_variables is not None:
            index = [id(v) for v in trainable_variables].index(self._probe_id)
        close, drop = self._accumulate(grads, index)
        ops.cond(close, lambda: self._close(drop, select=False), lambda: None)

    def stateless_apply(
        self,
        optimizer_variables: Sequence[Any],
        grads: Sequence[Any],
        trainable_variables: Sequence[Any],
    ) -> tuple[list[Any], list[Any]]:
        """The JAX trainer's entry point: the same window logic, on values."""
        trainable = self._trainable_variables
        mapping = list(zip(trainable, trainable_variables, strict=True)) + list(
            zip(self.variables, optimizer_variables, strict=True)
        )
        with StatelessScope(state_mapping=mapping) as scope:
            close, drop = self._accumulate(grads, self._probe_index)
        optimizer_values = [scope.get_current_value(v) for v in self.variables]

        def in_scope(run: Callable[[], None]) -> tuple[list[Any], list[Any]]:
            state = list(zip(trainable, trainable_variables, strict=True)) + list(
                zip(self.variables, optimizer_values, strict=True)
            )
            with StatelessScope(state_mapping=state) as inner_scope:
                run()
            return (
                [inner_scope.get_current_value(v) for v in trainable],
                [inner_scope.get_current_value(v) for v in self.variables],
            )

        return ops.cond(  # type: ignore[no-any-return]
            close,
            lambda: in_scope(lambda: self._close(drop, select=True)),
            lambda: (list(trainable_variables), optimizer_values),
        )

    def _jax_apply(self, grads: list[Any]) -> None:
        """Eager `apply` on JAX: run `stateless_apply` on the current values and store them."""
        trainable, values = self.stateless_apply(
            [v.value for v in self.variables], grads, [v.value for v in self._trainable_variables]
        )
        for v, value in zip(self._trainable_variables, trainable, strict=True):
            v.assign(value)
        for v, value in zip(self.variables, values, strict=True):
            v.assign(value)

    # --- eager helpers for callbacks ----------------------------------------------------------

    def saved_optimizer(self) -> Any:
        """The optimizer a plain model compiled as the wrapper was holds, for its saved files.

        The inner optimizer; under dynamic loss scaling (`mixed_float16`), a plain
        `LossScaleOptimizer` around it holding the current scale, as Keras's compile makes.
        """
        if not self.dynamic:
            return self.inner_optimizer
        scale = float(keras.ops.convert_to_numpy(self.dynamic_scale))
        plain = keras.optimizers.LossScaleOptimizer(
            self.inner_optimizer,
            initial_scale=scale,
            dynamic_growth_steps=self.dynamic_growth_steps,
        )
        plain.build(self._model_variables)
        plain.step_counter.assign(self.step_counter.value)
        return plain

    def set_epoch_length(self, micro_batches: int | None) -> None:
        """Tell the window how many micro-batches an epoch has (0 or None: unknown).

        Before `build` (TensorFlow builds an unbuilt model, and then the optimizer, while
        tracing the first step), the length becomes the variable's initial value.
        """
        if not self.built:
            self._initial_epoch_length = int(micro_batches or 0)
            return
        self._epoch_length.assign(int(micro_batches or 0))
        self._epoch_micro.assign(0)

    def flush(self, policy: str) -> bool:
        """Eagerly settle an open window: `"step"` on it, `"drop"` it, or `"carry"` (keep it).

        Returns:
            True if the inner optimizer took a step.
        """
        if policy == "carry" or self.window_state()["pending"] == 0:
            return False
        stepped = self.window_state()["steps"]
        drop = ops.convert_to_tensor(policy == "drop")
        if keras.backend.backend() == "jax":
            values = [v.value for v in self.variables]
            trainable = [v.value for v in self._trainable_variables]
            mapping = list(zip(self._trainable_variables, trainable, strict=True)) + list(
                zip(self.variables, values, strict=True)
            )
            with StatelessScope(state_mapping=mapping) as scope:
                self._close(drop, select=True)
            for v in self._trainable_variables + self.variables:
                v.assign(scope.get_current_value(v))
        else:
            self._close(drop, select=False)
        return self.window_state()["steps"] > stepped

    def window_state(self) -> dict[str, int]:
        """Counters, read eagerly: steps taken, windows skipped, micro-batches pending."""
        if not self.built:
            return {"steps": 0, "skipped": 0, "pending": 0}
        return {
            "steps": int(keras.ops.convert_to_numpy(self._stepped)),
            "skipped": int(keras.ops.convert_to_numpy(self._skipped)),
            "pending": int(keras.ops.convert_to_numpy(self._micro)),
        }
