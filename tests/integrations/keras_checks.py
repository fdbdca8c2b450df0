"""Checks of gradaccum.keras on ONE Keras backend, run in a subprocess by test_keras.py.

The backend is fixed when keras is first imported, so `test_keras.py` runs this file once per
backend (`KERAS_BACKEND=tensorflow|jax`) and reads one JSON line per check. Each check trains
for several optimizer steps and compares the parameters with a plain Keras run that takes one
full-batch step per window, in float64: `gap` is the largest relative difference of a weight
tensor, max |a - b| / max |b|.

Usage: KERAS_BACKEND=jax JAX_ENABLE_X64=1 python tests/integrations/keras_checks.py [names...]
"""

from __future__ import annotations

if __name__ != "__main__":  # collected by `pytest --doctest-modules`: a worker, not a test module
    import pytest

    pytest.skip("keras_checks.py runs as test_keras.py's subprocess", allow_module_level=True)

import contextlib
import importlib.util
import io
import json
import os
import runpy
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from keras import ops

keras.config.set_floatx("float64")
keras.config.disable_interactive_logging()

from keras.src.trainers.compile_utils import get_loss  # noqa: E402

import gradaccum.keras as gk  # noqa: E402
from gradaccum.batchnorm import BatchNormAccumulationWarning  # noqa: E402
from gradaccum.keras._optimizer import dense  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "keras_digits.py"
BACKEND = keras.backend.backend()
CHECKS = {}
# Ragged micro-batches from few distinct sizes: every new shape costs a (JAX/XLA) compilation.
RAGGED = [5, 3, 5, 3, 5, 5]  # windows of 3: 13 and 13 items
TOKEN_ROWS = [3] * 6  # equal rows, unequal token counts (random padding)


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# --- data and models ------------------------------------------------------------------------


class Batches(keras.utils.PyDataset):
    """Exactly these batches, in this order, every epoch (ragged sizes allowed)."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]


def concat(batches):
    return tuple(np.concatenate(parts) for parts in zip(*batches, strict=True))


def windows(micro, steps, policy="step", epochs=1):
    """The full batches a plain run must take to equal accumulation over `micro` batches."""
    out, open_ = [], []
    for _ in range(epochs):
        for i, batch in enumerate(micro):
            open_.append(batch)
            last = i == len(micro) - 1
            if len(open_) == steps or (last and policy != "carry"):
                if len(open_) == steps or policy == "step":
                    out.append(concat(open_))
                open_ = []
    return out, open_


def regression(sizes, seed=0, features=6, outputs=3):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, features)), rng.normal(size=(n, outputs))) for n in sizes]


def seeded(seed):
    """A seeded initializer. (keras.utils.set_random_seed would import TensorFlow on every backend
    to seed it too: seconds of CPU per process.)"""
    return keras.initializers.GlorotUniform(seed=seed)


def mlp(features=6, outputs=3, seed=1, hidden=16, norm=None, regularizer=None):
    dense = keras.layers.Dense(
        hidden, activation="relu", kernel_initializer=seeded(seed), kernel_regularizer=regularizer
    )
    layers = [keras.Input((features,)), dense]
    if norm is not None:
        layers.append(norm)
    layers.append(keras.layers.Dense(outputs, kernel_initializer=seeded(seed + 1)))
    return keras.Sequential(layers)


def token_data(sizes, seed=0, vocab=11, length=7):
    """Padded token rows (0 = padding) of random lengths; targets are per-token classes."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        x = np.zeros((n, length), dtype="int32")
        y = np.zeros((n, length), dtype="int32")
        for row in range(n):
            k = int(rng.integers(1, length + 1))
            x[row, :k] = rng.integers(1, vocab, size=k)
            y[row, :k] = rng.integers(0, vocab, size=k)
        out.append((x, y))
    return out


def token_model(vocab=11, seed=1):
    embedding = keras.initializers.RandomUniform(-0.5, 0.5, seed=seed)
    return keras.Sequential(
        [
            keras.Input((None,), dtype="int32"),
            keras.layers.Embedding(vocab, 8, mask_zero=True, embeddings_initializer=embedding),
            keras.layers.Dense(16, activation="relu", kernel_initializer=seeded(seed + 1)),
            keras.layers.Dense(vocab, kernel_initializer=seeded(seed + 2)),
        ]
    )


def weights(model):
    return [np.asarray(ops.convert_to_numpy(w), dtype="float64") for w in model.weights]


def gap(a, b):
    """The largest relative difference of a weight tensor: max |x - y| / max |y|."""
    pairs = zip(a, b, strict=True)
    return max(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)) for x, y in pairs)


def densified(optimizer):
    """The reference optimizer sees dense gradients, as the accumulated window does.

    On TensorFlow an Embedding's gradient is an IndexedSlices with one row per token, and Keras's
    Adam squares each duplicate row separately: that is not the full-batch Adam step.
    """
    apply = optimizer.apply

    def dense_apply(grads, trainable_variables=None):
        return apply([None if g is None else dense(g) for g in grads], trainable_variables)

    optimizer.apply = dense_apply
    return optimizer


def fit_plain(make, optimizer, batches, loss="mse", epochs=1, **compile_kw):
    model = make()
    optimizer = densified(optimizer)
    model.compile(optimizer=optimizer, loss=loss, **compile_kw)
    model.fit(Batches(batches), epochs=epochs, shuffle=False, verbose=0)
    return model


def fit_accumulated(make, optimizer, micro, steps, loss="mse", epochs=1, policy="step", **kw):
    model = make()
    trainer = gk.accumulate(model, steps=steps, partial_window=policy)
    trainer.compile(optimizer=optimizer, loss=loss, **kw)
    trainer.fit(Batches(micro), epochs=epochs, shuffle=False, verbose=0)
    return model, trainer


def compare(make, optimizer_fn, micro, steps, *, loss="mse", epochs=1, policy="step", **kw):
    full, _ = windows(micro, steps, policy, epochs)
    ref = fit_plain(make, optimizer_fn(), full, loss=loss, **kw)
    model, trainer = fit_accumulated(
        make, optimizer_fn(), micro, steps, loss=loss, epochs=epochs, policy=policy, **kw
    )
    return {"gap": gap(weights(model), weights(ref)), "state": trainer.window_state,
            "full_steps": len(full), "weights": weights(model)}  # fmt: skip


# --- checks -----------------------------------------------------------------------------------


def adam_with_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5)
    return keras.optimizers.Adam(schedule)


@check
def adam_schedule_ragged():
    micro = regression(RAGGED)
    return compare(mlp, adam_with_schedule, micro, steps=3, epochs=2)


@check
def clipping():
    micro = regression(RAGGED)
    clipped = lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05)  # noqa: E731
    result = compare(mlp, clipped, micro, 3, epochs=2)
    # The clip must bind, or the check proves nothing: an unclipped run ends elsewhere.
    without, _ = fit_accumulated(mlp, keras.optimizers.SGD(0.5), micro, 3, epochs=2)
    result["clip_changes_result"] = gap(result["weights"], weights(without))
    return result


@check
def static_loss_scale():
    """An inner optimizer's fixed loss_scale_factor scales the loss and is divided out exactly."""
    micro = regression(RAGGED)
    make_opt = lambda: keras.optimizers.Adam(0.05, loss_scale_factor=128.0)  # noqa: E731
    return compare(mlp, make_opt, micro, steps=3, epochs=2)


@check
def nadam_state_outside_its_slots():
    """Nadam keeps `_u_product` in a plain attribute variable: it must be among the optimizer's
    variables, or JAX's stateless step drops its update (the run ended 54% away)."""
    micro = regression([4] * 6, seed=14)
    result = compare(mlp, lambda: keras.optimizers.Nadam(0.05), micro, steps=3, epochs=2)
    model = mlp()
    trainer = gk.accumulate(model, steps=3)
    trainer.compile(optimizer=keras.optimizers.Nadam(0.05), loss="mse")
    trainer.optimizer.build(trainer.trainable_variables)
    inner = trainer.optimizer.inner_optimizer
    result["tracked"] = any(v is inner._u_product for v in trainer.optimizer.variables)
    return result


@check
def ema():
    micro = regression(RAGGED)
    opt = lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.5)  # noqa: E731
    return compare(mlp, opt, micro, steps=3, epochs=2)


@check
def weight_regularizer():
    """An L2 kernel regularizer is added once per window, not once per micro-batch."""
    micro = regression(RAGGED)
    make = lambda: mlp(regularizer=keras.regularizers.L2(0.05))  # noqa: E731
    return compare(make, lambda: keras.optimizers.SGD(0.2), micro, steps=3, epochs=2)


@check
def masked_token_loss():
    micro = token_data(TOKEN_ROWS)
    return compare(token_model, lambda: keras.optimizers.Adam(0.05), micro, steps=3,
                   loss="sparse_categorical_crossentropy", epochs=2)  # fmt: skip


