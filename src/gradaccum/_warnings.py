"""Warnings that point at the user's line, not at gradaccum's internals."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_user"]

_PACKAGE = os.path.dirname(__file__)


def warn_user(warning: Warning) -> None:
    """Issue `warning` with the stack level of the first caller outside gradaccum."""
    frame, level = sys._getframe(1), 2  # stacklevel 2 is our caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(warning, stacklevel=level)
