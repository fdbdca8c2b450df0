"""The embedded tasks, by name: `digits`, `shapes` and `charlm`. Nothing is downloaded.

- `digits`: scikit-learn's bundled 8x8 digits, a small CNN, accuracy.
- `shapes`: generated shape segmentation, a U-Net with BatchNorm or GroupNorm, mIoU.
- `charlm`: a character transformer on padded lines of a bundled text, perplexity.

Example:
    >>> get_task("digits").metric
    'accuracy'
    >>> TASKS
    ('digits', 'shapes', 'charlm')
"""

from __future__ import annotations

from collections.abc import Callable

from gradaccum.experiments.base import Task
from gradaccum.experiments.tasks.charlm import CharLMTask
from gradaccum.experiments.tasks.digits import DigitsTask
from gradaccum.experiments.tasks.shapes import ShapesTask

__all__ = ["TASKS", "CharLMTask", "DigitsTask", "ShapesTask", "get_task"]

_REGISTRY: dict[str, Callable[[], Task]] = {
    "digits": DigitsTask,
    "shapes": ShapesTask,
    "charlm": CharLMTask,
}

TASKS: tuple[str, ...] = tuple(_REGISTRY)


def get_task(name: str) -> Task:
    """A fresh instance of the task called `name`.

    Args:
        name: One of `TASKS`.

    Returns:
        The task.

    Raises:
        ValueError: If `name` is not a known task; the message lists the valid names.
    """
    try:
        factory = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}.") from None
    return factory()