@check
def custom_count():
    """count= replaces the compiled loss's count: tokens reproduce it, rows do not."""
    micro = token_data(TOKEN_ROWS[:4])
    full, _ = windows(micro, 2, "step")
    ref = fit_plain(
        token_model, keras.optimizers.SGD(0.5), full, loss="sparse_categorical_crossentropy"
    )
    gaps = {}
    counts = {
        "tokens": lambda x, y, y_pred, sample_weight: ops.sum(ops.cast(x > 0, "float64")),
        "rows": lambda x, y, y_pred, sample_weight: ops.shape(x)[0],
    }
    for name, count in counts.items():
        model = token_model()
        trainer = gk.accumulate(model, steps=2, count=count)
        trainer.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
        trainer.fit(Batches(micro), shuffle=False, verbose=0)
        gaps[name] = gap(weights(model), weights(ref))
    return {"gap": gaps["tokens"], "gap_rows": gaps["rows"]}


@check
def count_function_must_return_one_number():
    """A `count=` function returning per-row counts (or a string) is refused at the first step.
    (On TensorFlow a vector count turned the loss into a vector: its gradient was the loss's
    gradient times the rows, silently; on JAX a string count was read as a number.)"""
    x, y = regression([8])[0]
    messages = {}
    for label, count in {
        "vector": lambda x, y, y_pred, sample_weight: ops.ones((ops.shape(x)[0],), "float64"),
        "string": lambda x, y, y_pred, sample_weight: "4",
    }.items():
        model = mlp()
        before = weights(model)
        trainer = gk.accumulate(model, steps=2, count=count)
        trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        try:
            trainer.fit(x, y, batch_size=4, verbose=0)
            messages[label] = None
        except (TypeError, ValueError) as error:
            messages[label] = f"{type(error).__name__}: {error}"
        if BACKEND != "jax":  # JAX's fit purges the variables before its first step traces
            messages[f"{label}_unchanged"] = gap(weights(model), before) == 0.0
    return {"messages": messages}


@check
def sample_weight_token_mean():
    rng = np.random.default_rng(3)
    micro = [
        (x, y, (x > 0).astype("float64") * rng.uniform(0.5, 2.0, size=x.shape))
        for x, y in token_data(TOKEN_ROWS[:4])
    ]
    loss = keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight")
    return compare(token_model, lambda: keras.optimizers.SGD(0.5), micro, steps=2, loss=loss)


def leftover(policy):
    micro = regression([4] * 10, seed=5)
    return compare(
        mlp, lambda: keras.optimizers.Adam(0.02), micro, steps=4, epochs=2, policy=policy
    )


@check
def leftover_step():
    return leftover("step")


@check
def leftover_drop():
    return leftover("drop")


@check
def leftover_carry():
    micro = regression([4] * 10, seed=5)
    full, pending = windows(micro, 4, "carry", epochs=3)
    ref = fit_plain(mlp, keras.optimizers.Adam(0.02), full)
    model = mlp()
    trainer = gk.accumulate(model, steps=4, partial_window="carry")
    trainer.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Batches(micro), epochs=3, shuffle=False, verbose=0)
    state = trainer.window_state
    result = {"gap": gap(weights(model), weights(ref)), "state": state, "pending_ref": len(pending),
              "warned": any("open window" in str(w.message) for w in caught)}  # fmt: skip
    stepped = trainer.flush()
    ref.fit(Batches([concat(pending)]), shuffle=False, verbose=0)
    result.update(flushed=stepped, gap_after_flush=gap(weights(model), weights(ref)))
    return result


@check
def leftover_unknown_length():
    """A generator has no length: the leftover is settled after the epoch (on_epoch_end)."""
    micro = regression([4] * 10, seed=5)
    full, _ = windows(micro, 4, "step")
    ref = fit_plain(mlp, keras.optimizers.Adam(0.02), full)
    model = mlp()
    trainer = gk.accumulate(model, steps=4)
    trainer.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    trainer.fit((batch for batch in micro), epochs=1, verbose=0)
    return {"gap": gap(weights(model), weights(ref)), "state": trainer.window_state}


def unknown_length(micro):
    """`micro` as a tf.data pipeline whose length Keras cannot know (a filter), every epoch."""
    import tensorflow as tf

    x, y = concat(micro)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True)
    return dataset.batch(len(micro[0][0]))


@check
def carry_over_epochs_of_unknown_length():
    """Windows carried over epochs whose length Keras learns only at their end.

    On TensorFlow Keras calls the train function once more at such an end, and the batch fetch
    fails; the window must not count that micro-batch that never came (it used to: the carried
    window then closed one micro-batch early, and a full last window left a phantom one
    that the epoch's end reported as a skipped window).
    """
    if importlib.util.find_spec("tensorflow") is None:
        return {"skipped": "needs tf.data"}
    micro = regression([4] * 10, seed=5)
    full, pending = windows(micro, 4, "carry", epochs=3)
    ref = fit_plain(mlp, keras.optimizers.Adam(0.02), full)
    model = mlp()
    trainer = gk.accumulate(model, steps=4, partial_window="carry")
    trainer.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the open window at the end is the point
        trainer.fit(unknown_length(micro), epochs=3, verbose=0)
    result = {"gap": gap(weights(model), weights(ref)), "state": trainer.window_state,
              "pending_ref": len(pending)}  # fmt: skip
    whole = gk.accumulate(mlp(), steps=5)  # 10 micro-batches: the last window is full
    whole.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    whole.fit(unknown_length(micro), epochs=2, verbose=0)
    result["full_windows_state"] = whole.window_state
    return result


@check
def train_on_batch_windows():
    """`train_on_batch` on micro-batches takes one exact step per `steps` calls, before a fit and
    after one. (On TensorFlow the first window was skipped as non-finite: the optimizer, built
    while tracing, set its start value by an assign in the graph. After a fit, on every backend,
    that fit's epoch length closed later windows early.)"""
    micro = regression([4] * 6, seed=15)
    epoch = regression([4] * 5, seed=16)  # one fit epoch, windows of 2: 2, 2 and 1
    model = mlp()
    trainer = gk.accumulate(model, steps=2)
    trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    for batch in micro[:4]:  # before any fit: 2 windows
        trainer.train_on_batch(*batch)
    trainer.fit(Batches(epoch), shuffle=False, verbose=0)
    for batch in micro:  # after it: 3 windows
        trainer.train_on_batch(*batch)
    full = windows(micro[:4], 2)[0] + windows(epoch, 2)[0] + windows(micro, 2)[0]
    ref = mlp()
    ref.compile(optimizer=densified(keras.optimizers.Adam(0.05)), loss="mse")
    for batch in full:
        ref.train_on_batch(*batch)
    # NEGATIVE CONTROL: one step per micro-batch ends elsewhere.
    naive = mlp()
    naive.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    for batch in micro[:4] + epoch + micro:
        naive.train_on_batch(*batch)
    return {"gap": gap(weights(model), weights(ref)), "state": trainer.window_state,
            "gap_per_micro_batch": gap(weights(naive), weights(ref))}  # fmt: skip


@check
def subclassed_model_built_by_its_first_step():
    """A subclassed model unbuilt until `fit`'s first batch: on TensorFlow the model, then the
    optimizer, are built while tracing that step, after the callbacks' `on_train_begin` (which
    built the window on the count probe alone: the step raised a bare zip() ValueError)."""
    micro = regression([4] * 10, seed=17)  # windows of 4: 4, 4 and a dropped leftover of 2
    optimizer = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    return compare(_Mlp, optimizer, micro, steps=4, epochs=2, policy="drop")


@check
def callbacks_in_any_form():
    """`fit(callbacks=...)` as Keras takes it: one callback, or a `CallbackList`, not only a list.
    (Both raised a bare "Value after * must be an iterable" TypeError.)"""
    micro = regression([4] * 5, seed=18)  # windows of 2: 2, 2 and a leftover of 1
    full, _ = windows(micro, 2)
    ref = fit_plain(mlp, keras.optimizers.Adam(0.05), full, epochs=1)
    result = {}
    for label in ("one", "list_object"):
        seen = []
        callback = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs, seen=seen: seen.append(epoch)
        )
        model = mlp()
        trainer = gk.accumulate(model, steps=2)
        trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        # (Keras runs a CallbackList as given: it must hold History and the model itself.)
        given = (
            callback
            if label == "one"
            else keras.callbacks.CallbackList([callback], add_history=True, model=trainer)
        )
        trainer.fit(Batches(micro), shuffle=False, verbose=0, callbacks=given)
        result[label] = {"gap": gap(weights(model), weights(ref)), "state": trainer.window_state,
                         "ran": seen}  # fmt: skip
    return result


