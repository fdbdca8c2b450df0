"""`gradaccum check`: is accumulating micro-batches exact for this model, batch and loss?

It runs `gradaccum.check_equivalence` (one plain full-batch backward against one accumulated
backward, on copies of the model, in float64 by default) and prints the per-parameter table. When
the gradients differ it says why: the modules that mix items of a micro-batch (BatchNorm in train
mode, dropout), or, when there are none, a loss that is not a sum over items.

The model, batch and loss come from an embedded task (`--task digits|shapes|charlm`, the first
B training items, model in train mode) or from your own code (`--model module:factory`, where
`factory()` returns `(model, batch, loss_fn)`; the current directory is importable).

Exit codes: 0 the accumulated gradient equals the full-batch gradient to rounding, 1 it does
not, 2 bad usage or input (one line on stderr).

Example:
    $ gradaccum check --task shapes --norm group --batch-size 8
    $ gradaccum check --model mypackage.debug:make_check --micro-batch-size 3
"""

from __future__ import annotations

import argparse
import math

import torch

from gradaccum.cli import UsageError
from gradaccum.cli._args import error_summary, positive_int
from gradaccum.cli._check_targets import (
    CheckTarget,
    add_target_arguments,
    batch_items,
    build_target,
    load_factory,
    parse_factory_spec,
)
from gradaccum.verify import EquivalenceReport, NonAdditiveModule, check_equivalence

# CheckTarget, add_target_arguments, load_factory, parse_factory_spec (from _check_targets) and
# positive_int (from _args) are re-exported: they were defined here first.
__all__ = [
    "CheckTarget",
    "add_parser",
    "add_target_arguments",
    "default_micro_batch_size",
    "load_factory",
    "parse_factory_spec",
    "positive_int",
    "run",
]

_DTYPES = {"float64": torch.float64, "float32": torch.float32}
_NORMS = ("batch", "group")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `check` command.

    Args:
        subparsers: The top-level parser's sub-parser collection.

    Returns:
        The `check` sub-parser.
    """
    parser = subparsers.add_parser(
        "check",
        help="check that accumulating micro-batches gives exactly the full-batch gradient",
        description=(
            "Compare the accumulated gradient with the full-batch gradient (check_equivalence) "
            "for an embedded task or for your own model, print a per-parameter table and name "
            "what makes accumulation inexact (BatchNorm in train mode, dropout, a loss that is "
            "not a sum over items). Exit codes: 0 exact to rounding, 1 not exact, 2 bad usage "
            "or input."
        ),
    )
    add_target_arguments(parser)
    parser.add_argument(
        "--micro-batch-size",
        type=positive_int,
        default=None,
        metavar="M",
        help="items per micro-batch (default: about B/3, chosen so the last micro-batch is "
        "smaller than the others; the value used is printed)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        metavar="B",
        help="items in the whole batch: the first B training items of --task (default: the "
        "task's batch size), or the first B items of the factory's batch (default: all)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the task's data and weights, and of the global RNG before the factory "
        "is called (default: 0)",
    )
    parser.add_argument(
        "--norm",
        choices=_NORMS,
        default=None,
        help="--task only: normalization layers of the task's model (default: batch; "
        "'group' is offered by the shapes task)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(_DTYPES),
        default="float64",
        help="compute dtype of both runs (default: float64, where rounding cannot hide a real "
        "difference; float32 uses a looser tolerance)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the check and print its report.

    Args:
        args: Parsed options: `task` or `model`, `micro_batch_size`, `batch_size`, `seed`,
            `norm`, `dtype`.

    Returns:
        0 if the accumulated gradient matches the full-batch gradient to rounding, else 1.

    Raises:
        UsageError: For an unknown task, a bad factory or factory result, or a bad size.
    """
    torch.manual_seed(args.seed)
    target = build_target(args)
    size = batch_items(target.batch)
    micro = args.micro_batch_size
    chosen = micro is None
    if chosen:
        micro = default_micro_batch_size(size)
    elif micro > size:
        raise UsageError(
            f"--micro-batch-size {micro} is larger than the batch ({size} items); pass at most "
            f"{size}, and less than {size} to check an actual split"
        )
    dtype = _DTYPES[args.dtype]

    torch.manual_seed(args.seed)
    try:
        report = check_equivalence(target.model, target.batch, target.loss_fn, micro, dtype=dtype)
    except Exception as error:  # the user's model or loss failed on this batch: bad input
        raise UsageError(f"the check could not run: {error_summary(error)}") from error

    _print_header(target, size, micro, chosen, args.dtype)
    print(report)
    print()
    _print_diagnosis(report, target, size)
    return 0 if report.ok else 1


