"""Reports of finished runs: a table (text, markdown or rich) and two plots.

`write_report(out_dir, task, summaries)` writes `report.md` (the table, a note on what "peak
memory" means, the settings and both plots), `curves.png` (training loss and validation metric
against samples seen, one line per config) and `memory.png` (peak memory against micro-batch
size). `format_table(summaries)` is the same table as aligned text. `gradaccum compare` and
`gradaccum demo` both use them.

matplotlib is imported only when a plot is drawn, and only its object-oriented API with the Agg
canvas is used: no pyplot, so no global backend is switched and no window is ever opened.

Example:
    >>> from gradaccum.experiments.base import RunSummary
    >>> run = RunSummary(config="8x2", effective_batch=16, micro_batch_size=8,
    ...     accumulation_steps=2, optimizer_steps=90, samples_seen=1438, best_metric=0.95,
    ...     final_metric=0.94, metric="accuracy", peak_memory_bytes=762340,
    ...     samples_per_second=4800.0, wall_seconds=0.3)
    >>> print(format_table([run]))
    config  effective batch  micro-batch  steps  best accuracy  final accuracy  peak memory  samples/s  wall time
    8x2                  16            8     90         0.9500          0.9400    744.5 KiB      4,800      0.3 s
"""  # noqa: E501

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from gradaccum.experiments.base import RunSummary

__all__ = [
    "CURVES_SIZE",
    "MEMORY_SIZE",
    "PEAK_MEMORY_NOTE",
    "format_bytes",
    "format_seconds",
    "format_table",
    "markdown_table",
    "plot_curves",
    "plot_memory",
    "print_table",
    "read_metrics",
    "table_rows",
    "write_report",
]

PEAK_MEMORY_NOTE = (
    "Peak memory: bytes of weights + gradients + the two AdamW moments + the activations "
    "autograd saves for one micro-batch (measured with saved-tensor hooks); it is not the "
    "process RSS."
)

# Pixel sizes (width, height) of the plots, at _DPI dots per inch.
CURVES_SIZE = (1200, 480)
MEMORY_SIZE = (720, 480)
_DPI = 100

_NUMERIC_COLUMNS = frozenset(range(1, 9))
_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P")


def format_bytes(count: float) -> str:
    """Bytes with a binary unit, e.g. `"744.5 KiB"`.

    Example:
        >>> format_bytes(3 * 1024**2)
        '3.0 MiB'
    """
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def format_seconds(seconds: float) -> str:
    """A duration: `"12.3 s"` under a minute, `"4m 05s"` under an hour, else `"1h 02m"`.

    Example:
        >>> format_seconds(245.2)
        '4m 05s'
    """
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    return f"{whole // 3600}h {whole // 60 % 60:02d}m"


def _check(summaries: Sequence[RunSummary]) -> str:
    """The metric shared by `summaries`; raises ValueError if there is none or several."""
    if not summaries:
        raise ValueError("no runs to report")
    metrics = {summary.metric for summary in summaries}
    if len(metrics) != 1:
        raise ValueError(f"runs of different tasks cannot share a table (metrics {metrics})")
    return metrics.pop()


def table_rows(summaries: Sequence[RunSummary]) -> tuple[list[str], list[list[str]]]:
    """The report table as strings: headers and one row per run, in the given order.

    Columns: config, effective batch, micro-batch, steps, best and final validation metric, peak
    memory, samples/s and wall time.

    Raises:
        ValueError: If `summaries` is empty or mixes metrics.
    """
    metric = _check(summaries)
    headers = [
        "config",
        "effective batch",
        "micro-batch",
        "steps",
        f"best {metric}",
        f"final {metric}",
        "peak memory",
        "samples/s",
        "wall time",
    ]
    rows = [
        [
            s.config,
            str(s.effective_batch),
            str(s.micro_batch_size),
            str(s.optimizer_steps),
            f"{s.best_metric:.4f}",
            f"{s.final_metric:.4f}",
            format_bytes(s.peak_memory_bytes),
            f"{s.samples_per_second:,.0f}",
            format_seconds(s.wall_seconds),
        ]
        for s in summaries
    ]
    return headers, rows


def format_table(summaries: Sequence[RunSummary]) -> str:
    """The report table as aligned plain text (numbers right-aligned), without a trailing newline.

    Raises:
        ValueError: If `summaries` is empty or mixes metrics.
    """
    headers, rows = table_rows(summaries)
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        parts = [
            cell.rjust(width) if index in _NUMERIC_COLUMNS and cells is not headers else cell
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(part.ljust(width) for part, width in zip(parts, widths, strict=True))

    return "\n".join(line(cells).rstrip() for cells in [headers, *rows])


def markdown_table(summaries: Sequence[RunSummary]) -> str:
    """The report table in GitHub markdown, numbers right-aligned, without a trailing newline.

    Raises:
        ValueError: If `summaries` is empty or mixes metrics.
    """
    headers, rows = table_rows(summaries)
    align = ["---:" if index in _NUMERIC_COLUMNS else "---" for index in range(len(headers))]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [headers, align, *rows])


