"""`gradaccum plan`: the memory plan and automatic micro-batch size (not yet available).

Automatic micro-batch sizing (API.md `plan_micro_batch`, `micro_batch_size="auto"`) lands with
a later release. Until then this command accepts its options, checks them, and says what to do
instead: pass `--micro-batch-size` explicitly, and confirm the split with `gradaccum check`.

Exit codes: 1 the plan is not available in this version (the options were fine), 2 bad usage or
input (an unknown task, a malformed `--model` or `--memory-budget`).

Example:
    >>> parse_memory_budget("2GiB"), parse_memory_budget("512MB"), parse_memory_budget("4096")
    (2147483648, 512000000, 4096)
"""

from __future__ import annotations

import argparse
import sys

from gradaccum.cli import PROG, UsageError
from gradaccum.cli._args import positive_int
from gradaccum.cli._check_targets import add_target_arguments, parse_factory_spec
from gradaccum.memory import parse_bytes

__all__ = ["NOT_AVAILABLE", "add_parser", "parse_memory_budget", "run"]

NOT_AVAILABLE = (
    "automatic micro-batch sizing is not yet available in this version; pass "
    "--micro-batch-size explicitly instead (e.g. 'gradaccum train --task digits "
    "--micro-batch-size 8') and confirm the split with 'gradaccum check --micro-batch-size 8'"
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `plan` command.

    Args:
        subparsers: The top-level parser's sub-parser collection.

    Returns:
        The `plan` sub-parser.
    """
    parser = subparsers.add_parser(
        "plan",
        help="memory plan and automatic micro-batch size (not yet available: pass "
        "--micro-batch-size explicitly)",
        description=(
            "The memory plan (parameters, gradients, optimizer state, activations per item) and "
            "the largest micro-batch that fits a memory budget. NOT YET AVAILABLE in this "
            "version: the command checks its options, then prints what to do instead (pass "
            "--micro-batch-size explicitly to train/compare/check) on stderr and exits with "
            "code 1. Exit code 2 means bad usage or input."
        ),
    )
    add_target_arguments(parser)
    parser.add_argument(
        "--memory-budget",
        metavar="BYTES",
        default=None,
        help="memory the micro-batch may use: bytes, or a number with a unit such as 512MB or 2GiB",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        metavar="B",
        help="items in the whole batch (default: the task's batch size)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the options, then report that planning is not available yet.

    Args:
        args: Parsed options: `task` or `model`, `memory_budget`, `batch_size`.

    Returns:
        1: the plan is not available in this version.

    Raises:
        UsageError: For an unknown task, a malformed `--model` or `--memory-budget`.
    """
    if args.task is not None:
        from gradaccum.experiments.tasks import TASKS

        if args.task not in TASKS:
            raise UsageError(f"unknown task {args.task!r}; choose one of: {', '.join(TASKS)}")
    else:
        parse_factory_spec(args.model)
    if args.memory_budget is not None:
        parse_memory_budget(args.memory_budget)
    print(f"{PROG} plan: {NOT_AVAILABLE}", file=sys.stderr)
    return 1


def parse_memory_budget(text: str) -> int:
    """Bytes in a budget written as `"4096"`, `"512MB"`, `"1.5GB"` or `"2GiB"` (case-insensitive).

    The forms are those of `gradaccum.memory.parse_bytes`.

    Args:
        text: The `--memory-budget` value.

    Returns:
        The budget in bytes, > 0.

    Raises:
        UsageError: If `text` is not a positive number with an optional known unit.
    """
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise UsageError(f"--memory-budget {error}") from None
