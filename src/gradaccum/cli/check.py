"""`gradaccum check`: is accumulating micro-batches exact for this model, batch and loss?

It runs `gradaccum.check_equivalence` (one full-batch backward against one accumulated backward,
on copies of the model, in float64 by default), prints the per-parameter table and, when they
differ, why: modules that mix the items of a micro-batch (BatchNorm in train mode, dropout) or a
loss that is not a sum over items. The target is an embedded task (`--task`, its first B training
items, model in train mode) or your code (`--model module:factory`, `factory()` returning
`(model, batch, loss_fn)`; the current directory is importable). `gradaccum plan` uses the same.

Exit codes: 0 exact to rounding, 1 not exact, 2 bad usage or input.

Example:
    >>> [default_micro_batch_size(b) for b in (32, 16, 10, 9, 4, 1)]
    [11, 6, 4, 5, 3, 1]
"""

from __future__ import annotations

import argparse
import math
import os
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum._loss_call import hints
from gradaccum.batching import batch_size, split_batch
from gradaccum.cli import UsageError
from gradaccum.cli._args import error_summary, one_line, positive_int, seed
from gradaccum.verify import EquivalenceReport, check_equivalence

__all__ = ["Target", "add_parser", "add_target_options", "build_target", "run"]

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Target:
    """A model (in the mode it is checked in), a whole batch, a loss, and how to name them."""

    model: torch.nn.Module
    batch: Any
    loss_fn: Callable[..., Any]
    label: str
    task: str | None = None

    @property
    def items(self) -> int:
        """Items in the batch (its leading dimension)."""
        return batch_size(self.batch)


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """`--task` or `--model` (one is required), `--batch-size`, `--seed` and `--norm`."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--task", metavar="T", help="an embedded task: digits, shapes or charlm")
    group.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="your code: FACTORY() returns (model, batch, loss_fn)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="B",
        help="the first B items (default: the task's batch, or the factory's)",
    )
    parser.add_argument(
        "--seed", type=seed, default=0, help="seed of data, weights and the factory (default: 0)"
    )
    parser.add_argument(
        "--norm", choices=("batch", "group"), help="--task only: the model's normalization"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `check` command."""
    parser = subparsers.add_parser(
        "check",
        help="check that accumulating micro-batches gives exactly the full-batch gradient",
        description="Compare the accumulated gradient with the full-batch gradient for an embedded "
        "task or your model, print a per-parameter table and name what makes accumulation "
        "inexact. Exit 0 exact to rounding, 1 not exact, 2 bad usage or input.",
    )
    add_target_options(parser)
    parser.add_argument(
        "--micro-batch-size",
        type=positive_int,
        metavar="M",
        help="items per micro-batch (default: about B/3, a ragged split)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(_DTYPES),
        default="float64",
        help="compute dtype of both runs (default: float64)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the check and print its report: 0 if exact to rounding, else 1."""
    torch.manual_seed(args.seed)
    target = build_target(args)
    size = target.items
    micro = args.micro_batch_size or default_micro_batch_size(size)
    if micro > size:
        raise UsageError(
            f"--micro-batch-size {micro} is larger than the batch ({size} items); pass "
            f"less than {size} to check an actual split"
        )
    torch.manual_seed(args.seed)
    try:
        report = check_equivalence(
            target.model, target.batch, target.loss_fn, micro, dtype=_DTYPES[args.dtype]
        )
    except Exception as exc:  # the user's model or loss failed on this batch: bad input
        raise UsageError(f"the check could not run: {error_summary(exc)}{hints(exc)}") from exc
    sizes = [micro] * (size // micro) + ([size % micro] if size % micro else [])
    split = " + ".join(map(str, sizes)) if len(sizes) <= 8 else f"{len(sizes)} micro-batches"
    how = "--micro-batch-size" if args.micro_batch_size else "default, a ragged split"
    mode = "train" if target.model.training else "eval"
    print(f"gradaccum check: {target.label}, model in {mode} mode")
    print(f"  batch: {size} items; micro-batch size {micro} ({how}): {split}")
    print(f"  one full-batch backward vs {len(sizes)} accumulated backwards, in {args.dtype}\n")
    print(report, end="\n\n")
    _diagnose(report, target, size)
    return 0 if report.ok else 1


def default_micro_batch_size(size: int) -> int:
    """About a third of `size`, chosen so the last micro-batch is smaller (a ragged split).

    The last keeps at least 2 items where possible: BatchNorm1d cannot train on one item.
    """
    if size <= 2:
        return 1
    start = math.ceil(size / 3)
    candidates = (*range(start, 1, -1), *range(start + 1, size))
    for fits in (lambda m: size % m >= 2, lambda m: size % m != 0):
        for micro in candidates:
            if fits(micro):
                return micro
    return max(1, size // 2)


def _diagnose(report: EquivalenceReport, target: Target, size: int) -> None:
    if report.micro_batch_size >= size:
        print(
            "note: the micro-batch is the whole batch, so the check compares a batch with itself; "
            "pass a smaller --micro-batch-size."
        )
    explained = report.explain()
    if target.task == "shapes":  # the task's own options do what the generic advice says
        explained = re.sub(
            r"-> convert it .*",
            "-> rerun with --norm group (GroupNorm normalizes each image alone), or train with "
            "--bn pooled (running statistics from the whole window) or --bn frozen; see "
            "docs/batchnorm.md",
            explained,
        )
    print(explained)


def build_target(args: argparse.Namespace) -> Target:
    """The target of `--task` or `--model`, cut to `--batch-size` items; or a `UsageError`."""
    if args.task is not None:
        from gradaccum.experiments.tasks import get_task

        norm = args.norm or "batch"
        try:
            task = get_task(args.task)
            model, data = task.make_model(args.seed, norm), task.make_data(args.seed)
        except (ValueError, ImportError) as error:
            raise UsageError(one_line(error).rstrip(".")) from None
        label = f"task {args.task} (norm {norm}, seed {args.seed})"
        target = Target(model.train(), data.train, task.loss_fn, label, args.task)
        size = args.batch_size or task.default_batch_size
        return _cut(target, size, f"the {args.task} training set", "")
    if args.norm is not None:
        raise UsageError("--norm applies to --task only; build the model you want in the factory")
    spec = f"--model {args.model!r}"
    try:
        result = load_factory(args.model)()
    except UsageError:
        raise
    except (Exception, SystemExit) as error:  # sys.exit() too: no silent exit 0
        raise UsageError(f"{spec}: the factory raised {error_summary(error)}") from error
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        size = f" of {len(result)} items" if isinstance(result, (tuple, list)) else ""
        raise UsageError(
            f"{spec}: the factory must return (model, batch, loss_fn), got a "
            f"{type(result).__name__}{size}"
        )
    model, batch, loss_fn = result
    if not isinstance(model, torch.nn.Module):
        got = type(model).__name__
        raise UsageError(f"{spec}: the factory's first item must be a torch.nn.Module, not {got}")
    if not callable(loss_fn):
        got = type(loss_fn).__name__
        raise UsageError(f"{spec}: the third item must be loss_fn(model, micro_batch), not {got}")
    target = Target(model, batch, loss_fn, f"model {args.model} (seed {args.seed})")
    return _cut(target, args.batch_size, "the factory's batch", f"{spec}: ")


def _cut(target: Target, size: int | None, source: str, prefix: str) -> Target:
    try:
        available = target.items
    except ValueError as error:
        raise UsageError(f"{prefix}{error_summary(error)}") from None
    if size is not None and size > available:
        raise UsageError(f"--batch-size {size} is larger than {source} ({available} items)")
    if size is not None and size < available:  # the first micro-batch of `size`: every per-item
        target.batch = split_batch(target.batch, size)[0]  # leaf cut alike (lists, arrays too)
    return target


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable `"module:factory"` names; the current directory is importable (`python -m`)."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        if ":" not in spec:
            raise ValueError(spec)
        factory = pkgutil.resolve_name(spec)
    except ValueError:
        raise UsageError(
            f"--model {spec!r} is not of the form module:factory (e.g. "
            "mypackage.debug:make_check, make_check() returning (model, batch, loss_fn))"
        ) from None
    except AttributeError as error:
        raise UsageError(f"--model {spec!r}: {error}") from None
    except (Exception, SystemExit) as error:  # an argparse at import, too
        raise UsageError(
            f"--model {spec!r}: cannot import module: {error_summary(error)}"
        ) from error
    if not callable(factory):
        raise UsageError(f"--model {spec!r}: a {type(factory).__name__}, not a callable factory")
    return factory