def print_table(
    summaries: Sequence[RunSummary], file: TextIO | None = None, *, title: str | None = None
) -> None:
    """Print the table: a rich table if `rich` is installed, else aligned text.

    Args:
        summaries: The runs, one row each.
        file: Where to print; `sys.stdout` (at call time) when None.
        title: An optional title line.
    """
    file = sys.stdout if file is None else file
    headers, rows = table_rows(summaries)
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        if title:
            print(title, file=file)
        print(format_table(summaries), file=file)
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), collapse_padding=True)
    for index, header in enumerate(headers):
        table.add_column(header, justify="right" if index in _NUMERIC_COLUMNS else "left")
    for row in rows:
        table.add_row(*row)
    isatty = getattr(file, "isatty", None)
    terminal = callable(isatty) and isatty()
    # Not a terminal: rich would wrap at 80 columns; give the table the width it needs.
    width = Console(file=file).width if terminal else 200
    # On a narrow terminal rich wraps headers between words, but it may also cut cells: widen
    # until every cell shows whole (at worst the terminal wraps the long lines).
    natural = sum(max(len(h), *(len(r[i]) for r in rows)) + 2 for i, h in enumerate(headers))
    while width < natural and not _renders_whole(table, rows, width):
        width += 2
    console = Console(file=file, width=width, soft_wrap=False, force_terminal=terminal or None)
    if title:
        console.print(title, style="bold", highlight=False)
    console.print(table)


