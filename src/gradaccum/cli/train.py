"""`gradaccum train`: train one configuration of an embedded task and log it.

Every option is checked (and the configuration resolved) before anything is written. The run's
files are written into a hidden staging folder next to `--out`, which is renamed to `--out` when
the run finishes, so a failed or interrupted run leaves nothing behind:

- `metrics.jsonl`: one line per optimizer step (step, samples, loss, lr, grad_norm, time);
- `validation.jsonl`: the validation metric after each epoch (and after the last step);
- `summary.json`: the run's `RunSummary`;
- `checkpoint.pt`: model, optimizer, scheduler and accumulator state (`gradaccum.load_checkpoint`).
"""

from __future__ import annotations

import argparse

import torch

from gradaccum.cli._outdir import resolve_out_dir, staged_out_dir, terminate_as_interrupt
from gradaccum.cli._training_options import (
    add_training_options,
    build_config,
    describe_run,
    train_items,
    validate_config,
)
from gradaccum.experiments.base import RunSummary

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `train` command.

    Args:
        subparsers: The top-level parser's sub-parser collection.

    Returns:
        The `train` sub-parser.
    """
    parser = subparsers.add_parser(
        "train",
        help="train one configuration of an embedded task (digits, shapes, charlm)",
        description=(
            "Train an embedded task with exact gradient accumulation: each optimizer step sees "
            "--batch-size items, split into micro-batches of --micro-batch-size. Shows progress "
            "on stderr and writes metrics.jsonl, validation.jsonl, summary.json and "
            "checkpoint.pt to --out. Exit 2 on bad usage or input, with nothing written."
        ),
    )
    add_training_options(parser, batch_options=True)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the options, train, and print a short summary.

    Args:
        args: The parsed options of `add_parser`.

    Returns:
        0 on success.

    Raises:
        UsageError: On bad options, before anything is written.
    """
    from gradaccum.experiments.progress import progress
    from gradaccum.experiments.runner import train

    config = build_config(args, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size)
    checked = validate_config(config, train_items(args.task, args.seed))
    out = resolve_out_dir(args.out, "train", args.task)

    torch.set_num_threads(args.threads)
    print(f"gradaccum train: {args.task} {describe_run(checked)}")
    print(f"  writing to {out}")
    with (
        terminate_as_interrupt(),
        staged_out_dir(out) as staging,
        progress(f"{args.task} {checked.label}", checked.total_steps) as on_step,
    ):
        summary = train(config, out=staging, on_step=on_step)
    _print_summary(summary, out)
    return 0


def _print_summary(summary: RunSummary, out: object) -> None:
    from gradaccum.experiments.report import PEAK_MEMORY_NOTE, format_bytes, format_seconds

    print(
        f"done: {summary.optimizer_steps} optimizer steps, {summary.samples_seen:,} samples, "
        f"{summary.samples_per_second:,.0f} samples/s, wall time "
        f"{format_seconds(summary.wall_seconds)}"
    )
    print(
        f"  validation {summary.metric}: final {summary.final_metric:.4f}, "
        f"best {summary.best_metric:.4f}"
    )
    print(f"  peak memory {format_bytes(summary.peak_memory_bytes)}")
    print(f"  ({PEAK_MEMORY_NOTE})")
    print(f"  results in {out}")