@check
def window_state_during_fit():
    """A callback holding the trainer reads `window_state` after every micro-batch (on JAX the
    variables' values live in `fit` until synced: reading them used to raise a TypeError)."""
    micro = regression([4] * 5, seed=2)
    trainer = gk.accumulate(mlp(), steps=2)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    seen = []

    class Log(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(trainer.window_state["pending"])

    trainer.fit(Batches(micro), epochs=1, shuffle=False, verbose=0, callbacks=[Log()])
    return {"pending": seen, "state": trainer.window_state}


class _StopAfter(keras.callbacks.Callback):
    """Stops `fit` after micro-batch `batch` (as TerminateOnNaN or a custom callback does)."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True


@check
def stop_training_mid_epoch_settles_the_open_window():
    """A callback stops fit after 5 of 8 micro-batches (windows of 3): the open window of 2 is
    settled by the policy before validation, not carried into the next fit's first window."""
    micro = regression([4] * 8, seed=12)
    val = regression([6], seed=13)[0]
    model = mlp()
    trainer = gk.accumulate(model, steps=3)
    trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    history = trainer.fit(Batches(micro), validation_data=val, shuffle=False, verbose=0,
                          callbacks=[_StopAfter(4)])  # fmt: skip
    result = {"state_after_stop": trainer.window_state}
    trainer.fit(Batches(micro), shuffle=False, verbose=0)
    result["state"] = trainer.window_state
    stopped, _ = windows(micro[:5], 3)  # 12 rows, then the leftover's 8
    full, _ = windows(micro, 3)
    ref = mlp()
    ref.compile(optimizer=densified(keras.optimizers.Adam(0.05)), loss="mse")
    ref.fit(Batches(stopped), shuffle=False, verbose=0)
    ref_val = ref.evaluate(*val, verbose=0)
    result["val_gap"] = abs(history.history["val_loss"][0] - ref_val) / abs(ref_val)
    ref.fit(Batches(full), shuffle=False, verbose=0)
    result["gap"] = gap(weights(model), weights(ref))
    # NEGATIVE CONTROL: without the leftover's step the run ends elsewhere.
    ref = mlp()
    ref.compile(optimizer=densified(keras.optimizers.Adam(0.05)), loss="mse")
    ref.fit(Batches(stopped[:1] + full), shuffle=False, verbose=0)
    result["gap_without_leftover"] = gap(weights(model), weights(ref))
    return result


def two_heads(seed=1, masked=False):
    """Token ids in; a per-row regression head and a per-token (`masked`: mask_zero) head out."""
    inputs = keras.Input((None,), dtype="int32")
    embedding = keras.initializers.RandomUniform(-0.5, 0.5, seed=seed)
    tokens = keras.layers.Embedding(11, 8, mask_zero=masked, embeddings_initializer=embedding)
    hidden = tokens(inputs)
    seq = keras.layers.Dense(11, name="seq", kernel_initializer=seeded(seed + 1))(hidden)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    row = keras.layers.Dense(2, name="row", kernel_initializer=seeded(seed + 2))(pooled)
    return keras.Model(inputs, {"row": row, "seq": seq})


def two_head_data():
    rng = np.random.default_rng(2)
    return [(x, {"row": rng.normal(size=(len(x), 2)), "seq": y}) for x, y in token_data(RAGGED)]


def concat_heads(batches):
    heads = {key: np.concatenate([b[1][key] for b in batches]) for key in ("row", "seq")}
    return np.concatenate([b[0] for b in batches]), heads


@check
def multi_output_dict_of_losses():
    """Two heads, a dict of losses and loss weights, ragged micro-batches: both losses count
    rows (x a fixed size), so one window count divides both exactly."""
    micro = two_head_data()
    full = [concat_heads(micro[i : i + 3]) for i in (0, 3)]
    loss = {"row": "mse", "seq": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    options = {"loss": loss, "loss_weights": {"row": 1.0, "seq": 0.5}}
    ref = two_heads()
    ref.compile(optimizer=densified(keras.optimizers.Adam(0.05)), **options)
    ref.fit(Batches(full + full), shuffle=False, verbose=0)
    model = two_heads()
    trainer = gk.accumulate(model, steps=3)
    trainer.compile(optimizer=keras.optimizers.Adam(0.05), metrics={"row": ["mae"]}, **options)
    trainer.fit(Batches(micro), epochs=2, shuffle=False, verbose=0)
    return {"gap": gap(weights(model), weights(ref)), "state": trainer.window_state}


@check
def multi_output_counts_that_differ_are_refused():
    """A masked token head next to a per-row head: one count cannot divide both; refused at
    compile(), before any weight changes (a custom count= opts out)."""
    micro = two_head_data()
    loss = {"row": "mse", "seq": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    model = two_heads(masked=True)
    before = weights(model)
    trainer = gk.accumulate(model, steps=3)
    try:  # a functional model's masks are known at compile(); a subclassed one's at step one
        trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
        trainer.fit(Batches(micro), shuffle=False, verbose=0)
        message = None
    except ValueError as error:
        message = str(error)
    result = {"message": message, "unchanged": gap(weights(model), before) == 0.0}
    # Negative control: the same heads without the mask train (rows count alike).
    plain = gk.accumulate(two_heads(), steps=3)
    plain.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    plain.fit(Batches(micro), shuffle=False, verbose=0)
    result["unmasked_state"] = plain.window_state
    return result


def _scce_ignoring_padding(y_true, y_pred):
    """A loss function that drops class 0 itself (it masks its values; no `ignore_class` attr)."""
    return keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True, ignore_class=0
    )


@check
def ignore_class_next_to_another_loss_is_refused():
    """`SparseCategoricalCrossentropy(ignore_class=0)` on a token head next to a per-row head:
    it counts the tokens its labels keep, the other rows; one window count divided both and
    the run ended 0.53 away from the full batch, silently. Refused (at compile() when the loss
    says ignore_class, at the first step when a loss function masks its values), nothing
    changed; one such loss alone stays exact."""
    micro = two_head_data()
    ignoring = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    messages, unchanged = {}, {}
    for label, loss in {
        "dict": {"row": "mse", "seq": ignoring},
        "list": ["mse", ignoring],
        "function": {"row": "mse", "seq": _scce_ignoring_padding},
    }.items():
        model = two_heads()
        before = weights(model)
        trainer = gk.accumulate(model, steps=3)
        data = micro if label != "list" else [(x, [y["row"], y["seq"]]) for x, y in micro]
        try:
            trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
            trainer.fit(Batches(data), shuffle=False, verbose=0)
            messages[label] = None
        except ValueError as error:
            messages[label] = str(error)
        if BACKEND != "jax" or label != "function":  # JAX's fit purges the variables first
            unchanged[label] = gap(weights(model), before) == 0.0
    # NEGATIVE CONTROL: opting out with count= (rows) trains the two heads off the full batch.
    loss = {"row": "mse", "seq": ignoring}
    full = [concat_heads(micro[i : i + 3]) for i in (0, 3)]
    ref = two_heads()
    ref.compile(optimizer=densified(keras.optimizers.Adam(0.05)), loss=loss)
    ref.fit(Batches(full), shuffle=False, verbose=0)
    model = two_heads()
    rows = lambda x, y, y_pred, sample_weight: ops.shape(x)[0]  # noqa: E731
    trainer = gk.accumulate(model, steps=3, count=rows)
    trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    trainer.fit(Batches(micro), shuffle=False, verbose=0)
    alone = compare(token_model, lambda: keras.optimizers.Adam(0.05), token_data(TOKEN_ROWS), 3,
                    loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=0))  # fmt: skip
    one_count = gap(weights(model), weights(ref))
    return {"messages": messages, "unchanged": unchanged, "gap": alone["gap"],
            "state": alone["state"], "gap_one_count": one_count}  # fmt: skip


class _Crash(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise KeyboardInterrupt("the machine went away")


@check
def backup_and_restore_resumes_exactly():
    """`BackupAndRestore` (save_weights / load_weights each epoch): a run killed after epoch 2
    and started again ends where the uninterrupted run ends, optimizer state included."""
    import shutil
    import tempfile

    micro = regression([4] * 6, seed=4)

    def run(folder, crash=False):
        model = mlp()
        trainer = gk.accumulate(model, steps=3)
        trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        extra = [_Crash()] if crash else []
        backup = keras.callbacks.BackupAndRestore(folder)
        trainer.fit(Batches(micro), epochs=4, shuffle=False, verbose=0, callbacks=[backup, *extra])
        return model, trainer

    whole, _ = run(tempfile.mkdtemp())
    folder = tempfile.mkdtemp()
    with contextlib.suppress(KeyboardInterrupt):
        run(folder, crash=True)
    backup = os.path.join(tempfile.mkdtemp(), "epoch2.weights.h5")  # a successful fit deletes it
    shutil.copy(os.path.join(folder, "latest.weights.h5"), backup)
    resumed, trainer = run(folder)
    result = {"gap": gap(weights(resumed), weights(whole)), "state": trainer.window_state}
    # A plain model compiled with the same optimizer reads the optimizer state of the file.
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(backup)
    result["plain_iterations"] = int(ops.convert_to_numpy(plain.optimizer.iterations))
    # NEGATIVE CONTROL: the weights alone (a fresh Adam) resumed from epoch 2 end elsewhere.
    model = mlp()
    model.load_weights(backup)  # the plain model has no optimizer to load into
    trainer = gk.accumulate(model, steps=3)
    trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    trainer.fit(Batches(micro), epochs=4, initial_epoch=2, shuffle=False, verbose=0)
    result["gap_weights_only"] = gap(weights(model), weights(whole))
    return result


@check
def keras_file_resumes_exactly():
    """`ModelCheckpoint("ck.keras")` after epoch 2; `load_model` gives a compiled model with the
    optimizer's state, and wrapping it again resumes exactly, as a plain model's file does."""
    import tempfile

    micro = regression([4] * 6, seed=7)

    def run(model, optimizer, epochs, initial_epoch=0, callbacks=()):
        trainer = gk.accumulate(model, steps=3)
        trainer.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
        trainer.fit(Batches(micro), epochs=epochs, initial_epoch=initial_epoch, shuffle=False,
                    verbose=0, callbacks=list(callbacks))  # fmt: skip
        return trainer

    whole = mlp()
    run(whole, keras.optimizers.Adam(0.05), epochs=4)
    path = os.path.join(tempfile.mkdtemp(), "ck.keras")
    run(mlp(), keras.optimizers.Adam(0.05), epochs=2,
        callbacks=[keras.callbacks.ModelCheckpoint(path)])  # fmt: skip
    loaded = keras.models.load_model(path)
    result = {"compiled": loaded.compiled,
              "iterations": int(ops.convert_to_numpy(loaded.optimizer.iterations))}  # fmt: skip
    trainer = run(loaded, loaded.optimizer, epochs=4, initial_epoch=2)
    result.update(gap=gap(weights(loaded), weights(whole)), state=trainer.window_state)
    # mixed_float16: load_model compiles a LossScaleOptimizer; the file must be laid out alike.
    keras.config.set_dtype_policy("mixed_float16")
    try:
        whole = mlp()
        run(whole, keras.optimizers.Adam(0.05), epochs=4)
        path = os.path.join(tempfile.mkdtemp(), "ck16.keras")
        run(mlp(), keras.optimizers.Adam(0.05), epochs=2,
            callbacks=[keras.callbacks.ModelCheckpoint(path)])  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = keras.models.load_model(path)
        result["fp16_skipped_loading"] = [
            str(w.message) for w in caught if "Skipping" in str(w.message)
        ]
        result["fp16_iterations"] = int(ops.convert_to_numpy(loaded.optimizer.iterations))
        run(loaded, loaded.optimizer, epochs=4, initial_epoch=2)
        result["fp16_gap"] = gap(weights(loaded), weights(whole))
    finally:
        keras.config.set_dtype_policy("float64")
    # NEGATIVE CONTROL: the weights alone, with a fresh Adam, end elsewhere.
    fresh = keras.models.load_model(path, compile=False)
    run(fresh, keras.optimizers.Adam(0.05), epochs=4, initial_epoch=2)
    result["gap_fresh_optimizer"] = gap(weights(fresh), weights(whole))
    return result


@check
def backup_and_restore_of_unknown_length():
    """Epochs of unknown length end with an open window that the epoch's end settles: that must
    come before `BackupAndRestore` saves, or the file misses the epoch's last step."""
    import tempfile

    if importlib.util.find_spec("tensorflow") is None:
        return {"skipped": "needs tf.data"}
    micro = regression([4] * 10, seed=5)  # windows of 4: 4, 4 and a leftover of 2 per epoch

    def run(folder, crash=False):
        model = mlp()
        trainer = gk.accumulate(model, steps=4)
        trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        callbacks = [keras.callbacks.BackupAndRestore(folder), *([_Crash()] if crash else [])]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(unknown_length(micro), epochs=4, verbose=0, callbacks=callbacks)
        return model, trainer, any("open window" in str(w.message) for w in caught)

    whole, _, warned = run(tempfile.mkdtemp())
    folder = tempfile.mkdtemp()
    with contextlib.suppress(KeyboardInterrupt):
        run(folder, crash=True)
    resumed, trainer, _ = run(folder)
    return {"gap": gap(weights(resumed), weights(whole)), "state": trainer.window_state,
            "warned_open_window": warned}  # fmt: skip


@check
def steps_per_execution_and_jit():
    if BACKEND == "torch":  # Keras: "steps_per_execution must be 1 with the PyTorch backend"
        return {"skipped": "keras's torch backend runs neither steps_per_execution > 1 nor XLA"}
    micro = regression(RAGGED)
    return compare(mlp, adam_with_schedule, micro, steps=3, epochs=2,
                   steps_per_execution=4, jit_compile=True)  # fmt: skip


@check
def builtin_gradient_accumulation_fails():
    """Negative control: Keras's own gradient_accumulation_steps on the same ragged data."""
    micro = regression(RAGGED)
    full, _ = windows(micro, 3, "step", 2)
    ref = fit_plain(mlp, keras.optimizers.Adam(0.05), full)
    builtin = fit_plain(
        mlp, keras.optimizers.Adam(0.05, gradient_accumulation_steps=3), micro, epochs=2
    )
    return {"gap": gap(weights(builtin), weights(ref))}


def grads_of(model, loss_fn, x, y):  # the seed's loop: gradients of the micro-batch MEAN
    """Gradients of loss_fn(y, model(x)) for the trainable weights, on this backend."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=True))
        return tape.gradient(value, model.trainable_weights)
    if BACKEND == "torch":
        import torch

        value = loss_fn(y, model(x, training=True))
        return list(torch.autograd.grad(value, [v.value for v in model.trainable_weights]))
    import jax

    def value(trainable):
        pred, _ = model.stateless_call(
            trainable, [v.value for v in model.non_trainable_variables], x
        )
        return loss_fn(y, pred)

    return jax.grad(value)([v.value for v in model.trainable_variables])


@check
def seed_loop_fails():
    """Negative control: the seed post's loop, which applies only the current micro-batch."""
    micro = regression([4] * 8, seed=7)
    full, _ = windows(micro, 4, "step")
    ref = fit_plain(mlp, keras.optimizers.SGD(0.1), full)
    model, optimizer, num_accum = mlp(), keras.optimizers.SGD(0.1), 4
    loss_fn = keras.losses.MeanSquaredError()
    accumulation = [ops.zeros(w.shape, w.dtype) for w in model.trainable_weights]
    for step, (x, y) in enumerate(micro):
        gradients = grads_of(model, loss_fn, x, y)
        if step % num_accum == 0:  # the seed's bug: steps on `gradients`, not the sum
            accumulation = [g / num_accum for g in accumulation]
            optimizer.apply(gradients, model.trainable_weights)
            accumulation = [ops.zeros(w.shape, w.dtype) for w in model.trainable_weights]
        else:
            accumulation = [a + g for a, g in zip(accumulation, gradients, strict=True)]
    return {"gap": gap(weights(model), weights(ref))}


_SUM_GRADS = {}


def sum_grads(model, loss, x, y):
    """Gradients of the batch's loss SUM and its count: a GradientTape, or a jitted jax.grad."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            total, count = gk.loss_sum(loss, y, model(x, training=True))
        return tape.gradient(total, model.trainable_weights), count
    if BACKEND == "torch":
        import torch

        total, count = gk.loss_sum(loss, y, model(x, training=True))
        return list(torch.autograd.grad(total, [v.value for v in model.trainable_weights])), count
    import jax

    if id(model) not in _SUM_GRADS:

        def total(trainable, non_trainable, x, y):
            pred, _ = model.stateless_call(trainable, non_trainable, x, training=True)
            return gk.loss_sum(loss, y, pred)

        _SUM_GRADS[id(model)] = jax.jit(jax.grad(total, has_aux=True))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    return _SUM_GRADS[id(model)](trainable, non_trainable, x, y)


@check
def hand_written_loop():
    """GradientWindow + loss_sum in a GradientTape / jax.grad loop equals the full-batch step."""
    micro = token_data(TOKEN_ROWS)
    full, _ = windows(micro, 3, "step")
    loss = keras.losses.SparseCategoricalCrossentropy()
    ref = fit_plain(token_model, keras.optimizers.Adam(0.05), full, loss=loss)
    model, optimizer = token_model(), keras.optimizers.Adam(0.05)
    stepped = 0
    for start in range(0, len(micro), 3):
        window = gk.GradientWindow.zeros(model.trainable_weights)
        for x, y in micro[start : start + 3]:
            window = window.add(*sum_grads(model, loss, x, y))
        stepped += window.apply(optimizer, model.trainable_weights)
    return {"gap": gap(weights(model), weights(ref)), "stepped": stepped}


@check
def gradient_window_refuses_mismatched_input():
    """GradientWindow.add refuses gradients shaped unlike their slots and counts that are not one
    number. (Swapped gradients broadcast silently: the kernel's slot got the bias gradient on
    every row and the bias's slot grew to the kernel's shape; a string count was read as a
    number on JAX.)"""
    kernel, bias = np.ones((3, 3)), np.ones((3,))
    window = gk.GradientWindow.zeros([kernel, bias]).add([kernel, bias], count=2)
    messages = {}
    for label, (grads, count) in {
        "swapped": ([bias, kernel], 1),
        "count_str": ([kernel, bias], "2"),
        "count_none": ([kernel, bias], None),
        "count_vector": ([kernel, bias], np.array([1.0, 2.0])),
    }.items():
        try:
            window.add(grads, count)
            messages[label] = None
        except (TypeError, ValueError) as error:
            messages[label] = f"{type(error).__name__}: {error}"
    mean = [ops.convert_to_numpy(m).tolist() for m in window.mean()]
    return {"messages": messages, "mean": mean}


@check
def bad_input_is_refused():
    """Each bad argument raises an error naming the fix, before anything changes."""
    messages = {}
    model = mlp()
    for label, call in {
        "steps=0": lambda: gk.accumulate(model, steps=0),
        "steps=True": lambda: gk.accumulate(model, steps=True),
        "steps=np.int64(3)": lambda: gk.accumulate(model, steps=np.int64(3)),
        "policy": lambda: gk.accumulate(model, steps=2, partial_window="later"),
        "count": lambda: gk.accumulate(model, steps=2, count=3),
        "wrapped": lambda: gk.accumulate(gk.accumulate(model, steps=2), steps=2),
    }.items():
        try:
            call()
            messages[label] = None
        except (TypeError, ValueError) as error:
            messages[label] = str(error)
    trainer = gk.accumulate(model, steps=2)
    builtin = keras.optimizers.SGD(gradient_accumulation_steps=2)
    summed = keras.losses.MeanSquaredError(reduction="sum")
    for label, kwargs in {
        "builtin": {"optimizer": builtin, "loss": "mse"},
        "sum": {"optimizer": "sgd", "loss": summed},
    }.items():
        try:
            trainer.compile(**kwargs)
            messages[label] = None
        except ValueError as error:
            messages[label] = str(error)
    # Keras's own accumulation inside a LossScaleOptimizer: the window's step would be averaged
    # over 2 windows and taken every other window (it was accepted silently).
    hidden = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(gradient_accumulation_steps=2)
    )
    try:
        trainer.compile(optimizer=hidden, loss="mse")
        messages["builtin_in_loss_scale"] = None
    except ValueError as error:
        messages["builtin_in_loss_scale"] = str(error)
    result = {"messages": messages, "compiled": bool(trainer.compiled)}
    # A micro-batch size that is not a positive int: refused before any step (on TensorFlow
    # batch_size=0 trained on all the data at once; on JAX it raised a bare TypeError).
    x, y = regression([8])[0]
    fitted = gk.accumulate(model, steps=2)
    fitted.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    before = weights(model)
    for label, size in {"batch_size=0": 0, "batch_size=-1": -1, "batch_size='4'": "4"}.items():
        try:
            fitted.fit(x, y, batch_size=size, verbose=0)
            messages[label] = None
        except (TypeError, ValueError) as error:
            messages[label] = str(error)
    result.update(fit_unchanged=gap(weights(model), before) == 0.0, fit_state=fitted.window_state)
    return result


class _Mlp(keras.Model):
    """`mlp()` as a subclassed model."""

    def __init__(self, seed=1):
        super().__init__(name="subclassed_mlp")  # TensorFlow refuses names starting with "_"
        self.hidden = keras.layers.Dense(16, activation="relu", kernel_initializer=seeded(seed))
        self.out = keras.layers.Dense(3, kernel_initializer=seeded(seed + 1))

    def call(self, x, training=None):
        return self.out(self.hidden(x))


class _MlpWithOwnLoss(_Mlp):
    """Keras 3's idiom for a custom loss (here MSE plus 0.5 * MAE): override compute_loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return ops.mean(ops.square(y - y_pred)) + 0.5 * ops.mean(ops.abs(y - y_pred))


class _MlpWithOwnStep(_Mlp):
    def train_step(self, *args):  # never reached: the wrapper is refused
        raise AssertionError("a custom train_step ran")


class _AccumulatingWithOwnLoss(gk.AccumulatingModel):
    """The documented fix: the extra loss term lives in the wrapper's compute_loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        base = super().compute_loss(x, y, y_pred, sample_weight, training)
        return base + 0.5 * ops.mean(ops.abs(y - y_pred))  # a per-row mean, as MSE's count


@check
def overridden_steps_are_refused():
    """A wrapped model's own `compute_loss` or `train_step` would never run (the wrapper trains
    with Keras's standard step): refused at wrap time, naming the fix; the fix is exact."""
    micro = regression([4] * 6, seed=6)
    messages = {}
    models = {"compute_loss": _MlpWithOwnLoss(), "train_step": _MlpWithOwnStep()}
    for label, model in models.items():
        model(micro[0][0])
        before = weights(model)
        try:
            gk.accumulate(model, steps=3)
            messages[label] = None
        except TypeError as error:
            messages[label] = str(error)
        messages[label + "_unchanged"] = gap(weights(model), before) == 0.0
    # The plain model's own compute_loss, one full-batch step per window: the reference.
    ref = _MlpWithOwnLoss()
    ref(micro[0][0])
    ref.compile(optimizer=keras.optimizers.Adam(0.05))
    full, _ = windows(micro, 3)
    ref.fit(Batches(full), shuffle=False, verbose=0)
    fixed_model = mlp()
    trainer = _AccumulatingWithOwnLoss(fixed_model, steps=3)
    trainer.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    trainer.fit(Batches(micro), shuffle=False, verbose=0)
    # NEGATIVE CONTROL: the compiled loss alone (what the wrapper used to train instead).
    ignored = mlp()
    plain = gk.accumulate(ignored, steps=3)
    plain.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    plain.fit(Batches(micro), shuffle=False, verbose=0)
    return {"messages": messages, "gap": gap(weights(fixed_model), weights(ref)),
            "state": trainer.window_state,
            "gap_compiled_loss_only": gap(weights(ignored), weights(ref))}  # fmt: skip


def _scalar_mse(y_true, y_pred):
    """A loss function that reduces the batch itself, as many hand-written ones do."""
    return ops.mean(ops.square(y_true - y_pred))


@check
def scalar_loss_function_on_ragged_micro_batches():
    """A compiled loss function returning one number per batch (its mean): each micro-batch
    must weigh by its rows, or the short ones weigh as much as full ones."""
    micro = regression(RAGGED, seed=8)
    result = compare(mlp, adam_with_schedule, micro, steps=3, loss=_scalar_mse, epochs=2)
    # NEGATIVE CONTROL: one count per micro-batch (a mean of micro-batch means) is not exact.
    full, _ = windows(micro, 3, epochs=2)
    ref = fit_plain(mlp, adam_with_schedule(), full, loss=_scalar_mse)
    model = mlp()
    trainer = gk.accumulate(model, steps=3, count=lambda x, y, y_pred, sample_weight: 1.0)
    trainer.compile(optimizer=adam_with_schedule(), loss=_scalar_mse)
    trainer.fit(Batches(micro), epochs=2, shuffle=False, verbose=0)
    result["gap_one_per_micro_batch"] = gap(weights(model), weights(ref))
    # loss_sum of such a function: sum / count is Keras's value, and the count is the rows.
    y_true = micro[0][1]
    y_pred = y_true + np.random.default_rng(9).normal(size=y_true.shape)
    worst = 0.0
    for sample_weight in (None, np.linspace(0.5, 2.0, len(y_true))):
        total, count = gk.loss_sum(_scalar_mse, y_true, y_pred, sample_weight=sample_weight)
        keras_loss = get_loss(_scalar_mse, y_true, y_pred)  # what compile() makes of it
        expected = float(keras_loss(y_true, y_pred, sample_weight=sample_weight))
        worst = max(worst, abs(float(total) / float(count) - expected) / abs(expected))
        result["loss_sum_count"] = float(count)
    result["loss_sum_gap"] = worst
    return result


@check
def loss_sum_matches_keras():
    """sum / count reproduces Keras's value for each mean reduction, with masks and weights."""
    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 5, size=(4, 6))
    y_pred = keras.ops.convert_to_tensor(rng.normal(size=(4, 6, 5)))
    mask = keras.ops.convert_to_tensor(rng.uniform(size=(4, 6)) > 0.3)
    weight = rng.uniform(0.1, 2.0, size=(4, 6))
    worst = 0.0
    for reduction in ("sum_over_batch_size", "mean", "mean_with_sample_weight"):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
        for sw in (None, weight):
            for use_mask in (False, True):
                pred = keras.ops.convert_to_tensor(y_pred)
                if use_mask:
                    keras.src.backend.set_keras_mask(pred, mask)
                expected = float(loss(y_true, pred, sample_weight=sw))
                total, count = gk.loss_sum(loss, y_true, pred, sample_weight=sw)
                worst = max(worst, abs(float(total) / float(count) - expected) / abs(expected))
    return {"gap": worst}


@check
def fp16_overflow_skips_the_window():
    """A non-finite micro-batch under mixed_float16 skips its whole window; the scale halves."""
    micro = regression([4] * 9, seed=11)
    poisoned = list(micro)
    poisoned[4] = (np.full_like(micro[4][0], 1e30), micro[4][1])  # overflows in float16
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model, trainer = fit_accumulated(mlp, keras.optimizers.Adam(0.02), poisoned, steps=3)
        scale = float(ops.convert_to_numpy(trainer.optimizer.dynamic_scale))
        kept = micro[:3] + micro[6:]
        clean, _ = fit_accumulated(mlp, keras.optimizers.Adam(0.02), kept, steps=3)
        ref = fit_plain(mlp, keras.optimizers.Adam(0.02), windows(kept, 3)[0])
    finally:
        keras.config.set_dtype_policy("float64")
    return {
        "state": trainer.window_state,
        "scale": scale,
        "gap_vs_clean_run": gap(weights(model), weights(clean)),
        "gap_vs_full_batch": gap(weights(model), weights(ref)),
        "inner_iterations": int(ops.convert_to_numpy(trainer.optimizer.iterations)),
    }


@check
def batchnorm_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gk.accumulate(mlp(norm=keras.layers.BatchNormalization()), steps=2)
    warned = [w for w in caught if issubclass(w.category, BatchNormAccumulationWarning)]
    micro = regression([4, 4, 4, 4])
    make = lambda: mlp(norm=keras.layers.BatchNormalization())  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchNormAccumulationWarning)
        result = compare(make, lambda: keras.optimizers.SGD(0.1), micro, steps=2)
    return {
        "warned": len(warned),
        "gap": result["gap"],
        "file": warned[0].filename if warned else "",
    }


