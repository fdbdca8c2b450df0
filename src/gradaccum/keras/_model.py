"""`AccumulatingModel`: `model.fit` with exact gradient accumulation, on any Keras 3 backend.

The wrapper leaves the wrapped model untouched (no extra weight, saves as before) and adds three
things around Keras's own `train_step`:

- `compute_loss` returns Keras's loss for the micro-batch plus `probe * count`, where `probe` is
  a trainable scalar of the wrapper that stays 0: the value (and the progress bar) is unchanged,
  and the gradient Keras computes for `probe` is the micro-batch's count (times the loss scale).
  That is how the count reaches the optimizer on every backend, JAX's stateless one included.
- `compile` wraps the optimizer in a `WindowOptimizer`, which steps it once per window on
  `sum(count * gradient) / sum(count)`.
- `fit` adds a callback that tells the optimizer how long an epoch is, so the epoch's last
  micro-batch settles an open window by the `partial_window` policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
from keras import ops

from gradaccum._warnings import warn_user
from gradaccum.keras._added import ROW_MEAN, added_terms, check_summed_terms
from gradaccum.keras._counts import (
    LABEL_COUNTED,
    MEAN_REDUCTIONS,
    check_count,
    count_of,
    ignoring_losses,
    masked_outputs,
    varying_count,
    warn_whole_batch,
)
from gradaccum.keras._first import check_first_batch
from gradaccum.keras._optimizer import WindowOptimizer
from gradaccum.keras._options import (
    PARTIAL_WINDOWS,
    check_batch_size,
    check_no_builtin_accumulation,
    check_options,
    check_single_replica,
    warn_batchnorm,
)
from gradaccum.keras._settle import SettleWindows
from gradaccum.keras._terms import activity_regularized, check_activity_terms, compile_time_kind

__all__ = ["PARTIAL_WINDOWS", "AccumulatingModel", "accumulate"]

CountFn = Callable[[Any, Any, Any, Any], Any]


class AccumulatingModel(keras.Model):
    """Wraps a Keras model so that `fit` takes one exact optimizer step per `steps` micro-batches.

    `fit(batch_size=m)` then runs micro-batches of `m`; every `steps` of them (a window) the
    optimizer steps once on the gradient of the window's mean loss: the loss Keras would compute
    on the window's items at once, masks and sample weights counted the same way. The optimizer,
    its learning-rate schedule, EMA, clipping and weight decay see real steps only.

    Args:
        model: the `keras.Model` to train; it is trained in place and stays a plain model.
        steps: micro-batches per optimizer step.
        partial_window: what the end of an epoch does to an open window: `"step"` (an exact step
            on the items seen), `"drop"` (discard them) or `"carry"` (finish the window with the
            next epoch's first micro-batches).
        count: optional `(x, y, y_pred, sample_weight) -> count` for a custom `compute_loss`; by
            default the count is the divisor of the first compiled loss (its items, its unmasked
            tokens, or its summed weights for `"mean_with_sample_weight"`).

    Example:
        >>> import numpy as np, keras
        >>> net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> trainer = AccumulatingModel(net, steps=2)
        >>> trainer.compile(optimizer="sgd", loss="mse")
        >>> _ = trainer.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0)
        >>> trainer.window_state
        {'steps': 2, 'skipped': 0, 'pending': 0}
    """

    optimizer: Any  # set by compile(): a WindowOptimizer

    def __init__(
        self,
        model: Any,
        *,
        steps: int,
        partial_window: str = "step",
        count: CountFn | None = None,
    ) -> None:
        check_options(model, steps, partial_window, count, AccumulatingModel)
        super().__init__(dtype=model.dtype_policy, name=f"{model.name}_accumulating")
        self._probe = self.add_weight(
            shape=(), initializer="zeros", trainable=True, name="count_probe"
        )
        self.model = model
        self.steps = steps
        self.partial_window = partial_window
        self._count_fn = count
        self._activity = False  # the model has activity regularizers (set at compile)
        self._added = False  # the model adds a per-row loss term itself (set at compile)
        self._terms_read = False  # its added terms were read (at compile, or the first batch)
        if hasattr(model, "output_names"):
            self.output_names = model.output_names
        self._settle = SettleWindows(self)
        self._norms_warned = warn_batchnorm(model, steps)
        self.built = model.built  # the probe exists already: built as the model is

    def call(self, inputs: Any, training: Any = None) -> Any:
        """Run the wrapped model."""
        return self.model(inputs, training=training)

    def compile(
        self, optimizer: Any = "rmsprop", loss: Any = None, *args: Any, **kwargs: Any
    ) -> None:
        """Compile as `keras.Model.compile`; the optimizer is then wrapped to step per window."""
        check_single_replica()
        self._norms_warned = warn_batchnorm(self.model, self.steps, self._norms_warned)
        for item in keras.tree.flatten(loss):
            if isinstance(item, keras.losses.Loss) and item.reduction not in MEAN_REDUCTIONS:
                raise ValueError(
                    f"loss {item.name!r} has reduction={item.reduction!r}; accumulation divides "
                    f"each window once by its count, so use one of {MEAN_REDUCTIONS}"
                )
        masked = [] if self._count_fn is not None else masked_outputs(self.model, loss)
        if masked:
            raise ValueError(
                f"the compiled losses count different items: outputs {masked} are masked (they "
                "count unmasked entries), the others count rows; one window count cannot "
                "divide each loss by its own. Compile one loss, or pass count=... to "
                "AccumulatingModel if you know the counts stay proportional"
            )
        ignoring = [] if self._count_fn is not None else ignoring_losses(loss)
        if ignoring:
            raise ValueError(
                f"the compiled losses count different items: the losses of {ignoring} have "
                "ignore_class set, so each counts the entries its own labels keep; one window "
                "count cannot divide each loss by its own. Compile one loss, or pass count=... "
                "to AccumulatingModel if you know the counts stay proportional"
            )
        added = [] if self._count_fn is not None else added_terms(self.model)
        self._terms_read = added is not None  # else read on the first batch (_first.py)
        added = added or []
        check_summed_terms(added)
        self._added = ROW_MEAN in added  # a per-row add_loss term: checked like activity terms
        if self._count_fn is None:
            check_activity_terms(self.model, compile_time_kind(self.model, loss), added=self._added)
        self._activity = self._added or bool(activity_regularized(self.model))  # checked per trace
        if self.steps > 1:
            warn_whole_batch(loss)
        inner = keras.optimizers.get(optimizer)
        if isinstance(inner, WindowOptimizer):
            inner = inner.inner_optimizer
        check_no_builtin_accumulation(inner, self.steps)
        static_scale = None if isinstance(inner, keras.optimizers.LossScaleOptimizer) else (
            inner.loss_scale_factor
        )  # fmt: skip
        super().compile(inner, loss, *args, **kwargs)
        compiled = self.optimizer
        dynamic = isinstance(compiled, keras.optimizers.LossScaleOptimizer)
        self.optimizer = WindowOptimizer(
            compiled.inner_optimizer if dynamic else compiled,
            steps=self.steps,
            partial_window=self.partial_window,
            probe_id=id(self._probe),
            dynamic=dynamic,
            initial_scale=compiled.initial_scale if dynamic else 2.0**15,
            dynamic_growth_steps=compiled.dynamic_growth_steps if dynamic else 2000,
            static_scale=static_scale,
        )

    def compute_loss(
        self,
        x: Any = None,
        y: Any = None,
        y_pred: Any = None,
        sample_weight: Any = None,
        training: bool = True,
    ) -> Any:
        """Keras's loss plus `probe * count` (0 in value; its gradient carries the count)."""
        value = super().compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
        )
        if not training or value is None:
            return value
        count = ops.cast(self._count_items(x, y, y_pred, sample_weight), value.dtype)
        return ops.add(value, ops.multiply(ops.cast(self._probe, value.dtype), count))

    def _count_items(self, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
        if self._count_fn is not None:
            count = self._count_fn(x, y, y_pred, sample_weight)
            check_count(count, "count(x, y, y_pred, sample_weight)")
            return count
        compiled = self._compile_loss
        if compiled is None or not compiled._flat_losses:
            first = next(leaf for leaf in keras.tree.flatten(x) if leaf is not None)
            return ops.shape(first)[0]
        outputs = [(loss, *_at(path, y, y_pred, sample_weight)) for path, loss, _, _ in (
            compiled._flat_losses
        )]  # fmt: skip
        if len(outputs) > 1:  # one count serves every loss only if they count alike
            kinds = {
                "/".join(map(str, entry.path)) or "output": varying_count(loss, pred, weight, true)
                for entry, (loss, true, pred, weight) in zip(
                    compiled._flat_losses, outputs, strict=True
                )
            }
            varying = {name: kind or "rows" for name, kind in kinds.items()}
            by_label = [kind for kind in kinds.values() if kind == LABEL_COUNTED]
            if len(set(kinds.values())) > 1 or len(by_label) > 1:
                raise ValueError(
                    f"the compiled losses count different items: {varying}; one window count "
                    "cannot divide each loss by its own, so accumulation would not be exact. "
                    "Compile one loss (or losses that count rows alike), or pass count=... to "
                    "AccumulatingModel if you know the counts stay proportional"
                )
        loss, y, y_pred, sample_weight = outputs[0]
        if self._activity:  # Keras's per-row terms (activity regularizers): exact over rows only
            kind = varying_count(loss, y_pred, sample_weight, y)
            check_activity_terms(self.model, kind, added=self._added)
        return count_of(loss, y, y_pred, sample_weight)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """`keras.Model.fit`; `batch_size` is the micro-batch size."""
        check_batch_size(args, kwargs)
        if args:
            args = (check_first_batch(self, args[0]), *args[1:])
        else:
            kwargs["x"] = check_first_batch(self, kwargs.get("x"))
        self.built = self.built or self.model.built  # built since wrapped (BackupAndRestore)
        # First, so an epoch's leftover is settled before the user's callbacks save or stop.
        if len(args) > 5:  # callbacks given positionally
            args = (*args[:5], self._settle.first_of(args[5]), *args[6:])
        else:
            kwargs["callbacks"] = self._settle.first_of(kwargs.get("callbacks"))
        return super().fit(*args, **kwargs)

    def train_on_batch(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        """`keras.Model.train_on_batch` on one micro-batch; `steps` calls make a window."""
        x = check_first_batch(self, x)
        self.built = self.built or self.model.built
        return super().train_on_batch(x, *args, **kwargs)

    def flush(self, policy: str = "step") -> bool:
        """Settle an open window now: `"step"` on its items or `"drop"` them.

        Returns:
            True if the optimizer took a step.
        """
        if policy not in ("step", "drop"):
            raise ValueError(f"policy={policy!r} must be 'step' or 'drop'")
        return self._window_optimizer().flush(policy)

    @property
    def window_state(self) -> dict[str, int]:
        """`steps` taken, windows `skipped` (non-finite or empty), micro-batches `pending`.

        Readable during `fit` too (a callback): on JAX, where `fit` holds the variables' values
        until they are synced, reading it syncs them first, as `Callback.model` does.
        """
        sync = getattr(self, "jax_state_sync", None)
        if callable(sync):
            sync()
        return self._window_optimizer().window_state()

    def _window_optimizer(self) -> WindowOptimizer:
        if not isinstance(self.optimizer, WindowOptimizer):
            raise RuntimeError(
                "the optimizer is not accumulating: call AccumulatingModel.compile(...), and do "
                "not assign trainer.optimizer afterwards"
            )
        return self.optimizer

    def save(self, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        """Save the wrapped model as a plain model compiled as this wrapper was saves itself.

        A `.keras` file holds the compile arguments and the inner optimizer's state, so
        `keras.models.load_model` returns a compiled model whose optimizer resumes exactly (wrap
        it again with `accumulate` and compile with `optimizer=loaded.optimizer`). An open
        window's sums are not in it (save at window boundaries): a warning says so.
        """
        self._warn_open_window()
        if not str(filepath).endswith(".keras"):  # legacy .h5: the weights, as before
            return self.model.save(filepath, *args, **kwargs)
        with self._optimizer_on_model(compile_config=True):
            return self.model.save(filepath, *args, **kwargs)

    def save_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        """Save the wrapped model's weights and its optimizer's state, as a compiled model would.

        The file is laid out as a plain model compiled with the inner optimizer writes it, so
        `BackupAndRestore` and `ModelCheckpoint(save_weights_only=True)` resume the optimizer
        too, and a plain model loads it. An open window's sums are not in it (save at window
        boundaries): a warning says so.
        """
        self._warn_open_window()
        with self._optimizer_on_model():
            return self.model.save_weights(filepath, *args, **kwargs)

    def _warn_open_window(self) -> None:
        pending = self.window_state["pending"] if isinstance(self.optimizer, WindowOptimizer) else 0
        if pending:
            warn_user(
                UserWarning(
                    f"saving while {pending} micro-batch(es) wait in an open window: their "
                    "gradient sums are not saved; save at window boundaries"
                )
            )

    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        """Load weights (and, if the file holds it, the optimizer's state) into the model."""
        with self._optimizer_on_model():
            return self.model.load_weights(filepath, *args, **kwargs)

    @contextlib.contextmanager
    def _optimizer_on_model(self, *, compile_config: bool = False) -> Iterator[None]:
        """Lend the inner optimizer to the wrapped model, where Keras saves and loads it.

        With `compile_config`, lend this wrapper's compile arguments too (a `.keras` file
        records them, and `load_model` compiles the loaded model with them before it loads the
        optimizer's state).
        """
        window = self.optimizer if isinstance(self.optimizer, WindowOptimizer) else None
        if window is None:
            yield  # not compiled yet: the weights alone
            return
        if not window.built:
            window.build(self.trainable_variables)
        lent = {"optimizer": window.inner_optimizer}
        if compile_config and getattr(self, "_compile_config", None) is not None:
            # load_model compiles as the wrapper was, then loads the optimizer: lay it out alike.
            lent.update(
                optimizer=window.saved_optimizer(),
                compiled=True,
                _compile_config=self._compile_config,
            )
        missing = object()
        own = {name: self.model.__dict__.get(name, missing) for name in lent}  # compiled itself
        for name, value in lent.items():
            object.__setattr__(self.model, name, value)  # not tracked
        try:
            yield
        finally:
            for name, value in own.items():
                if value is missing:
                    object.__delattr__(self.model, name)
                else:
                    object.__setattr__(self.model, name, value)

    def get_config(self) -> dict[str, Any]:
        """Not serializable: save the wrapped model (`trainer.model`, or `trainer.save`)."""
        raise NotImplementedError(
            "AccumulatingModel is not serialized; save the wrapped model: trainer.save(path)"
        )


def _at(path: Any, y: Any, y_pred: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
    """`y`, `y_pred` and `sample_weight` of the output a compiled loss is attached to."""
    try:
        for key in path or ():
            y, y_pred = y[key], y_pred[key]
            if keras.tree.is_nested(sample_weight):
                sample_weight = sample_weight[key]
    except (KeyError, IndexError, TypeError) as error:
        raise ValueError(
            f"cannot find the loss's output {path} in y and y_pred; pass "
            "count=lambda x, y, y_pred, sample_weight: ... to AccumulatingModel"
        ) from error
    return y, y_pred, sample_weight


def accumulate(
    model: Any, steps: int, *, partial_window: str = "step", count: CountFn | None = None
) -> AccumulatingModel:
    """Wrap `model` for exact gradient accumulation in `fit`: see `AccumulatingModel`.

    Example:
        >>> import keras
        >>> net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> accumulate(net, steps=4).steps
        4
    """
    return AccumulatingModel(model, steps=steps, partial_window=partial_window, count=count)
