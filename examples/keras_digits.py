"""The seed's TensorFlow loop, its bug, and the fix, side by side on scikit-learn's digits.

The loop this project grew from (a Korean post on gradient accumulation with tf.GradientTape on
MNIST) adds micro-batch gradients into `accumulation_gradients`, then, every `num_accum` steps,
applies `gradients`: the CURRENT micro-batch's gradient. The sum is divided by `num_accum` and
thrown away. (Its model also ends in a softmax fed to a `from_logits=True` loss; here the model
returns logits, so only the accumulation differs.)

Runs, from the same initial weights, on the same micro-batches of 16 (4 per optimizer step):
  (a) full batch of 64, plain GradientTape loop              the reference
  (b) the seed's loop                                        applies one micro-batch in four
  (c) the seed's loop, fixed with gradaccum.keras            GradientWindow + loss_sum
  (d) model.fit with gradaccum.keras.accumulate(steps=4)     batch_size=16

Float64, so (c) and (d) match (a) to rounding. Usage: python examples/keras_digits.py (~10 s;
needs the `[keras]` and `[cli]` extras: `pip install -e '.[keras,cli]'`, or `make`).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # the seed is a tf.GradientTape loop
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

try:
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits
except ModuleNotFoundError as missing:  # a newcomer's `pip install -e '.[cli,dev]'` lacks them
    package = (missing.name or "").partition(".")[0]  # sklearn, not sklearn.datasets
    extra = "cli" if package == "sklearn" else "keras"
    print(
        f"examples/keras_digits.py needs {package}, which is not installed; install it "
        f"with: pip install 'gradaccum[{extra}]' (see the README, section Installing)",
        file=sys.stderr,
    )
    raise SystemExit(2) from None

import gradaccum.keras as gk

MICRO, NUM_ACCUM, EPOCHS = 16, 4, 3
keras.config.set_floatx("float64")
keras.config.disable_interactive_logging()


def data():
    digits = load_digits()
    x = (digits.images / 16.0)[..., None]  # (1797, 8, 8, 1) in [0, 1]
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], digits.target[order]
    return (x[:1536], y[:1536]), (x[1536:], y[1536:])  # 1536 = 24 steps of 64 per epoch


def get_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),  # logits
        ]
    )


loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def micro_batches(x, y):
    return [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, len(x), MICRO)]


def full_batch(x, y):
    model, optimizer = get_model(), keras.optimizers.Adam(1e-3)

    @tf.function
    def train_step(batch_x, batch_y):
        with tf.GradientTape() as tape:
            loss = loss_fn(batch_y, model(batch_x))
        optimizer.apply(tape.gradient(loss, model.trainable_weights), model.trainable_weights)

    size = MICRO * NUM_ACCUM
    for _ in range(EPOCHS):
        for i in range(0, len(x), size):
            train_step(x[i : i + size], y[i : i + size])
    return model


def seed_loop(x, y):
    """The seed's train(): note which gradients apply_gradients receives."""
    model, optimizer = get_model(), keras.optimizers.Adam(1e-3)

    @tf.function
    def train_step(batch_x, batch_y):
        with tf.GradientTape() as tape:
            loss_value = loss_fn(batch_y, model(batch_x))
        return tape.gradient(loss_value, model.trainable_weights), loss_value

    for _ in range(EPOCHS):
        accumulation_gradients = [tf.zeros_like(w) for w in model.trainable_weights]
        for step, (batch_x, batch_y) in enumerate(micro_batches(x, y)):
            gradients, _ = train_step(batch_x, batch_y)
            if step % NUM_ACCUM == 0:
                accumulation_gradients = [g / NUM_ACCUM for g in accumulation_gradients]
                # The bug: `gradients` is this micro-batch's alone; the sum above is dropped.
                optimizer.apply_gradients(zip(gradients, model.trainable_weights, strict=True))
                accumulation_gradients = [tf.zeros_like(w) for w in model.trainable_weights]
            else:
                accumulation_gradients = [
                    a + g for a, g in zip(accumulation_gradients, gradients, strict=True)
                ]
    return model


def fixed_loop(x, y):
    """The same loop, fixed: sum the micro-batch losses' gradients, divide once, apply that."""
    model, optimizer = get_model(), keras.optimizers.Adam(1e-3)

    @tf.function
    def train_step(batch_x, batch_y):
        with tf.GradientTape() as tape:
            loss_sum, count = gk.loss_sum(loss_fn, batch_y, model(batch_x))  # SUM, not mean
        return tape.gradient(loss_sum, model.trainable_weights), count

    for _ in range(EPOCHS):
        window = gk.GradientWindow.zeros(model.trainable_weights)
        for step, (batch_x, batch_y) in enumerate(micro_batches(x, y)):
            window = window.add(*train_step(batch_x, batch_y))
            if (step + 1) % NUM_ACCUM == 0:
                window.apply(optimizer, model.trainable_weights)  # mean over 64 items, once
                window = gk.GradientWindow.zeros(model.trainable_weights)
    return model


def with_fit(x, y):
    model = get_model()
    trainer = gk.accumulate(model, steps=NUM_ACCUM)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss_fn)
    trainer.fit(x, y, batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
    return model


def gap(model, reference):
    pairs = zip(model.get_weights(), reference.get_weights(), strict=True)
    return max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in pairs)


def accuracy(model, x, y):
    return float(np.mean(np.argmax(model.predict(x, verbose=0), axis=-1) == y))


def main():
    (x, y), (x_test, y_test) = data()
    runs = {
        "(a) full batch of 64 (reference)": full_batch(x, y),
        "(b) the seed's loop": seed_loop(x, y),
        "(c) the seed's loop, fixed": fixed_loop(x, y),
        "(d) fit + gradaccum.keras.accumulate": with_fit(x, y),
    }
    reference = runs["(a) full batch of 64 (reference)"]
    print(f"digits, {len(x)} training images, {EPOCHS} epochs, Adam; micro-batches of {MICRO}, "
          f"{NUM_ACCUM} per step ({keras.backend.backend()}, float64)")  # fmt: skip
    print(f"{'run':40s} {'weight gap vs (a)':>18s} {'test accuracy':>14s}")
    for name, model in runs.items():
        shown = "-" if model is reference else f"{gap(model, reference):.1e}"
        print(f"{name:40s} {shown:>18s} {accuracy(model, x_test, y_test):>14.4f}")
    print(
        "The seed's loop steps on one micro-batch in four (the other three are summed, divided "
        "and dropped); the fix sums, counts and divides once, and matches the full batch."
    )


if __name__ == "__main__":
    main()