def frozen_base(trainable):
    hidden = keras.layers.Dense(16, kernel_initializer=seeded(1))
    base = keras.Sequential([keras.Input((6,)), hidden, keras.layers.BatchNormalization()])
    base.trainable = trainable
    head = keras.layers.Dense(3, kernel_initializer=seeded(2))
    return keras.Sequential([keras.Input((6,)), base, head]), base


@check
def frozen_batchnorm_is_exact_and_not_warned():
    """Transfer learning: a frozen base's BatchNormalization runs on its moving statistics, so
    accumulation is exact; it was warned about as not exact (a false alarm). A base unfrozen
    after wrapping is warned about at compile()."""
    micro = regression([4] * 6, seed=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compare(lambda: frozen_base(False)[0], lambda: keras.optimizers.Adam(0.05),
                         micro, steps=3, epochs=2)  # fmt: skip
        frozen_warned = sum(issubclass(w.category, BatchNormAccumulationWarning) for w in caught)
        caught.clear()
        model, base = frozen_base(False)
        trainer = gk.accumulate(model, steps=3)
        base.trainable = True  # unfrozen for fine-tuning, then compiled: now it is not exact
        trainer.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        trainer.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")  # named once
        unfrozen = [str(w.message) for w in caught if w.category is BatchNormAccumulationWarning]
    result.update(frozen_warned=frozen_warned, unfrozen=unfrozen)
    return result


class FineTuned(keras.Model):
    """The fine-tuning recipe in a subclassed model: an unfrozen base called in inference mode."""

    def __init__(self, inference):
        super().__init__()
        self.inference = inference
        hidden = keras.layers.Dense(16, kernel_initializer=seeded(1))
        self.base = keras.Sequential([keras.Input((6,)), hidden, keras.layers.BatchNormalization()])
        self.head = keras.layers.Dense(3, kernel_initializer=seeded(2))

    def call(self, x, training=None):
        return self.head(self.base(x, training=False if self.inference else training))


def _fine_tuned(inference):
    model = FineTuned(inference)
    model(np.zeros((1, 6)))
    return model


@check
def batchnorm_called_in_inference_mode_is_exact_and_not_warned():
    """`self.base(x, training=False)` in a subclassed model's call, the base trainable: its
    BatchNormalization runs on its moving statistics (as in a plain fit), so accumulation is
    exact; it was warned about as not exact (a false alarm). The same model passing `training`
    through is warned (its statistics move). In a functional model Keras 3 passes fit's
    training=True through `base(x, training=False)`: plain fit trains that layer, and so it
    is warned about."""
    micro = regression([4] * 6, seed=8)
    adam = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    found = {}
    for label, make in {
        "inference": lambda: _fine_tuned(True),
        "training": lambda: _fine_tuned(False),
        "functional": lambda: _functional_fine_tuned(),
    }.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = compare(make, adam, micro, steps=3)
        warned = [w for w in caught if issubclass(w.category, BatchNormAccumulationWarning)]
        found[label] = {"gap": result["gap"], "state": result["state"], "warned": len(warned)}
    plain = fit_plain(_functional_fine_tuned, adam(), windows(micro, 3)[0])
    stats = [w for w in plain.weights if "moving_variance" in w.path]
    found["functional"]["plain_fit_moves_statistics"] = bool(
        np.any(ops.convert_to_numpy(stats[0]) != 1.0)
    )
    return found


def _functional_fine_tuned():
    hidden = keras.layers.Dense(16, kernel_initializer=seeded(1))
    base = keras.Sequential([keras.Input((6,)), hidden, keras.layers.BatchNormalization()])
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3, kernel_initializer=seeded(2))(base(inputs, training=False))
    return keras.Model(inputs, outputs)


