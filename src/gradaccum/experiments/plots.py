"""The two plots of a report: learning curves and peak memory, one line or point per config.

`plot_curves` draws training loss and validation metric against samples seen; `plot_memory` draws
peak memory against micro-batch size. `gradaccum.experiments.report.write_report` draws both.

matplotlib is imported only when a plot is drawn, and only its object-oriented API with the Agg
canvas is used: no pyplot, so no global backend is switched and no window is ever opened.

Example:
    >>> shared_metric([])
    Traceback (most recent call last):
    ...
    ValueError: no runs to report
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gradaccum.experiments.base import RunSummary

__all__ = ["CURVES_SIZE", "MEMORY_SIZE", "plot_curves", "plot_memory", "shared_metric"]

# Pixel sizes (width, height) of the plots, at _DPI dots per inch.
CURVES_SIZE = (1200, 480)
MEMORY_SIZE = (720, 480)
_DPI = 100

_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P")


def shared_metric(summaries: Sequence[RunSummary]) -> str:
    """The validation metric that all of `summaries` report, for one table or plot.

    Raises:
        ValueError: If `summaries` is empty, or its runs report different metrics.
    """
    if not summaries:
        raise ValueError("no runs to report")
    metrics = {summary.metric for summary in summaries}
    if len(metrics) != 1:
        raise ValueError(f"runs of different tasks cannot share a table (metrics {metrics})")
    return metrics.pop()


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
    metric = shared_metric(summaries)
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
    accumulation steps, which is the point of accumulation. Configs packed by a token budget
    (`B@Nt`) are separate squares, at the rows of their largest micro-batch.

    Args:
        path: The PNG to write (`MEMORY_SIZE` pixels).
        summaries: The runs.

    Returns:
        `path`, as a `Path`.
    """
    shared_metric(summaries)
    figure, (axes,) = _figure(MEMORY_SIZE, 1)
    by_micro: dict[int, list[RunSummary]] = {}
    packed = [summary for summary in summaries if summary.max_tokens is not None]
    for summary in summaries:
        if summary.max_tokens is None:
            by_micro.setdefault(summary.micro_batch_size, []).append(summary)
    micros = sorted(by_micro)
    peaks = [max(s.peak_memory_bytes for s in by_micro[m]) / 2**20 for m in micros]
    points = [
        (", ".join(s.config for s in by_micro[m]), m, p) for m, p in zip(micros, peaks, strict=True)
    ]
    axes.plot(micros, peaks, "o-", color="C0")
    for summary in packed:
        peak = summary.peak_memory_bytes / 2**20
        axes.plot([summary.micro_batch_size], [peak], "s", color="C1")
        points.append((summary.config, summary.micro_batch_size, peak))
    for label, micro, peak in points:
        axes.annotate(label, (micro, peak), textcoords="offset points", xytext=(6, 6))
    ticks = sorted({micro for _, micro, _ in points})
    if len(ticks) > 1 and ticks[-1] / ticks[0] >= 8:
        axes.set_xscale("log", base=2)
    axes.set_xticks(ticks, [str(m) for m in ticks])
    axes.margins(x=0.15)
    axes.set_ylim(bottom=0, top=max(peak for _, _, peak in points) * 1.15)
    axes.set_title(
        "peak memory vs micro-batch size\n"
        "(weights + grads + AdamW moments + saved activations of one micro-batch)",
        fontsize="medium",
    )
    xlabel = "micro-batch size" + (" (B@Nt: rows of its largest micro-batch)" if packed else "")
    axes.set(xlabel=xlabel, ylabel="peak memory (MiB)")
    axes.grid(alpha=0.3)
    figure.savefig(path, dpi=_DPI)
    return Path(path)
