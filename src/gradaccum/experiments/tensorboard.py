"""Training metrics as TensorBoard scalars, for the optional `tensorboard` extra.

`TensorBoardLog` writes each `metrics.jsonl` line of a run as scalars `train/<key>` and each
validation metric as `validation/<name>`, at the step the line names. `tensorboard` is imported
only when a `TensorBoardLog` is made, so this module imports without it.

Example:
    with TensorBoardLog(run_dir / "tensorboard") as log:
        log.log_step({"step": 1, "samples": 16, "loss": 2.5, "lr": 1e-3, "grad_norm": None})
        log.log_validation(1, "perplexity", 7.9)

Then `tensorboard --logdir runs/` shows them.
"""

from __future__ import annotations

import math
import numbers
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from gradaccum._install import install_hint

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["TensorBoardLog"]


def _finite_number(value: Any) -> float | None:
    """`value` as a float if it is a finite real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _summary_writer() -> type[SummaryWriter]:
    """`torch.utils.tensorboard.SummaryWriter`, imported without importing TensorFlow for it.

    tensorboard reaches TensorFlow through `tensorboard.compat.tf`, which imports all of it when
    it is installed (the keras extra): about 15 s and C++ log lines on stderr, for event files
    that tensorboard's own stub writes the same. A module named `tensorboard.compat.notf` selects
    the stub; it exists only while the writer is imported, and not when TensorFlow is already
    imported (then it costs nothing).
    """
    marker = "tensorboard.compat.notf"
    stub = "tensorflow" not in sys.modules and marker not in sys.modules
    if stub:
        sys.modules[marker] = types.ModuleType(marker)
    try:
        from torch.utils.tensorboard import SummaryWriter
    finally:
        if stub:
            del sys.modules[marker]
    return SummaryWriter


class TensorBoardLog:
    """TensorBoard event files for one run: `train/<key>` and `validation/<name>` scalars.

    A thin wrapper over `torch.utils.tensorboard.SummaryWriter`; use it as a context manager, or
    call `close` when done. Events are buffered: `flush` writes them out (`close` does too).

    On resume the writer appends a new event file to `folder` and leaves the old ones alone, so
    the steps logged after the last checkpoint and before the interruption are in the folder
    twice, with their old and their new values. TensorBoard's display (its default fast loader)
    keeps the newest value of such a step; `tensorboard --load_fast=false` and scripts reading
    the files with `EventAccumulator` see both.

    Args:
        folder: Where the event files go, e.g. `run_dir / "tensorboard"`; made if missing.

    Raises:
        ImportError: If `tensorboard` is not installed; the message says how to install it.
    """

    def __init__(self, folder: Path) -> None:
        try:
            SummaryWriter = _summary_writer()  # noqa: N806 - the class, named as torch names it
        except ImportError as error:
            raise ImportError(
                "TensorBoard logging needs tensorboard, which is not installed; "
                + install_hint("tensorboard")
            ) from error
        self.folder = Path(folder)
        self._writer: SummaryWriter = SummaryWriter(log_dir=str(self.folder))

    def log_step(self, row: Mapping[str, Any]) -> None:
        """Write one `metrics.jsonl` line as scalars `train/<key>` at step `row["step"]`.

        Every finite real number but `step` is written; None, bools, NaN, infinities and
        non-numbers (strings, lists) are skipped, and a missing key is simply not written.

        Args:
            row: One metrics line as a dict, e.g. `{"step": 3, "samples": 48, "loss": 2.1,
                "lr": 1e-3, "grad_norm": None, "time": 1.5, "micro_batches": 2}`.

        Raises:
            KeyError: If `row` has no `step`.
        """
        step = int(row["step"])
        for key, value in row.items():
            number = _finite_number(value)
            if key != "step" and number is not None:
                self._writer.add_scalar(f"train/{key}", number, global_step=step)

    def log_validation(self, step: int, name: str, value: float) -> None:
        """Write a validation metric as the scalar `validation/<name>` at `step`.

        Args:
            step: The optimizer step the metric was measured after.
            name: The metric, e.g. "loss", "accuracy", "perplexity" or "miou".
            value: Its value.
        """
        self._writer.add_scalar(f"validation/{name}", float(value), global_step=int(step))

    def flush(self) -> None:
        """Write the buffered events to disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; the log takes no more scalars after this."""
        self._writer.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
