"""gradaccum.keras: exact gradient accumulation for Keras 3 (TensorFlow, JAX and torch backends).

Two ways in:

- `model.fit`: wrap the model, compile the wrapper, fit it. `batch_size` is the micro-batch;
  the optimizer steps once per `steps` micro-batches, on the gradient of the window's mean loss.
- hand-written loops (`tf.GradientTape`, `jax.grad`): `loss_sum` gives a batch's loss as a sum
  and a count, and `GradientWindow` adds micro-batch gradients and divides once.

Keras is imported when a name is first used, not by `import gradaccum.keras`.

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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOME = {
    "AccumulatingModel": "_model",
    "GradientWindow": "_loops",
    "WindowOptimizer": "_optimizer",
    "accumulate": "_model",
    "loss_count": "_counts",
    "loss_sum": "_counts",
}


def _require_keras() -> None:
    try:
        keras = importlib.import_module("keras")
    except ImportError as error:
        raise ImportError(
            "gradaccum.keras needs Keras 3 and a backend: pip install 'gradaccum[keras]'"
        ) from error
    if not str(keras.__version__).startswith("3."):
        raise ImportError(
            f"gradaccum.keras needs Keras 3, found keras {keras.__version__}: "
            "pip install 'gradaccum[keras]'"
        )


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'gradaccum.keras' has no attribute {name!r}")
    _require_keras()
    value = getattr(importlib.import_module(f"gradaccum.keras.{home}"), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