def _dice_case():
    """Four micro-batches of 4 rows (6 features, 3 binary targets) and a sigmoid head's maker."""
    rng = np.random.default_rng(1)
    micro = [(rng.normal(size=(4, 6)), (rng.uniform(size=(4, 3)) > 0.5).astype("float64"))
             for _ in range(4)]  # fmt: skip

    def make():
        head = keras.layers.Dense(3, activation="sigmoid", kernel_initializer=seeded(2))
        return keras.Sequential([keras.Input((6,)), head])

    return micro, make


@check
def batch_dice_warns():
    """Keras's Dice (axis=None by default) is one ratio over the whole batch: not additive over
    micro-batches (1e-2 off, silently); compile() warns naming axis=. A per-sample Dice is
    exact and not warned."""
    micro, make = _dice_case()

    sgd = lambda: keras.optimizers.SGD(0.5)  # noqa: E731
    found = {}
    dice = {"batch": keras.losses.Dice(), "per_sample": keras.losses.Dice(axis=1)}
    for label, loss in dice.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = compare(make, sgd, micro, steps=2, loss=loss)
        found[label] = {"gap": result["gap"], "state": result["state"], "warned": [
            str(w.message) for w in caught if "axis=None" in str(w.message)]}  # fmt: skip
    return found


def _activity_mlp():
    penalty = keras.regularizers.L2(0.1)
    hidden = keras.layers.Dense(16, activation="relu", kernel_initializer=seeded(1),
                                activity_regularizer=penalty)  # fmt: skip
    head = keras.layers.Dense(3, kernel_initializer=seeded(2))
    return keras.Sequential([keras.Input((6,)), hidden, head])


