"""Reports of finished runs: a table (text, markdown or rich) and two plots.

`write_report(out_dir, task, summaries)` writes `report.md` (the table, a note on what "peak
memory" means, the settings and both plots), `curves.png` (training loss and validation metric
against samples seen, one line per config) and `memory.png` (peak memory against micro-batch
size). `format_table(summaries)` is the same table as aligned text. `gradaccum compare` and
`gradaccum demo` both use them. The plots are drawn by `gradaccum.experiments.plots`, whose
`plot_curves`, `plot_memory`, `CURVES_SIZE` and `MEMORY_SIZE` are importable from here too.

Example:
    >>> from gradaccum.experiments.base import RunSummary, TrainConfig
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
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from gradaccum.experiments.base import RunSummary, TrainConfig
from gradaccum.experiments.plots import (
    CURVES_SIZE,
    MEMORY_SIZE,
    plot_curves,
    plot_memory,
    shared_metric,
)

__all__ = [
    "CURVES_SIZE",
    "MEMORY_SIZE",
    "PEAK_MEMORY_NOTE",
    "format_bytes",
    "format_seconds",
    "format_table",
    "markdown_table",
    "noise_scale_note",
    "packing_notes",
    "plot_curves",
    "plot_memory",
    "print_table",
    "read_metrics",
    "report_settings",
    "table_rows",
    "write_report",
]

PEAK_MEMORY_NOTE = (
    "Peak memory: bytes of weights + gradients + the two AdamW moments + the activations "
    "autograd saves for one micro-batch (measured with saved-tensor hooks); it is not the "
    "process RSS."
)

_NUMERIC_COLUMNS = frozenset(range(1, 9))


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


def table_rows(summaries: Sequence[RunSummary]) -> tuple[list[str], list[list[str]]]:
    """The report table as strings: headers and one row per run, in the given order.

    Columns: config, effective batch, micro-batch, steps, best and final validation metric, peak
    memory, samples/s and wall time.

    Raises:
        ValueError: If `summaries` is empty or mixes metrics.
    """
    metric = shared_metric(summaries)
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


def packing_notes(summaries: Sequence[RunSummary]) -> list[str]:
    """One line per config packed by a token budget (`B@Nt`): what its packing made.

    Its table row reads differently: "micro-batch" is the rows of its largest micro-batch, and
    its peak memory is measured on the micro-batch holding the most padded tokens.
    """
    return [
        f"{s.config}: batch {s.effective_batch} packed into micro-batches of at most "
        f"{s.max_tokens} padded tokens (rows x longest row), {s.micro_batches_per_step:g} per "
        f"step on average, at most {s.accumulation_steps}; micro-batch = the largest one's rows, "
        "peak memory measured on the one with the most padded tokens."
        for s in summaries
        if s.max_tokens is not None
    ]


def noise_scale_note(summaries: Sequence[RunSummary]) -> str | None:
    """What effective batch the gradient noise scale suggests, from each run's last estimate.

    `B_simple` (McCandlish et al., 2018) predicts the critical batch size: below it, doubling
    the batch nearly halves the steps to a given loss; well above it, more items per step buy
    little. Each run reports its own last smoothed estimate (`gradaccum.telemetry`); the
    sentence uses their median and places the compared effective batches against it.
    """
    scales = [(s.config, s.noise_scale) for s in summaries if s.noise_scale is not None]
    if not scales:
        return None
    middle = statistics.median(value for _, value in scales)
    batches = sorted({s.effective_batch for s in summaries})
    below = [b for b in batches if b < middle / 2]
    above = [b for b in batches if b > middle * 2]
    listing = ", ".join(f"{config} {value:,.0f}" for config, value in scales)
    verdict = []
    if below:
        verdict.append(
            f"effective batches {_listed(below)} sit well below it: larger ones would "
            "still cut the steps nearly in proportion"
        )
    if above:
        verdict.append(
            f"{_listed(above)} sit well above it: fewer items per step would reach "
            "the same loss with fewer items seen"
        )
    if not verdict:
        verdict.append(f"the compared effective batches ({_listed(batches)}) are near it")
    return (
        f"Gradient noise scale at the end of training: B_simple ~ {middle:,.0f} (per config: "
        f"{listing}). It predicts the critical batch size (McCandlish et al. 2018): below it, "
        "doubling the batch nearly halves the steps to a given loss; well above it, extra items "
        f"per step buy little. Here {'; '.join(verdict)}."
    )


def _listed(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)


def _batches(values: Sequence[int]) -> str:
    """`effective batch 32 is` or `effective batches 32, 64 are`."""
    if len(values) == 1:
        return f"effective batch {values[0]} is"
    return f"effective batches {_listed(values)} are"


def report_settings(config: TrainConfig, threads: int) -> dict[str, Any]:
    """The settings `config` shares with the other configs of a compare, as the report says."""
    from gradaccum.experiments.tasks import get_task

    task = get_task(config.task)
    settings: dict[str, Any] = {"seed": config.seed}
    if config.steps is not None:
        settings["steps"] = config.steps
    else:
        settings["epochs"] = config.epochs or task.default_epochs
    base_lr = config.lr if config.lr is not None else task.default_lr
    settings["lr"] = f"{base_lr:g} at batch {task.reference_batch_size}"
    settings["lr scaling"] = getattr(config.lr_scaling, "value", config.lr_scaling)
    settings["warmup"] = f"{config.warmup} steps"
    settings["precision"] = config.precision
    if config.accum_dtype:
        settings["accum dtype"] = config.accum_dtype
    if config.task == "shapes":
        settings["norm"], settings["bn"] = config.model_norm, config.bn
    if config.init_from:
        settings["init from"] = config.init_from
    return {**settings, "optimizer": "AdamW", "threads": threads}


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
    metric = shared_metric(summaries)
    paths = {
        "report": out / "report.md",
        "curves": out / "curves.png",
        "memory": out / "memory.png",
    }
    plot_curves(paths["curves"], summaries, curves)
    plot_memory(paths["memory"], summaries)
    lines = [f"# {title or f'gradaccum compare: {task}'}", ""]
    direction = _direction(task)
    notes = packing_notes(summaries)
    noise = noise_scale_note(summaries)
    lines.append(
        f"Task `{task}`; validation metric: {metric}{direction}. Each config is written "
        "micro-batch x accumulation steps; its effective batch is their product."
        + (
            " A config `B@Nt` packs an effective batch of B by a budget of N tokens."
            if notes
            else ""
        )
    )
    if settings:
        lines += ["", "Settings: " + ", ".join(f"{key} {value}" for key, value in settings.items())]
    lines += [
        "",
        markdown_table(summaries),
        "",
        *(f"- {note}" for note in notes),
        *([""] if notes else []),
        PEAK_MEMORY_NOTE,
        "",
        *([noise, ""] if noise else []),
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
