"""Notes the `train` and `compare` commands print about a run, in the command line's own terms.

Example:
    >>> from gradaccum.experiments.base import TrainConfig
    >>> run = CheckedRun(TrainConfig(task="shapes"), "8x2", 16, 8, 0.003, 10, 25, 10)
    >>> batchnorm_note(run).split(",")[0]
    'note: BatchNorm normalizes each micro-batch of 8 on its own'
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

from gradaccum.batchnorm import BatchNormAccumulationWarning
from gradaccum.cli._training_options import CheckedRun

__all__ = ["batchnorm_note", "batchnorm_warnings_as_notes", "show_batchnorm_notes"]


def batchnorm_note(run: CheckedRun) -> str | None:
    """A one-line note when BatchNorm makes this run inexact or `--bn frozen` is untrained."""
    config = run.config
    if not run.batchnorm_layers:
        return None
    if config.bn == "frozen" and config.init_from is None:
        return (
            "note: --bn frozen keeps the BatchNorm statistics the model starts with, and "
            "without --init-from they are untrained (mean 0, variance 1)"
        )
    if config.bn == "micro" and run.micro_batch_size < run.effective_batch:
        return (
            f"note: BatchNorm normalizes each micro-batch of {run.micro_batch_size} on its "
            f"own, so this is not exactly a batch of {run.effective_batch}; see --bn pooled, "
            "frozen or group (docs/batchnorm.md)"
        )
    return None


def show_batchnorm_notes(runs: list[CheckedRun]) -> None:
    """Print each run's BatchNorm note once, on stderr, in the CLI's own terms.

    Train inside `batchnorm_warnings_as_notes()`, so the library's warning does not repeat them.
    """
    notes = dict.fromkeys(note for run in runs if (note := batchnorm_note(run)))
    for note in notes:
        print(note, file=sys.stderr)


@contextlib.contextmanager
def batchnorm_warnings_as_notes() -> Iterator[None]:
    """Ignore the library's `BatchNormAccumulationWarning` inside the block, and only there.

    The warning names Python options (`batchnorm="pooled"`) and would point at the CLI's
    internals; `show_batchnorm_notes` says the same in the CLI's terms. The process's warning
    filters are restored when the block ends, however it ends.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=BatchNormAccumulationWarning)
        yield
