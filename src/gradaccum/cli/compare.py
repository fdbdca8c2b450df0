"""`gradaccum compare`: train several micro-batch x accumulation configs and compare them.

Each config `MxK` trains with micro-batches of M and K accumulation steps, so an effective batch
of M*K; a config `B@Nt` (charlm) trains an effective batch of B packed by a token budget of N
(micro-batches of at most N padded tokens; see `gradaccum.cli._configs`). All run with the same
seed (same initial weights) and, for equal effective batches, the same batches in the same order.
On a task without BatchNorm, `8x8`, `64x1` and `64@2048t` therefore end with the same
parameters, up to float32 rounding.

Everything is checked (every config resolved) before anything is written. Results go to a hidden
staging folder renamed to `--out` at the end, so a failure leaves nothing half-written:

- one sub-folder per config with the files of `gradaccum train`;
- `report.md` with the table, `curves.png` and `memory.png` (see `gradaccum.experiments.report`).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gradaccum._install import install_hint
from gradaccum.cli import UsageError
from gradaccum.cli._args import torch_threads
from gradaccum.cli._configs import ConfigSpec, parse_config
from gradaccum.cli._notes import batchnorm_warnings_as_notes, show_batchnorm_notes
from gradaccum.cli._outdir import resolve_out_dir, staged_out_dir, terminate_as_interrupt
from gradaccum.cli._training_options import (
    CheckedRun,
    add_training_options,
    build_config,
    describe_run,
    train_items,
    validate_config,
)
from gradaccum.experiments.base import RunSummary

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `compare` command.

    Args:
        subparsers: The top-level parser's sub-parser collection.

    Returns:
        The `compare` sub-parser.
    """
    parser = subparsers.add_parser(
        "compare",
        help="compare micro-batch x accumulation configs on an embedded task",
        description=(
            "Train one run per config, written MICROxSTEPS (8x2: micro-batches of 8, 2 "
            "accumulation steps, effective batch 16) or BATCH@TOKENSt (charlm; 64@2048t: batch "
            "64 packed into micro-batches of at most 2048 padded tokens), all with the same seed "
            "and data order, "
            "then write report.md (table), curves.png and memory.png to --out and print the "
            "table. Batch sizes come from --configs. Exit 2 on bad usage or input, with nothing "
            "written."
        ),
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        required=True,
        metavar="MxK|B@Nt",
        help="configs to compare, e.g. 8x1 8x2 16x1 (micro-batch x accumulation steps) or "
        "64@2048t (batch 64 packed by a budget of 2048 tokens per micro-batch; charlm)",
    )
    add_training_options(parser, batch_options=False)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check everything, train each config, write the report and print the table.

    Args:
        args: The parsed options of `add_parser`.

    Returns:
        0 on success.

    Raises:
        UsageError: On bad options or configs, before anything is written.
    """
    started = time.perf_counter()
    checked = _check(args)
    out = resolve_out_dir(args.out, "compare", args.task)
    with torch_threads(args.threads), batchnorm_warnings_as_notes():
        return _compare(args, checked, out, started)


def _compare(args: argparse.Namespace, checked: list[CheckedRun], out: Path, started: float) -> int:
    """Train each checked config into `out`, write the report and print the table."""
    from gradaccum.experiments.report import (
        PEAK_MEMORY_NOTE,
        noise_scale_note,
        packing_notes,
        print_table,
        write_report,
    )

    first = checked[0].config
    print(f"gradaccum compare: {args.task}, {len(checked)} configs, seed {first.seed}")
    for item in checked:
        print(f"  {describe_run(item)}")
    show_batchnorm_notes(checked)
    print(f"  writing to {out}")
    with terminate_as_interrupt(), staged_out_dir(out) as staging:
        summaries, curves = [], {}
        for index, item in enumerate(checked, start=1):
            summary, rows = _train_one(item, staging, f"[{index}/{len(checked)}] {item.label}")
            summaries.append(summary)
            curves[item.label] = rows
        paths = write_report(
            staging, args.task, summaries, curves=curves, settings=_settings(args, checked)
        )
    print()
    print_table(summaries, title=f"gradaccum compare: {args.task}")
    for note in packing_notes(summaries):
        print(note)
    print(PEAK_MEMORY_NOTE)
    noise = noise_scale_note(summaries)
    if noise:
        print(noise)
    print()
    print(f"results in {out}: " + ", ".join(path.name for path in paths.values()))
    print(f"  and one folder per config: {', '.join(item.label for item in checked)}")
    print(f"total time {time.perf_counter() - started:.1f} s")
    return 0


def _check(args: argparse.Namespace) -> list[CheckedRun]:
    for option in ("batch_size", "micro_batch_size", "max_tokens"):
        if getattr(args, option) is not None:
            raise UsageError(
                f"--{option.replace('_', '-')} is not a compare option: batch sizes come from "
                "--configs (e.g. 8x2 = micro-batch 8 x 2 accumulation steps, 64@2048t = batch "
                "64 packed by 2048 tokens)"
            )
    if args.memory_budget is not None:
        raise UsageError(
            "--memory-budget is not a compare option: micro-batch sizes come from --configs"
        )
    specs = [parse_config(text) for text in args.configs]
    seen: set[ConfigSpec] = set()
    for text, spec in zip(args.configs, specs, strict=True):
        if spec in seen:
            raise UsageError(f"config {text!r} is given twice")
        seen.add(spec)
    items = train_items(args.task, args.seed)
    checked = [
        validate_config(
            build_config(
                args,
                batch_size=spec.batch_size,
                micro_batch_size=spec.micro_batch_size,
                max_tokens=spec.max_tokens,
            ),
            items,
        )
        for spec in specs
    ]
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "compare draws its plots with matplotlib, which is not installed; "
            + install_hint("cli")
        )
    return checked


def _train_one(
    item: CheckedRun, staging: Path, label: str
) -> tuple[RunSummary, list[dict[str, Any]]]:
    """Train one config into `staging/<label>`; return its summary and per-step logs."""
    from gradaccum.experiments.progress import progress
    from gradaccum.experiments.runner import StepLog, train

    folder = staging / item.label
    folder.mkdir()
    rows: list[dict[str, Any]] = []
    with progress(label, item.total_steps) as bar:

        def on_step(log: StepLog, *rest: Any) -> None:
            rows.append(asdict(log))
            bar(log, *rest)

        summary = train(item.config, out=folder, on_step=on_step)
    return summary, rows


def _settings(args: argparse.Namespace, checked: list[CheckedRun]) -> dict[str, Any]:
    from gradaccum.experiments.tasks import get_task

    task = get_task(args.task)
    config = checked[0].config
    settings: dict[str, Any] = {"seed": config.seed}
    if config.steps is not None:
        settings["steps"] = config.steps
    else:
        settings["epochs"] = config.epochs or task.default_epochs
    base_lr = config.lr if config.lr is not None else task.default_lr
    settings["lr"] = f"{base_lr:g} at batch {task.reference_batch_size}"
    settings["lr scaling"] = args.lr_scaling
    settings["warmup"] = f"{config.warmup} steps"
    settings["precision"] = config.precision
    if config.accum_dtype:
        settings["accum dtype"] = config.accum_dtype
    if args.task == "shapes":
        settings["norm"] = config.model_norm
        settings["bn"] = config.bn
    if config.init_from:
        settings["init from"] = config.init_from
    settings["optimizer"] = "AdamW"
    settings["threads"] = args.threads
    return settings
