"""gradaccum.keras: exact gradient accumulation for Keras 3 (TensorFlow, JAX and torch backends).

Two ways in:

- `model.fit`: wrap the model, compile the wrapper, fit it. `batch_size` is the micro-batch;
  the optimizer steps once per `steps` micro-batches, on the gradient of the window's mean loss.
- hand-written loops (`tf.GradientTape`, `jax.grad`): `loss_sum` gives a batch's loss as a sum
  and a count, and `GradientWindow` adds micro-batch gradients and divides once.

Example:
    >>> import numpy as np, keras
    >>> import gradaccum.keras as gk
    >>> net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> trainer = gk.accumulate(net, steps=4)
    >>> trainer.compile(optimizer="adam", loss="mse")
    >>> _ = trainer.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=2, verbose=0)
    >>> trainer.window_state["steps"]
    2
"""

from __future__ import annotations

try:
    import keras as _keras
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "gradaccum.keras needs Keras 3 and a backend: pip install 'gradaccum[keras]'"
    ) from error

if not _keras.__version__.startswith("3."):  # pragma: no cover
    raise ImportError(f"gradaccum.keras needs Keras 3, found keras {_keras.__version__}")

from gradaccum.keras._counts import loss_count, loss_sum
from gradaccum.keras._loops import GradientWindow
from gradaccum.keras._model import AccumulatingModel, accumulate
from gradaccum.keras._optimizer import WindowOptimizer

__all__ = [
    "AccumulatingModel",
    "GradientWindow",
    "WindowOptimizer",
    "accumulate",
    "loss_count",
    "loss_sum",
]
