"""`gradaccum plan`: what a training step keeps in memory, and the micro-batch that fits a budget.

It builds the model and batch of `--task` (or of your `--model module:factory`, as `gradaccum
check` does), the optimizer `train` uses (AdamW, or SGD with `--optimizer sgd`), and runs
`gradaccum.plan_micro_batch`: probes on slices of the batch, measured, leaving everything as it
was. Exit codes: 0 a plan was made, 1 nothing fits, 2 bad usage or input.

    $ gradaccum plan --task charlm --batch-size 256 --memory-budget 64MiB
"""

from __future__ import annotations

import argparse
import sys

import torch

from gradaccum.cli import PROG, UsageError
from gradaccum.cli._args import byte_count, error_summary, thread_count, torch_threads
from gradaccum.cli.check import add_target_options, build_target
from gradaccum.memory import parse_bytes

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `plan` command."""
    parser = subparsers.add_parser(
        "plan",
        help="memory plan: parameters, gradients, optimizer state, activations per item, and "
        "the largest micro-batch that fits --memory-budget",
        description="Measure what one training step keeps in memory on slices of the batch and "
        "choose the largest micro-batch whose predicted peak fits --memory-budget less a "
        "safety margin. Exit 0 with a plan, 1 if nothing fits, 2 on bad usage or input.",
    )
    add_target_options(parser)
    parser.add_argument(
        "--memory-budget",
        type=byte_count,
        metavar="BYTES",
        required=True,
        help="memory a training step may use: bytes, or a number with a unit such as 512MB or 2GiB",
    )
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "sgd"),
        default="adamw",
        help="whose state to count (default: adamw, as train uses)",
    )
    parser.add_argument(
        "--margin", type=float, default=0.05, help="share of the budget kept free (default: 0.05)"
    )
    parser.add_argument("--threads", type=thread_count, default=1, metavar="N")
    return parser


def run(args: argparse.Namespace) -> int:
    """Make the plan and print it: 0 with a plan, 1 if one item per micro-batch does not fit."""
    from gradaccum import MemoryBudgetError, plan_micro_batch

    if not 0 <= args.margin < 1:
        raise UsageError(f"--margin {args.margin} must be in [0, 1), e.g. 0.05")
    with torch_threads(args.threads):
        torch.manual_seed(args.seed)
        target = build_target(args)
        params = [p for p in target.model.parameters() if p.requires_grad]
        if not params:  # AdamW([]) raises
            raise UsageError(f"{target.label}: no parameter requires grad; unfreeze some to plan")
        optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(params, lr=0.1, momentum=0.9)
            if args.optimizer == "sgd"
            else torch.optim.AdamW(params)
        )
        try:
            plan = plan_micro_batch(
                target.model,
                target.batch,
                target.loss_fn,
                optimizer,
                memory_budget=parse_bytes(args.memory_budget),
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
    if target.task is not None and args.optimizer == "adamw":  # train steps AdamW
        same = " --norm group" if args.norm == "group" else ""  # the setup measured
        same += f" --precision {args.precision}" if args.precision != "fp32" else ""
        print(
            f"train with: {PROG} train --task {target.task} --batch-size {target.items}{same} "
            f"--micro-batch-size {plan.micro_batch_size}   (or --micro-batch-size auto "
            f"--memory-budget {args.memory_budget})"
        )
    return 0