def _activity_tokens():
    embedding = keras.initializers.RandomUniform(-0.5, 0.5, seed=1)
    penalty = keras.regularizers.L2(0.1)
    return keras.Sequential([
        keras.Input((None,), dtype="int32"),
        keras.layers.Embedding(11, 8, mask_zero=True, embeddings_initializer=embedding),
        keras.layers.Dense(16, activation="relu", kernel_initializer=seeded(2),
                           activity_regularizer=penalty),
        keras.layers.Dense(11, kernel_initializer=seeded(3)),
    ])  # fmt: skip


@check
def activity_regularizer_counts():
    """Keras 3 divides an activity regularizer's penalty by the batch's rows: next to a per-row
    loss it accumulates exactly (ragged micro-batches). Next to a loss counting masked tokens or
    summed sample weights the window weighed it by those (0.1 off, silently): refused, at
    compile() for a masked output, at the first step for weights; nothing changed."""
    adam = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    result = compare(_activity_mlp, adam, regression(RAGGED), steps=3, epochs=2)
    scce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    weighted = [(x, y, np.linspace(0.2, 2.0, len(x))) for x, y in regression([4] * 6, seed=3)]
    messages, unchanged = {}, {}
    for label, make, loss, data in [
        ("masked", _activity_tokens, scce, token_data(TOKEN_ROWS)),
        ("weights", _activity_mlp, keras.losses.MeanSquaredError(
            reduction="mean_with_sample_weight"), weighted),
    ]:  # fmt: skip
        model = make()
        before = weights(model)
        trainer = gk.accumulate(model, steps=3)
        try:
            trainer.compile(optimizer=adam(), loss=loss)
            trainer.fit(Batches(data), shuffle=False, verbose=0)
            messages[label] = None
        except ValueError as error:
            messages[label] = str(error)
        if BACKEND != "jax" or label == "masked":  # JAX's fit purges the variables first
            unchanged[label] = gap(weights(model), before) == 0.0
    # NEGATIVE CONTROL: count= (the same token count as the default) opts out, and the run ends
    # off the full batch: the penalty was weighed by tokens.
    tokens = lambda x, y, y_pred, sample_weight: gk.loss_count(scce, y, y_pred)  # noqa: E731
    micro = token_data(TOKEN_ROWS)
    ref = fit_plain(_activity_tokens, adam(), windows(micro, 3)[0], loss=scce)
    model = _activity_tokens()
    trainer = gk.accumulate(model, steps=3, count=tokens)
    trainer.compile(optimizer=adam(), loss=scce)
    trainer.fit(Batches(micro), shuffle=False, verbose=0)
    result.update(messages=messages, unchanged=unchanged,
                  gap_token_count=gap(weights(model), weights(ref)))  # fmt: skip
    return result


