"""What `gradaccum check` checks: a model, a batch and a loss, from a task or from your code.

`--task T` takes the embedded task's model (in train mode) and the first B items of its training
set; `--model module:factory` imports `factory` (the current directory is importable) and calls
it for `(model, batch, loss_fn)`. Every problem with either is a `UsageError` with a one-line
message.

Example:
    >>> batch_items({"x": torch.zeros(5, 2), "y": torch.zeros(5)})
    5
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.batching import batch_size, map_tensors
from gradaccum.cli import UsageError
from gradaccum.cli._args import error_summary, first_line

__all__ = [
    "CheckTarget",
    "add_target_arguments",
    "batch_items",
    "build_target",
    "load_factory",
    "parse_factory_spec",
]


@dataclass
class CheckTarget:
    """What to check: a model, a whole batch and a loss, plus a label for the report.

    Attributes:
        model: The model, in the mode it will be checked in.
        batch: The whole batch (its leading dimension is B).
        loss_fn: `loss_fn(model, micro_batch) -> Tensor | LossSum`.
        label: How the header names the source, e.g. `"task shapes (norm batch, seed 0)"`.
        task: The embedded task's name, or None for `--model`.
    """

    model: torch.nn.Module
    batch: Any
    loss_fn: Callable[..., Any]
    label: str
    task: str | None = None


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the required, mutually exclusive `--task` and `--model` options to `parser`."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--task", metavar="T", help="an embedded task: digits, shapes or charlm")
    group.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="your own code: FACTORY() in MODULE returns (model, batch, loss_fn); the current "
        "directory is importable",
    )


def build_target(args: argparse.Namespace) -> CheckTarget:
    """The target that `--task` or `--model` names, cut to `--batch-size` items.

    Args:
        args: Parsed options: `task` or `model`, and `norm`, `seed`, `batch_size`.

    Raises:
        UsageError: For an unknown task or norm, `--norm` with `--model`, a bad factory or factory
            result, or a batch size larger than the data.
    """
    if args.task is not None:
        return _task_target(args.task, args.norm or "batch", args.seed, args.batch_size)
    if args.norm is not None:
        raise UsageError("--norm applies to --task only; build the model you want in the factory")
    return _factory_target(args.model, args.seed, args.batch_size)


def batch_items(batch: Any, prefix: str = "") -> int:
    """The number of items (leading dimension) of `batch`.

    Raises:
        UsageError: If its tensors disagree on the leading dimension, or it holds none; the
            message starts with `prefix`.
    """
    try:
        return batch_size(batch)
    except ValueError as error:
        raise UsageError(f"{prefix}{error_summary(error)}") from None


def parse_factory_spec(spec: str) -> tuple[str, str]:
    """Split `"module:factory"` into its module and (possibly dotted) attribute path.

    Args:
        spec: The `--model` value, e.g. `"mypkg.debug:make_check"`.

    Returns:
        `(module, attribute)`.

    Raises:
        UsageError: If `spec` is not of the form `module:factory`.

    Example:
        >>> parse_factory_spec("mypkg.debug:make_check")
        ('mypkg.debug', 'make_check')
    """
    module, sep, attribute = spec.partition(":")
    parts = [*module.split("."), *attribute.split(".")]
    if not sep or not all(part.isidentifier() for part in parts):
        raise UsageError(
            f"--model {spec!r} is not of the form module:factory (for example "
            "mypackage.debug:make_check, where make_check() returns (model, batch, loss_fn))"
        )
    return module, attribute


def load_factory(spec: str) -> Callable[[], Any]:
    """Import the factory named by `spec` (`"module:factory"`), with the cwd importable.

    Args:
        spec: The `--model` value.

    Returns:
        The callable.

    Raises:
        UsageError: If the spec is malformed, the module cannot be imported, or the attribute is
            missing or not callable.
    """
    module_name, attribute = parse_factory_spec(spec)
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)  # like `python -m`: the user's own modules are importable
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as error:
        raise UsageError(
            f"--model {spec!r}: cannot import module {module_name!r}: {error_summary(error)}"
        ) from error
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(
                f"--model {spec!r}: {module_name!r} has no attribute {attribute!r}"
            ) from None
    if not callable(obj):
        raise UsageError(
            f"--model {spec!r}: {attribute!r} is a {type(obj).__name__}, not a callable factory"
        )
    return obj


def _task_target(name: str, norm: str, seed: int, size: int | None) -> CheckTarget:
    from gradaccum.experiments.tasks import get_task

    try:
        task = get_task(name)
    except ValueError as error:
        raise UsageError(first_line(error).rstrip(".")) from None
    try:
        model = task.make_model(seed, norm)
    except ValueError as error:
        raise UsageError(first_line(error).rstrip(".")) from None
    try:
        data = task.make_data(seed)
    except ImportError as error:
        raise UsageError(first_line(error)) from None
    available = batch_items(data.train)
    size = task.default_batch_size if size is None else size
    if size > available:
        raise UsageError(
            f"--batch-size {size} is larger than the {name} training set ({available} items)"
        )
    model.train()
    batch = map_tensors(data.train, lambda tensor: tensor[:size])
    return CheckTarget(model, batch, task.loss_fn, f"task {name} (norm {norm}, seed {seed})", name)


def _factory_target(spec: str, seed: int, size: int | None) -> CheckTarget:
    factory = load_factory(spec)
    try:
        result = factory()
    except Exception as error:
        raise UsageError(f"--model {spec!r}: the factory raised {error_summary(error)}") from error
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise UsageError(
            f"--model {spec!r}: the factory must return (model, batch, loss_fn), got "
            f"{_describe(result)}"
        )
    model, batch, loss_fn = result
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"--model {spec!r}: the factory's first item must be a torch.nn.Module, got "
            f"{type(model).__name__}"
        )
    if not callable(loss_fn):
        raise UsageError(
            f"--model {spec!r}: the factory's third item must be loss_fn(model, micro_batch), "
            f"got {type(loss_fn).__name__}"
        )
    available = batch_items(batch, f"--model {spec!r}: ")
    if size is not None:
        if size > available:
            raise UsageError(
                f"--batch-size {size} is larger than the factory's batch ({available} items)"
            )
        batch = map_tensors(batch, lambda tensor: tensor[:size])
    return CheckTarget(model, batch, loss_fn, f"model {spec} (seed {seed})")


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"
