"""A warning for an Accumulator that goes away while its window holds unstepped micro-batches.

Two common loop mistakes end a run with an open window: `acc.flush()` left out after the last
epoch, and a `break` out of the loop mid-window (early stopping, a step limit) with nothing
after it. Either way the window's micro-batches are accumulated in `.grad` but never stepped,
so the last partial batch is lost without a sign. `warn_if_left_open` registers a finalizer
that warns once when the Accumulator is garbage-collected, or when the program ends, with such
a window. A window whose state was saved after its last micro-batch (`acc.state_dict()`,
`save_checkpoint`) or loaded from a file is not lost, since a resume continues it: no warning.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradaccum.window import Window

__all__ = ["OpenWindowWarning", "release_interrupted", "warn_if_left_open"]

_SKIPPED = (os.path.dirname(__file__), weakref.__file__)


class OpenWindowWarning(UserWarning):
    """An Accumulator went away with micro-batches accumulated that no optimizer step used."""


def warn_if_left_open(owner: object, window: Window) -> None:
    """Warn when `owner` goes away (collected, or at exit) while `window` holds unsaved work.

    Args:
        owner: The Accumulator; the finalizer holds no reference to it.
        window: Its window, read when the owner goes away.
    """
    weakref.finalize(owner, _warn_if_open, window)


def release_interrupted(interrupt: BaseException) -> None:
    """Free the frames a deliberate stop (Ctrl-C) unwound, without an `OpenWindowWarning`.

    A program stopped on purpose mid-window (the command line's second Ctrl-C) leaves its
    window open knowingly; its Accumulator, held by the traceback's frames, goes here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=OpenWindowWarning)
        traceback.clear_frames(interrupt.__traceback__)


def _warn_if_open(window: Window) -> None:
    if not window.is_open or window.saved:
        return
    # The warning points at the user's line that dropped the last reference (`del acc`, a
    # function's return), past gradaccum's and weakref's frames; at exit there is none.
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    with contextlib.suppress(Exception):  # an "error" filter: a finalizer cannot raise
        warnings.warn(
            OpenWindowWarning(
                f"gradaccum: an Accumulator went away (garbage-collected, or the program ended) "
                f"with an open window of {window.micro_batches} micro-batches "
                f"({window.count} items counted) that no optimizer step used: their gradients "
                "are lost. Call acc.flush() after the loop (partial_window='step' steps on them, "
                "'drop' discards them; a 'carry' run ends with acc.flush('step')), also after a "
                "break out of it (early stopping, a step limit); or save_checkpoint(..., "
                "accumulator=acc) after the last micro_step() to resume the window later."
            ),
            stacklevel=level if frame is not None else 1,
        )