class _AddedTerm(keras.layers.Layer):
    """A layer adding its own loss term: a mean over rows, a sum over rows, or a constant."""

    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind, self.supports_masking = kind, True

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        y = x * self.scale
        if self.kind == "row_mean":
            self.add_loss(0.1 * ops.mean(ops.sum(ops.square(y), axis=-1)))
        elif self.kind == "row_sum":
            self.add_loss(0.01 * ops.sum(ops.square(y)))
        else:  # a weight penalty: the same for every batch
            self.add_loss(0.1 * ops.sum(ops.square(self.scale)))
        return y


def _added_mlp(kind):
    return lambda: keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, kernel_initializer=seeded(1)), _AddedTerm(kind),
        keras.layers.Dense(3, kernel_initializer=seeded(2)),
    ])  # fmt: skip


def _added_tokens(kind="row_mean"):
    embedding = keras.initializers.RandomUniform(-0.5, 0.5, seed=1)
    return lambda: keras.Sequential([
        keras.Input((None,), dtype="int32"),
        keras.layers.Embedding(11, 8, mask_zero=True, embeddings_initializer=embedding),
        _AddedTerm(kind), keras.layers.Dense(11, kernel_initializer=seeded(2)),
    ])  # fmt: skip


@check
def add_loss_terms():
    """`self.add_loss(...)` in a layer: a full-batch step adds the term once, computed on the
    window's rows. A mean over rows (beside a per-row loss) and a constant are exact; a SUM over
    rows was weighed like a mean (about 1/steps of it, 0.4-0.5 off, silently) and a mean over rows
    beside a masked token loss was weighed by tokens: both refused at compile(), nothing changed."""
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    scce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    micro = regression(RAGGED)
    found = {kind: compare(_added_mlp(kind), sgd, micro, steps=3) for kind in ("row_mean", "const")}
    found["token_const"] = compare(
        _added_tokens("const"), sgd, token_data(TOKEN_ROWS), 3, loss=scce
    )
    for exact in found.values():
        exact.pop("weights")
    messages, unchanged = {}, {}
    for label, make, loss in [("row_sum", _added_mlp("row_sum"), "mse"),
                              ("token_row_mean", _added_tokens(), scce)]:  # fmt: skip
        model = make()
        before = weights(model)
        trainer = gk.accumulate(model, steps=3)
        try:
            trainer.compile(optimizer=sgd(), loss=loss)
            messages[label] = None
        except ValueError as error:
            messages[label] = str(error)
        unchanged[label] = gap(weights(model), before) == 0.0 and not trainer.compiled
    # NEGATIVE CONTROL: count= (rows, the default's count) skips the check: the sum is averaged.
    rows = lambda x, y, y_pred, sample_weight: ops.shape(x)[0]  # noqa: E731
    ref = fit_plain(_added_mlp("row_sum"), sgd(), windows(micro, 3)[0])
    model = _added_mlp("row_sum")()
    trainer = gk.accumulate(model, steps=3, count=rows)
    trainer.compile(optimizer=sgd(), loss="mse")
    trainer.fit(Batches(micro), shuffle=False, verbose=0)
    found.update(
        messages=messages, unchanged=unchanged, gap_row_sum=gap(weights(model), weights(ref))
    )
    return found


class _KL(keras.layers.Layer):
    """A VAE's KL term added by a layer: `ops.mean` over rows (the recipe) or `ops.sum`."""

    def __init__(self, summed, **kwargs):
        super().__init__(**kwargs)
        self.summed = summed

    def call(self, inputs):
        mean, log_var = inputs
        kl = -0.5 * ops.sum(1 + log_var - ops.square(mean) - ops.exp(log_var), axis=-1)
        self.add_loss(0.05 * (ops.sum(kl) if self.summed else ops.mean(kl)))
        return mean


class _Vae(keras.Model):
    """A subclassed VAE-style model (deterministic: z is the mean) adding its KL via add_loss;
    `direct` adds a row sum in its own call (which takes no `training` argument)."""

    def __init__(self, summed=False, direct=False, extra=None):
        super().__init__(name="subclassed_vae")
        self.direct, self.extra = direct, extra
        self.enc = keras.layers.Dense(8, activation="tanh", kernel_initializer=seeded(1))
        self.mean = keras.layers.Dense(2, kernel_initializer=seeded(2))
        self.log_var = keras.layers.Dense(2, kernel_initializer=seeded(3))
        self.kl = _KL(summed, name="kl")
        self.dec = keras.layers.Dense(6, kernel_initializer=seeded(4))

    def call(self, x):
        h = self.enc(x)
        z = self.kl([self.mean(h), self.log_var(h)])
        if self.direct:
            self.add_loss(0.01 * ops.sum(ops.square(h)))
        if self.extra is not None:
            z = self.extra(z)
        return self.dec(z)


def _conv_added(kind):
    """A functional model over sequences of any length (`Input((None, 4))`) with a kernel of 5:
    it cannot run on compile()'s tiny random rows (3 steps), only on real batches."""
    return lambda: keras.Sequential([
        keras.Input((None, 4)), keras.layers.Conv1D(8, 5, kernel_initializer=seeded(1)),
        keras.layers.GlobalAveragePooling1D(), _AddedTerm(kind),
        keras.layers.Dense(3, kernel_initializer=seeded(2)),
    ])  # fmt: skip


def _refused_before_any_step(make, feed):
    """Build the model, then `feed(trainer)`; the message, and whether the weights are as built."""
    model = make()
    trainer = gk.accumulate(model, steps=3)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    try:
        feed(trainer, model)
        return None, True
    except ValueError as error:
        before = weights(model)  # built by the check itself, on the first batch's shapes
        with contextlib.suppress(ValueError):
            feed(trainer, model)  # a second try is refused again
        return str(error), gap(weights(model), before) == 0.0 and trainer.window_state == {
            "steps": 0, "skipped": 0, "pending": 0}  # fmt: skip


@check
def subclassed_and_unreadable_add_loss_terms():
    """A subclassed model's add_loss terms were not read at all (a VAE's KL summed over rows
    0.37-0.48 off, silently), nor a functional model's that cannot run on tiny random rows: they
    are read on rows of the first real batch (arrays, a PyDataset, tf.data, a generator,
    train_on_batch). Row means exact; row sums refused before any step, nothing trained."""
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    rng = np.random.default_rng(0)
    micro = [(x, x) for x in (rng.normal(size=(n, 6)) for n in RAGGED)]
    seq = [(rng.normal(size=(n, 7, 4)), rng.normal(size=(n, 3))) for n in RAGGED]
    found = {"vae_mean": compare(lambda: _Vae(), sgd, micro, steps=3),
             "conv_mean": compare(_conv_added("row_mean"), sgd, seq, steps=3)}  # fmt: skip
    for exact in found.values():
        exact.pop("weights")

    def generator(batches):
        yield from batches

    feeds = {
        "vae_sum": (lambda: _Vae(summed=True), lambda t, m: t.fit(Batches(micro), verbose=0)),
        "direct_sum": (
            lambda: _Vae(direct=True),
            lambda t, m: t.fit(
                np.concatenate([x for x, _ in micro]),
                np.concatenate([y for _, y in micro]),
                batch_size=4,
                verbose=0,
            ),
        ),
        "generator": (lambda: _Vae(summed=True), lambda t, m: t.fit(generator(micro), verbose=0)),
        "train_on_batch": (lambda: _Vae(summed=True), lambda t, m: t.train_on_batch(*micro[0])),
        "conv_sum": (_conv_added("row_sum"), lambda t, m: t.fit(Batches(seq), verbose=0)),
    }
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def tf_data(t, m):
            data = tf.data.Dataset.from_tensor_slices(concat(micro)).batch(4)
            t.fit(data, verbose=0)

        feeds["tf_data"] = (lambda: _Vae(summed=True), tf_data)
    refused = {label: _refused_before_any_step(*feed) for label, feed in feeds.items()}
    found["messages"] = {label: message for label, (message, _) in refused.items()}
    found["unchanged"] = {label: same for label, (_, same) in refused.items()}
    # NEGATIVE CONTROL: count= (rows, the default's count) skips the check: the sum is averaged.
    rows = lambda x, y, y_pred, sample_weight: ops.shape(x)[0]  # noqa: E731
    ref = fit_plain(lambda: _Vae(summed=True), sgd(), windows(micro, 3)[0])
    model = _Vae(summed=True)
    trainer = gk.accumulate(model, steps=3, count=rows)
    trainer.compile(optimizer=sgd(), loss="mse")
    trainer.fit(Batches(micro), shuffle=False, verbose=0)
    found["gap_vae_sum"] = gap(weights(model), weights(ref))
    return found