def _renders_whole(table: Any, rows: list[list[str]], width: int) -> bool:
    """Whether `table` rendered `width` columns wide shows every cell on one line, uncut."""
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None).print(table)
    text = buffer.getvalue()
    return "…" not in text and all(cell in text for row in rows for cell in row)


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Read a `metrics.jsonl` (or any JSON-lines file) into a list of dicts."""
    with Path(path).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_report(
    out_dir: Path | str,
    task: str,
    summaries: Sequence[RunSummary],
    *,
    curves: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    settings: Mapping[str, Any] | None = None,
    title: str | None = None,
) -> dict[str, Path]:
    """Write `report.md`, `curves.png` and `memory.png` into `out_dir`.

    Args:
        out_dir: An existing folder.
        task: The task name, shown in the report.
        summaries: One finished run per config, in table order.
        curves: Optional per-step training logs by config label (rows with `samples` and
            `loss`, as in `metrics.jsonl`); without them the loss curve uses the per-epoch
            training loss in each summary's history.
        settings: Optional settings shared by all runs (seed, lr, epochs...), listed in the
            report.
        title: The report's heading; `"gradaccum compare: <task>"` by default.

    Returns:
        `{"report": ..., "curves": ..., "memory": ...}` paths of the files written.

    Raises:
        ValueError: If `summaries` is empty or mixes metrics.
        ImportError: If matplotlib is not installed.
    """
    out = Path(out_dir)
    metric = _check(summaries)
    paths = {
        "report": out / "report.md",
        "curves": out / "curves.png",
        "memory": out / "memory.png",
    }
    plot_curves(paths["curves"], summaries, curves)
    plot_memory(paths["memory"], summaries)
    lines = [f"# {title or f'gradaccum compare: {task}'}", ""]
    direction = _direction(task)
    lines.append(
        f"Task `{task}`; validation metric: {metric}{direction}. Each config is written "
        "micro-batch x accumulation steps; its effective batch is their product."
    )
    if settings:
        lines += ["", "Settings: " + ", ".join(f"{key} {value}" for key, value in settings.items())]
    lines += [
        "",
        markdown_table(summaries),
        "",
        PEAK_MEMORY_NOTE,
        "",
        f"![training loss and validation {metric} against samples seen]({paths['curves'].name})",
        "",
        f"![peak memory against micro-batch size]({paths['memory'].name})",
        "",
    ]
    paths["report"].write_text("\n".join(lines))
    return paths


def _direction(task: str) -> str:
    from gradaccum.experiments.tasks import get_task

    try:
        higher = get_task(task).higher_is_better
    except ValueError:
        return ""
    return " (higher is better)" if higher else " (lower is better)"


def _figure(size: tuple[int, int], panels: int) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(size[0] / _DPI, size[1] / _DPI), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = [figure.add_subplot(1, panels, index + 1) for index in range(panels)]
    return figure, axes


def _smooth(values: list[float]) -> list[float]:
    """Exponential moving average with a span of about 1/25 of the curve."""
    span = max(1, len(values) // 25)
    alpha = 2 / (span + 1)
    smoothed, level = [], values[0] if values else 0.0
    for value in values:
        level = alpha * value + (1 - alpha) * level
        smoothed.append(level)
    return smoothed


def plot_curves(
    path: Path | str,
    summaries: Sequence[RunSummary],
    curves: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> Path:
    """Plot training loss and validation metric against samples seen, one line per config.

    Args:
        path: The PNG to write (`CURVES_SIZE` pixels).
        summaries: The runs.
        curves: Optional per-step rows (`samples`, `loss`) by config label; see `write_report`.

    Returns:
        `path`, as a `Path`.
    """
    metric = _check(summaries)
    figure, (loss_axes, metric_axes) = _figure(CURVES_SIZE, 2)
    all_positive = True
    for index, summary in enumerate(summaries):
        # Runs that agree (8x2 and 16x1 on an additive task) draw the same curve: later lines
        # are thinner, dashed and with smaller markers, so every one stays visible.
        style = {
            "color": f"C{index % 10}",
            "linestyle": _LINESTYLES[index % len(_LINESTYLES)],
            "linewidth": max(0.9, 2.4 - 0.5 * index),
            "label": f"{summary.config} (B={summary.effective_batch})",
        }
        marker = {
            "marker": _MARKERS[index % len(_MARKERS)],
            "markersize": max(3.0, 9.0 - 2.0 * index),
        }
        rows = (curves or {}).get(summary.config)
        if rows:
            samples = [float(row["samples"]) for row in rows]
            losses = [float(row["loss"]) for row in rows]
            loss_axes.plot(samples, losses, color=style["color"], alpha=0.15, linewidth=0.6)
            loss_axes.plot(samples, _smooth(losses), **style)
        else:
            samples = [float(row["samples"]) for row in summary.history]
            losses = [float(row["train_loss"]) for row in summary.history]
            loss_axes.plot(samples, losses, **style, **marker)
        all_positive = all_positive and all(value > 0 for value in losses if math.isfinite(value))
        metric_axes.plot(
            [row["samples"] for row in summary.history],
            [row["val_metric"] for row in summary.history],
            **style,
            **marker,
        )
    if all_positive:
        loss_axes.set_yscale("log")
    loss_axes.set(title="training loss", xlabel="samples seen", ylabel="loss")
    metric_axes.set(title=f"validation {metric}", xlabel="samples seen", ylabel=metric)
    for axes in (loss_axes, metric_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.savefig(path, dpi=_DPI)
    return Path(path)


def plot_memory(path: Path | str, summaries: Sequence[RunSummary]) -> Path:
    """Plot peak memory against micro-batch size, one point per config (labelled).

    Configs with the same micro-batch size share a point: their peak is the same, whatever the
    accumulation steps, which is the point of accumulation.

    Args:
        path: The PNG to write (`MEMORY_SIZE` pixels).
        summaries: The runs.

    Returns:
        `path`, as a `Path`.
    """
    _check(summaries)
    figure, (axes,) = _figure(MEMORY_SIZE, 1)
    by_micro: dict[int, list[RunSummary]] = {}
    for summary in summaries:
        by_micro.setdefault(summary.micro_batch_size, []).append(summary)
    micros = sorted(by_micro)
    peaks = [max(s.peak_memory_bytes for s in by_micro[m]) / 2**20 for m in micros]
    axes.plot(micros, peaks, "o-", color="C0")
    for micro, peak in zip(micros, peaks, strict=True):
        label = ", ".join(s.config for s in by_micro[micro])
        axes.annotate(label, (micro, peak), textcoords="offset points", xytext=(6, 6))
    if len(micros) > 1 and micros[-1] / micros[0] >= 8:
        axes.set_xscale("log", base=2)
    axes.set_xticks(micros, [str(m) for m in micros])
    axes.margins(x=0.15)
    axes.set_ylim(bottom=0, top=max(peaks) * 1.15)
    axes.set_title(
        "peak memory vs micro-batch size\n"
        "(weights + grads + AdamW moments + saved activations of one micro-batch)",
        fontsize="medium",
    )
    axes.set(xlabel="micro-batch size", ylabel="peak memory (MiB)")
    axes.grid(alpha=0.3)
    figure.savefig(path, dpi=_DPI)
    return Path(path)
