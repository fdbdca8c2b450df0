"""`gradaccum plan`: what a training step keeps in memory, and the micro-batch that fits a budget.

It builds the model and batch of `--task` (or of your `--model module:factory`), the optimizer
the `train` command uses (AdamW, or SGD with `--optimizer sgd`), and runs
`gradaccum.plan_micro_batch`: probes on slices of the batch, measured, leaving everything as it
was. It prints the plan's table and the `train` command that uses it.

    $ gradaccum plan --task charlm --batch-size 256 --memory-budget 64MiB

Exit codes: 0 a plan was made, 1 nothing fits (even one item per micro-batch exceeds the budget),
2 bad usage or input.

Example:
    >>> parse_memory_budget("2GiB"), parse_memory_budget("512MB"), parse_memory_budget("4096")
    (2147483648, 512000000, 4096)
"""

from __future__ import annotations

import argparse
import sys

import torch

from gradaccum.cli import PROG, UsageError
from gradaccum.cli._args import (
    add_threads_option,
    byte_count,
    error_summary,
    positive_int,
    torch_threads,
)
from gradaccum.cli._check_targets import add_target_arguments, batch_items, build_target
from gradaccum.memory import parse_bytes

__all__ = ["add_parser", "parse_memory_budget", "run"]

_OPTIMIZERS = ("adamw", "sgd")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `plan` command.

    Args:
        subparsers: The top-level parser's sub-parser collection.

    Returns:
        The `plan` sub-parser.
    """
    parser = subparsers.add_parser(
        "plan",
        help="memory plan: parameters, gradients, optimizer state, activations per item, and "
        "the largest micro-batch that fits --memory-budget",
        description=(
            "Measure what one training step keeps in memory (parameters, gradients, optimizer "
            "state, activations per item, workspace) on slices of the batch, and choose the "
            "largest micro-batch whose predicted peak fits --memory-budget less a safety "
            "margin. Exit 0 with a plan, 1 if nothing fits, 2 on bad usage or input."
        ),
    )
    add_target_arguments(parser)
    parser.add_argument(
        "--memory-budget",
        metavar="BYTES",
        required=True,
        help="memory a training step may use: bytes, or a number with a unit such as 512MB or 2GiB",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        metavar="B",
        help="items in the whole batch (default: the task's batch size, or all of the "
        "factory's batch)",
    )
    parser.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="autocast"
    )
    parser.add_argument(
        "--optimizer",
        choices=_OPTIMIZERS,
        default="adamw",
        help="whose state to count (default: adamw, as train uses)",
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=0.05,
        help="share of the budget kept free (default: 0.05)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data and weights")
    parser.add_argument(
        "--norm",
        choices=("batch", "group"),
        default=None,
        help="--task only: normalization layers of the task's model",
    )
    add_threads_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Make the plan and print it.

    Args:
        args: Parsed options of `add_parser`.

    Returns:
        0 with a plan; 1 if even one item per micro-batch does not fit.

    Raises:
        UsageError: For an unknown task, a bad factory, budget, margin or batch size.
    """
    budget = parse_memory_budget(args.memory_budget)
    if not 0 <= args.margin < 1:
        raise UsageError(f"--margin {args.margin} must be in [0, 1), e.g. 0.05")
    with torch_threads(args.threads):
        return _plan(args, budget)


def _plan(args: argparse.Namespace, budget: int) -> int:
    """Build the target, make the plan and print it (threads already set)."""
    from gradaccum import MemoryBudgetError, plan_micro_batch

    torch.manual_seed(args.seed)
    target = build_target(args)
    params = [p for p in target.model.parameters() if p.requires_grad]
    if args.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(params)
    try:
        plan = plan_micro_batch(
            target.model,
            target.batch,
            target.loss_fn,
            optimizer,
            memory_budget=budget,
            precision=args.precision,
            margin=args.margin,
        )
    except MemoryBudgetError as error:
        print(f"{PROG} plan: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # the user's model or loss failed on this batch: bad input
        raise UsageError(f"the plan could not be made: {error_summary(error)}") from error
    print(f"{PROG} plan: {target.label}, {args.optimizer}, {args.precision}")
    print(plan)
    if target.task is not None:
        items = batch_items(target.batch)
        print(
            f"train with: {PROG} train --task {target.task} --batch-size {items} "
            f"--micro-batch-size {plan.micro_batch_size}   (or --micro-batch-size auto "
            f"--memory-budget {args.memory_budget})"
        )
    return 0


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
        return parse_bytes(byte_count(text))
    except (ValueError, argparse.ArgumentTypeError) as error:
        raise UsageError(f"--memory-budget {error}") from None