@check
def loss_sum_warns_about_a_batch_dice():
    """`loss_sum(Dice())` in a hand-written loop took the batch ratio for a row mean, silently;
    it warns as compile() does (a per-sample Dice does not warn, and its loop is exact)."""
    micro, make = _dice_case()

    found = {}
    dice = {"batch": keras.losses.Dice(), "per_sample": keras.losses.Dice(axis=1)}
    for label, loss in dice.items():
        ref = fit_plain(make, keras.optimizers.SGD(0.5), windows(micro, 2)[0], loss=loss)
        model, optimizer = make(), keras.optimizers.SGD(0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for start in (0, 2):
                window = gk.GradientWindow.zeros(model.trainable_weights)
                for x, y in micro[start : start + 2]:
                    window = window.add(*sum_grads(model, loss, x, y))
                window.apply(optimizer, model.trainable_weights)
        warned = [w for w in caught if "axis=None" in str(w.message)]
        found[label] = {"gap": gap(weights(model), weights(ref)), "warned": len(warned),
                        "file": warned[0].filename if warned else ""}  # fmt: skip
    return found


@check
def bf16_adds_only_float32_rounding():
    """mixed_bfloat16 (no loss scale): the window sums float32 gradients, so the adapter adds
    float32 rounding only (one micro-batch per window equals plain fit to 1e-6). With 4
    micro-batches per window the step differs from the plain bf16 full-batch step by bf16's
    rounding of each micro-batch's gradient inside the model's own bf16 ops, and it is no
    farther from the float32 full-batch run than plain bf16 fit is."""
    micro = [(x.astype("float32"), y.astype("float32")) for x, y in regression([64] * 8, seed=5)]
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    keras.config.set_floatx("float32")
    try:
        ref32 = fit_plain(mlp, adam(), windows(micro, 4)[0])
        keras.config.set_dtype_policy("mixed_bfloat16")
        one, _ = fit_accumulated(mlp, adam(), micro, steps=1)
        plain_micro = fit_plain(mlp, adam(), micro)
        model, trainer = fit_accumulated(mlp, adam(), micro, steps=4)
        plain = fit_plain(mlp, adam(), windows(micro, 4)[0])
    finally:
        keras.config.set_dtype_policy("float64")
        keras.config.set_floatx("float64")
    return {"gap_one_micro_batch": gap(weights(one), weights(plain_micro)),
            "gap_vs_plain_bf16": gap(weights(model), weights(plain)),
            "to_float32": gap(weights(model), weights(ref32)),
            "plain_to_float32": gap(weights(plain), weights(ref32)),
            "state": trainer.window_state}  # fmt: skip


@check
def class_weight_is_exact():
    """`fit(class_weight=...)`: Keras turns it into sample weights, which the count weighs as the
    full batch does (rows for the default reduction, summed weights for mean_with_sample_weight)."""
    rng = np.random.default_rng(3)
    x, labels = rng.normal(size=(24, 6)), rng.integers(0, 3, size=24)
    weight = {0: 1.0, 1: 3.0, 2: 0.5}
    make = lambda: mlp(outputs=3)  # noqa: E731
    found = {}
    for reduction in ("sum_over_batch_size", "mean_with_sample_weight"):
        loss = lambda r=reduction: keras.losses.SparseCategoricalCrossentropy(  # noqa: E731
            from_logits=True, reduction=r
        )
        ref = make()
        ref.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
        ref.fit(x, labels, batch_size=12, shuffle=False, verbose=0, class_weight=weight)
        runs = {}
        for label, given in (("weighted", weight), ("unweighted", None)):
            model = make()
            trainer = gk.accumulate(model, steps=3)
            trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
            trainer.fit(x, labels, batch_size=4, shuffle=False, verbose=0, class_weight=given)
            runs[label] = (gap(weights(model), weights(ref)), trainer.window_state)
        found[reduction] = {"gap": runs["weighted"][0], "state": runs["weighted"][1],
                            "gap_without_class_weight": runs["unweighted"][0]}  # fmt: skip
    return found


class TrainingOnlyTerm(keras.layers.Layer):
    """Adds `0.01 * sum (or mean over rows) of x**2` only in training mode, as many do."""

    def __init__(self, summed, **kwargs):
        super().__init__(**kwargs)
        self.summed = summed

    def call(self, x, training=None):
        if training:
            per_row = ops.sum(ops.square(x), axis=-1)
            self.add_loss(0.01 * (ops.sum(per_row) if self.summed else ops.mean(per_row)))
        return x


def _training_only(summed, functional=True):
    def make():
        if functional:
            return mlp(norm=TrainingOnlyTerm(summed))
        return _Vae(summed=False, extra=TrainingOnlyTerm(summed))

    return make


@check
def add_loss_only_in_training():
    """A layer adding its term only when `training` (dropout-style): compile's inference-mode
    read did not see it, so a sum over rows was weighed like a mean (a 0.2 gap, silently). It is
    read in training mode too: a sum refused (functional at compile, subclassed at the first
    batch, a generator's message saying to pass a new one), a mean exact."""
    rng = np.random.default_rng(0)
    micro = [(x, x[:, :3]) for x in (rng.normal(size=(n, 6)) for n in RAGGED)]
    found = {}
    model, _ = fit_accumulated(_training_only(False), keras.optimizers.SGD(0.1), micro, steps=3)
    ref = fit_plain(_training_only(False), keras.optimizers.SGD(0.1), windows(micro, 3)[0])
    found.update(gap=gap(weights(model), weights(ref)), state=_.window_state)
    messages, unchanged = {}, {}
    built = _training_only(True)()
    before = weights(built)
    trainer = gk.accumulate(built, steps=3)
    try:
        trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        messages["functional"] = None
    except ValueError as error:
        messages["functional"] = str(error)
    unchanged["functional"] = gap(weights(built), before) == 0.0 and not trainer.compiled
    feeds = {
        "subclassed": lambda t, m: t.fit(Batches(micro), verbose=0),
        "generator": lambda t, m: t.fit((batch for batch in micro), verbose=0),
    }
    for label, feed in feeds.items():
        messages[label], unchanged[label] = _refused_before_any_step(
            _training_only(True, functional=False), feed
        )
    found.update(messages=messages, unchanged=unchanged)
    # NEGATIVE CONTROL: count= (rows, the default's count) skips the check: the sum is averaged.
    rows = lambda x, y, y_pred, sample_weight: ops.shape(x)[0]  # noqa: E731
    model = _training_only(True)()
    trainer = gk.accumulate(model, steps=3, count=rows)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    trainer.fit(Batches(micro), shuffle=False, verbose=0)
    ref = fit_plain(_training_only(True), keras.optimizers.SGD(0.1), windows(micro, 3)[0])
    found["gap_sum"] = gap(weights(model), weights(ref))
    return found


@check
def digits_example():
    """examples/keras_digits.py, run here on TensorFlow: the seed's bug next to the fix."""
    if BACKEND != "tensorflow" or importlib.util.find_spec("sklearn") is None:
        return {"skipped": "the example is a TensorFlow loop and needs scikit-learn"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    return {"stdout": out.getvalue()}


def main(names):
    for name in names or list(CHECKS):
        start = time.perf_counter()
        try:
            result = CHECKS[name]()
            result["error"] = None
        except Exception:  # reported to the test, which fails with the traceback
            result = {"error": traceback.format_exc()}
        result.pop("weights", None)
        result.update(name=name, seconds=round(time.perf_counter() - start, 2), backend=BACKEND)
        print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
