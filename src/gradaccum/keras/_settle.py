"""The callback `AccumulatingModel.fit` puts first: it settles each epoch's open window.

It tells the `WindowOptimizer` how many micro-batches an epoch has, so that the epoch's last
micro-batch closes an open window by the `partial_window` policy, and settles a window an epoch
of unknown length (or one cut short) left open, before validation and the user's callbacks.
"""

from __future__ import annotations

from typing import Any

import keras

from gradaccum._warnings import warn_user
from gradaccum.keras._optimizer import WindowOptimizer

__all__ = ["SettleWindows"]


class SettleWindows(keras.callbacks.Callback):
    """Tells the optimizer the epoch length; settles the leftover when it is unknown."""

    def __init__(self, owner: Any) -> None:
        """Settle `owner`'s windows.

        Args:
            owner: the `AccumulatingModel` (untyped here: no import cycle, even for types).
        """
        super().__init__()
        self._owner = owner
        self._epoch_length: int | None = None

    def first_of(self, callbacks: Any) -> Any:
        """`fit`'s callbacks with this one first, in any form `fit` takes them.

        Keras takes a list, one callback or a `CallbackList` (which it runs as given): the
        latter two used to fail with a bare "Value after * must be an iterable".
        """
        if isinstance(callbacks, keras.callbacks.CallbackList):
            if self not in callbacks.callbacks:
                callbacks.callbacks.insert(0, self)
            return callbacks
        return [self, *keras.tree.flatten(callbacks or [])]

    def _optimizer(self) -> WindowOptimizer:
        optimizer: WindowOptimizer = self._owner._window_optimizer()
        if not optimizer.built and self._owner.model.built:  # else its first step builds it
            optimizer.build(self._owner.trainable_variables)
        return optimizer

    def on_train_begin(self, logs: Any = None) -> None:
        steps = (self.params or {}).get("steps")
        carry = self._owner.partial_window == "carry"
        self._epoch_length = None if carry or not steps else int(steps)
        self._optimizer().set_epoch_length(self._epoch_length)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._optimizer().set_epoch_length(self._epoch_length)

    def on_test_begin(self, logs: Any = None) -> None:
        self._settle_open_window()  # validation in fit: it sees the epoch's last step

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._settle_open_window()

    def _settle_open_window(self) -> None:
        """Settle a window the epoch left open, before validation and the user's callbacks.

        An epoch of known length closes its last window at its last micro-batch; one left open
        here had an unknown length, or was cut short (`stop_training` set by a callback), and
        would otherwise leak into the next `fit`'s first window.
        """
        policy = self._owner.partial_window
        if policy != "carry":
            self._optimizer().flush(policy)

    def on_train_end(self, logs: Any = None) -> None:
        # Later `train_on_batch` calls belong to no epoch: this fit's length would close their
        # windows early.
        self._optimizer().set_epoch_length(None)
        pending = self._optimizer().window_state()["pending"]
        if pending and self._owner.partial_window == "carry":
            warn_user(
                UserWarning(
                    f"{pending} micro-batch(es) wait in an open window (partial_window='carry'): "
                    "the next fit() finishes it, or call trainer.flush() to step on them now"
                )
            )
