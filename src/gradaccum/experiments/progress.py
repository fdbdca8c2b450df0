"""Progress of a training run on stderr: steps, samples/s, loss and ETA.

On a terminal with `rich` installed it is a live progress bar. Otherwise (a log file, a pipe, a
test, no `rich`) it is one plain line every `interval` seconds, plus the first and last steps, so
logs stay short and readable. `rich` is imported only when a bar is shown.

Example:
    >>> import io
    >>> from gradaccum.experiments.runner import StepLog
    >>> stream = io.StringIO()
    >>> with progress("8x2", total_steps=2, stream=stream) as on_step:
    ...     on_step(StepLog(step=1, samples=16, loss=2.5, lr=1e-3, grad_norm=1.0, time=0.5))
    ...     on_step(StepLog(step=2, samples=32, loss=2.0, lr=1e-3, grad_norm=1.0, time=1.0))
    >>> print(stream.getvalue().splitlines()[-1])
    8x2: step 2/2 (100%)  samples 32  loss 2.0000  32 samples/s  ETA 0:00:00
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TextIO

__all__ = ["StepCallback", "format_eta", "progress"]


class _StepLike(Protocol):
    step: int
    samples: int
    loss: float
    time: float


StepCallback = Callable[..., None]
"""Called as `on_step(log)` or `on_step(log, run)` (the runner's `on_step` signature)."""


def format_eta(seconds: float) -> str:
    """Seconds as `H:MM:SS`; `-:--:--` when unknown.

    Example:
        >>> format_eta(3725.2)
        '1:02:05'
    """
    if not math.isfinite(seconds) or seconds < 0:
        return "-:--:--"
    whole = round(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


@contextlib.contextmanager
def progress(
    label: str,
    total_steps: int,
    *,
    stream: TextIO | None = None,
    interval: float = 10.0,
) -> Iterator[StepCallback]:
    """Show the progress of one run while the block runs; yields the per-step callback.

    Args:
        label: What is running, e.g. `"digits 8x2"`.
        total_steps: Optimizer steps of the run, for the percentage and the ETA.
        stream: Where to write; `sys.stderr` (at call time) when None.
        interval: Seconds between plain log lines (not used by the rich bar).

    Yields:
        `on_step(log, *_)`, to call after every optimizer step with a `StepLog`.
    """
    stream = sys.stderr if stream is None else stream
    bar = _rich_bar(label, total_steps, stream)
    if bar is None:
        yield _PlainLog(label, total_steps, stream, interval)
        return
    with bar as live:
        yield live


def _rates(log: _StepLike, total_steps: int) -> tuple[str, str]:
    speed = log.samples / log.time if log.time > 0 else float("nan")
    per_step = log.time / log.step if log.step > 0 else float("nan")
    eta = format_eta(per_step * (total_steps - log.step))
    return (f"{speed:,.0f}" if math.isfinite(speed) else "-"), eta


class _PlainLog:
    """One line per `interval` seconds, and for the first and the last step."""

    def __init__(self, label: str, total_steps: int, stream: TextIO, interval: float) -> None:
        self.label = label
        self.total = total_steps
        self.stream = stream
        self.interval = interval
        self.last_print: float | None = None

    def __call__(self, log: _StepLike, *_: Any) -> None:
        now = time.monotonic()
        due = self.last_print is None or now - self.last_print >= self.interval
        if not (due or log.step >= self.total):
            return
        self.last_print = now
        speed, eta = _rates(log, self.total)
        percent = 100 * log.step // max(self.total, 1)
        self.stream.write(
            f"{self.label}: step {log.step}/{self.total} ({percent}%)  samples {log.samples:,}  "
            f"loss {log.loss:.4f}  {speed} samples/s  ETA {eta}\n"
        )
        self.stream.flush()


class _RichBar:
    """A `rich.progress` bar with step count, samples/s, loss and ETA columns."""

    def __init__(self, label: str, total_steps: int, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.total = total_steps
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn("{task.fields[speed]} samples/s  loss {task.fields[loss]}"),
            TextColumn("ETA {task.fields[eta]}"),
            console=Console(file=stream),
        )
        self.task_id = self.progress.add_task(
            label, total=total_steps, speed="-", loss="-", eta="-:--:--"
        )

    def __enter__(self) -> _RichBar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def __call__(self, log: _StepLike, *_: Any) -> None:
        speed, eta = _rates(log, self.total)
        self.progress.update(
            self.task_id, completed=log.step, speed=speed, loss=f"{log.loss:.4f}", eta=eta
        )


def _rich_bar(label: str, total_steps: int, stream: TextIO) -> _RichBar | None:
    """A rich bar if `stream` is a terminal and rich is installed, else None."""
    isatty = getattr(stream, "isatty", None)
    if not (callable(isatty) and isatty()):
        return None
    try:
        return _RichBar(label, total_steps, stream)
    except ImportError:
        return None