def default_micro_batch_size(size: int) -> int:
    """A micro-batch size that splits `size` items raggedly: about a third, last one smaller.

    A ragged split is the harder case (micro-batches of different sizes must be weighted by
    their item counts). The last micro-batch keeps at least 2 items where possible, since
    BatchNorm1d in train mode cannot run on a single item.

    Args:
        size: Items in the whole batch.

    Returns:
        The micro-batch size, between 1 and `size`.

    Example:
        >>> [default_micro_batch_size(b) for b in (32, 16, 10, 9, 4, 1)]
        [11, 6, 4, 5, 3, 1]
    """
    if size <= 2:
        return 1
    start = math.ceil(size / 3)
    for micro in (*range(start, 1, -1), *range(start + 1, size)):
        if size % micro >= 2:
            return micro
    for micro in (*range(start, 1, -1), *range(start + 1, size)):
        if size % micro != 0:
            return micro
    return max(1, size // 2)


def _print_header(target: CheckTarget, size: int, micro: int, chosen: bool, dtype: str) -> None:
    count = math.ceil(size / micro)
    sizes = [micro] * (size // micro) + ([size % micro] if size % micro else [])
    split = " + ".join(map(str, sizes)) if len(sizes) <= 8 else f"{count} micro-batches"
    how = "default, a ragged split" if chosen else "--micro-batch-size"
    mode = "train" if target.model.training else "eval"
    print(f"gradaccum check: {target.label}, model in {mode} mode")
    print(f"  batch: {size} items; micro-batch size {micro} ({how}): {split}")
    print(f"  one full-batch backward vs {count} accumulated backwards, in {dtype}")
    print()


def _print_diagnosis(report: EquivalenceReport, target: CheckTarget, size: int) -> None:
    if report.micro_batch_size >= size:
        print(
            "note: the micro-batch is the whole batch, so the check compares a batch with "
            "itself; pass a smaller --micro-batch-size."
        )
    if report.ok:
        judged = report.internal_dtype or report.dtype  # the precision the tolerance is set by
        print(
            f"result: EXACT. The accumulated gradient equals the full-batch gradient to "
            f"{_dtype_name(judged)} rounding (max rel diff {report.max_rel_diff:.1e} <= "
            f"{report.tolerance:.0e})."
        )
    else:
        print(
            f"result: NOT EXACT. The accumulated gradient differs from the full-batch gradient "
            f"(max rel diff {report.max_rel_diff:.1e} > {report.tolerance:.0e})."
        )
    if report.non_additive:
        if report.ok:
            print("note: these modules can make accumulation inexact, although this check matched:")
        else:
            print(
                "cause: these modules behave differently on micro-batches than on the whole batch:"
            )
        for kind, modules in _by_kind(report.non_additive).items():
            names = ", ".join(m.name for m in modules[:4])
            more = f" and {len(modules) - 4} more" if len(modules) > 4 else ""
            print(f"  {kind} at {names}{more}: {modules[0].reason}")
            print(f"    -> {_advice(modules[0], target)}")
    elif not report.ok:
        print(
            "cause: no module behaves differently on micro-batches, so the loss is not additive "
            "over items. It probably normalizes by something of the micro-batch (a token or pixel "
            "count, a max, a mean of per-micro-batch means)."
        )
        print(
            "    -> return gradaccum.LossSum(sum of per-item losses, number of items counted); "
            "a plain scalar is read as a mean weighted by the micro-batch's leading dimension."
        )


def _by_kind(modules: tuple[NonAdditiveModule, ...]) -> dict[str, list[NonAdditiveModule]]:
    grouped: dict[str, list[NonAdditiveModule]] = {}
    for module in modules:
        grouped.setdefault(module.kind, []).append(module)
    return grouped


def _advice(module: NonAdditiveModule, target: CheckTarget) -> str:
    if "BatchNorm" in module.kind:
        if target.task == "shapes":
            return (
                "rerun with --norm group (GroupNorm normalizes each image alone), or train with "
                "--bn pooled (running statistics from the whole window) or --bn frozen; see "
                "docs/batchnorm.md"
            )
        return (
            "convert it with gradaccum.batchnorm.convert_to_groupnorm(model) (exact), or train "
            "with Accumulator(..., batchnorm='pooled') (running statistics from the whole "
            "window) or 'frozen' (eval-mode statistics); see docs/batchnorm.md"
        )
    return (
        "check with dropout off (eval mode or p=0); in training, different masks are "
        "expected noise, not a bug"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
