"""Keras 3's built-in `gradient_accumulation_steps` vs gradaccum.keras, case by case, measured.

Each case trains a small float64 model three ways on the same micro-batches and compares the
weights with the reference, a plain Keras run taking one full-batch step per window:

- built-in: `optimizer(gradient_accumulation_steps=N)`, `fit` on the micro-batches;
- gradaccum: `gradaccum.keras.accumulate(model, steps=N)`, `fit` on the same micro-batches.

The gap is ||w - w_ref|| / ||w_ref - w_0|| over all weights: the error as a share of the
update the reference made. Each backend runs in its own process (the Keras backend is fixed at
import). Usage: python benchmarks/keras_builtin_gaps.py [--backends tensorflow jax]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

import numpy as np

CASES = {
    "equal": "equal micro-batches, per-item mean (MSE), SGD",
    "token_sgd": "token loss with padding (masked mean), SGD",
    "token_adam": "token loss with padding (masked mean), Adam",
    "unequal": "unequal split (windows of 5+3+5+3 and 8+8+8+8 rows), SGD",
    "schedule": "learning-rate schedule (ExponentialDecay), SGD",
    "ema": "EMA of the weights (use_ema), Adam, 3 steps",
    "leftover": "epoch-end leftover: 10 micro-batches, N=4, 2 epochs",
    "fp16": "mixed_float16, one micro-batch overflows",
    "batchnorm": "BatchNormalization in train mode",
}


def run_backend() -> dict[str, dict[str, float]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    from keras import ops

    import gradaccum.keras as gk
    from gradaccum.batchnorm import BatchNormAccumulationWarning
    from gradaccum.keras._optimizer import dense

    keras.config.set_floatx("float64")
    keras.config.disable_interactive_logging()
    warnings.simplefilter("ignore", BatchNormAccumulationWarning)
    steps = 4

    class Batches(keras.utils.PyDataset):
        def __init__(self, batches):
            super().__init__()
            self.batches = batches

        def __len__(self):
            return len(self.batches)

        def __getitem__(self, index):
            return self.batches[index]

    def concat(batches):
        return tuple(np.concatenate(parts) for parts in zip(*batches, strict=True))

    def windows(micro, n, epochs=1):
        out = []
        for _ in range(epochs):
            out += [concat(micro[i : i + n]) for i in range(0, len(micro), n)]
        return out

    def dense_grads(optimizer):  # TF's IndexedSlices: the full-batch step needs dense rows
        apply = optimizer.apply

        def dense_apply(grads, trainable_variables=None):
            return apply([None if g is None else dense(g) for g in grads], trainable_variables)

        optimizer.apply = dense_apply
        return optimizer

    def regression(sizes, seed=0):
        rng = np.random.default_rng(seed)
        return [(rng.normal(size=(n, 6)), rng.normal(size=(n, 3))) for n in sizes]

    def tokens(sizes, seed=0):
        rng = np.random.default_rng(seed)
        out = []
        for n in sizes:
            x, y = np.zeros((n, 8), "int32"), np.zeros((n, 8), "int32")
            for row in range(n):
                k = int(rng.integers(1, 9))
                x[row, :k] = rng.integers(1, 12, size=k)
                y[row, :k] = rng.integers(0, 12, size=k)
            out.append((x, y))
        return out

    def mlp(norm=False):
        keras.utils.set_random_seed(1)
        layers = [keras.Input((6,)), keras.layers.Dense(16, activation="relu")]
        layers += [keras.layers.BatchNormalization()] if norm else []
        return keras.Sequential([*layers, keras.layers.Dense(3)])

    def token_model():
        keras.utils.set_random_seed(1)
        return keras.Sequential(
            [
                keras.Input((None,), dtype="int32"),
                keras.layers.Embedding(12, 8, mask_zero=True),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(12),
            ]
        )

    def flat(model):
        return np.concatenate([np.ravel(ops.convert_to_numpy(w)) for w in model.weights])

    def measure(make, optimizer, micro, loss="mse", epochs=1, full=None, policy="step"):
        start = flat(make())
        reference = make()
        reference.compile(optimizer=dense_grads(optimizer()), loss=loss)
        full = full if full is not None else windows(micro, steps, epochs)
        reference.fit(Batches(full), shuffle=False, verbose=0)
        builtin = make()
        inner = optimizer()
        config = {**inner.get_config(), "gradient_accumulation_steps": steps}
        builtin.compile(optimizer=type(inner).from_config(config), loss=loss)
        builtin.fit(Batches(micro), epochs=epochs, shuffle=False, verbose=0)
        ours = make()
        trainer = gk.accumulate(ours, steps=steps, partial_window=policy)
        trainer.compile(optimizer=optimizer(), loss=loss)
        trainer.fit(Batches(micro), epochs=epochs, shuffle=False, verbose=0)
        update = np.linalg.norm(flat(reference) - start)
        return {
            "builtin": float(np.linalg.norm(flat(builtin) - flat(reference)) / update),
            "gradaccum": float(np.linalg.norm(flat(ours) - flat(reference)) / update),
        }

    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    ema = lambda: keras.optimizers.Adam(0.02, use_ema=True, ema_momentum=0.5)  # noqa: E731
    ce = "sparse_categorical_crossentropy"
    results = {
        "equal": measure(mlp, sgd, regression([4] * 8)),
        "token_sgd": measure(token_model, lambda: keras.optimizers.SGD(0.5), tokens([4] * 8), ce),
        "token_adam": measure(
            token_model, lambda: keras.optimizers.Adam(0.02), tokens([4] * 8), ce
        ),
        "unequal": measure(mlp, sgd, regression([5, 3, 5, 3, 8, 8, 8, 8])),
        "schedule": measure(
            mlp,
            lambda: keras.optimizers.SGD(
                keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
            ),
            regression([4] * 8),
        ),
        "ema": measure(mlp, ema, regression([4] * 12)),
    }
    micro = regression([4] * 10)
    full = [*windows(micro[:8], steps), concat(micro[8:])]
    results["leftover"] = measure(mlp, sgd, micro, epochs=2, full=full * 2)
    poisoned = regression([4] * 12, seed=3)
    clean = poisoned[:4] + poisoned[8:]
    poisoned[5] = (np.full_like(poisoned[5][0], 1e30), poisoned[5][1])
    keras.config.set_dtype_policy("mixed_float16")
    try:
        results["fp16"] = measure(
            mlp, lambda: keras.optimizers.Adam(0.02), poisoned, full=windows(clean, steps)
        )
    finally:
        keras.config.set_dtype_policy("float64")
    results["batchnorm"] = measure(lambda: mlp(norm=True), sgd, regression([4] * 8))
    return results


def percent(gap: float) -> str:
    value = 100 * gap
    return f"{value:.3g}%" if value >= 0.01 else f"{value:.0e}%"


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    backends = list(results)
    header = ["case"] + [f"{who} ({b})" for b in backends for who in ("built-in", "gradaccum")]
    rows = [header]
    for key, label in CASES.items():
        row = [label]
        for backend in backends:
            gaps = results[backend][key]
            row += [percent(gaps["builtin"]), percent(gaps["gradaccum"])]
        rows.append(row)
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "|".join(" --- " for _ in header) + "|")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["tensorflow", "jax"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_backend()))
        return
    procs = {}
    for backend in args.backends:
        env = dict(os.environ, KERAS_BACKEND=backend, JAX_ENABLE_X64="1")
        procs[backend] = subprocess.Popen(
            [sys.executable, __file__, "--worker"], env=env, stdout=subprocess.PIPE, text=True
        )
    results = {}
    for backend, proc in procs.items():
        out, _ = proc.communicate()
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"{backend}: the worker failed (exit {proc.returncode})")
        results[backend] = json.loads(line[len("RESULT ") :])
    print(table(results))


if __name__ == "__main__":
    main()
