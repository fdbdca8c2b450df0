"""Options and checks shared by `gradaccum train` and `gradaccum compare`.

Both commands take the same training options and check every one of them (and resolve every
configuration with `runner.resolve`) before anything is written (see `gradaccum.cli._outdir` for
what each command leaves behind when it stops early).

`train` adds them with `resumable=True`: `--task` is then optional (`--resume DIR` reads it from
the run's folder) and options left out stay None, so a resumed run can tell which options were
given; `fill_defaults` puts the defaults in afterwards.

`--max-tokens N` (train; `B@Nt` configs in compare, see `gradaccum.cli._configs`) replaces the
micro-batch size with a token budget: each effective batch is packed by
`gradaccum.packing.pack_by_tokens` into micro-batches of at most N padded tokens.

Example:
    >>> parse_config_label("8x2")
    (8, 2)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from gradaccum import batching
from gradaccum.batchnorm import batchnorm_modules
from gradaccum.cli import UsageError
from gradaccum.cli._args import (
    add_threads_option,
    byte_count,
    int_or_auto,
    non_negative_int,
    one_line,
    positive_float,
    positive_int,
)
from gradaccum.cli._configs import parse_config_label, token_budget
from gradaccum.experiments._schedule import check_token_budget
from gradaccum.experiments.base import LrScaling, TrainConfig
from gradaccum.experiments.runner import (
    ACCUM_DTYPES,
    build_accumulator,
    make_model,
    resolve,
)
from gradaccum.experiments.tasks import TASKS, get_task

__all__ = [
    "CONFIG_OPTIONS",
    "CheckedRun",
    "add_training_options",
    "build_config",
    "describe_run",
    "fill_defaults",
    "parse_config_label",
    "train_items",
    "validate_config",
]

# Options with a default value (filled in by `fill_defaults` when they are left out).
_DEFAULTS = {
    "precision": "fp32",
    "lr_scaling": LrScaling.NONE.value,
    "warmup": 0,
    "seed": 0,
    "norm": "batch",
    "bn": "micro",
    "recalibrate": 0,
    "threads": 1,
}
# The options that make up a `TrainConfig`, as (argparse dest, flag).
CONFIG_OPTIONS = tuple(
    (name, "--" + name.replace("_", "-"))
    for name in (
        "task",
        "batch_size",
        "micro_batch_size",
        "max_tokens",
        "memory_budget",
        "precision",
        "accum_dtype",
        "lr",
        "lr_scaling",
        "warmup",
        "epochs",
        "steps",
        "seed",
        "norm",
        "bn",
        "init_from",
        "recalibrate",
    )
)

_BN_CHOICES = ("micro", "pooled", "frozen", "group")


def add_training_options(
    parser: argparse.ArgumentParser, *, batch_options: bool, resumable: bool = False
) -> None:
    """Add the options `train` and `compare` share to `parser`.

    Args:
        parser: The command's parser.
        batch_options: Add `--batch-size`, `--micro-batch-size`, `--max-tokens` and
            `--memory-budget` with help text (train); when False they are hidden, so `compare`
            can reject them by name.
        resumable: `--task` is optional and left-out options stay None (see `fill_defaults`).
    """
    parser.add_argument(
        "--task",
        required=not resumable,
        choices=TASKS,
        help="embedded task to train (required, unless --resume)"
        if resumable
        else "embedded task to train (required)",
    )
    hidden = argparse.SUPPRESS
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        help="effective batch size B: items per optimizer step (default: the task's)"
        if batch_options
        else hidden,
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int_or_auto,
        metavar="{M,auto}",
        help="items per forward/backward; B is split into ceil(B / M) micro-batches "
        "(default: B, no accumulation); 'auto': the largest that fits --memory-budget, "
        "measured before training (see gradaccum plan)"
        if batch_options
        else hidden,
    )
    parser.add_argument(
        "--max-tokens",
        type=token_budget,
        metavar="N",
        help="instead of --micro-batch-size: pack each batch of B sequences by a token budget, "
        "lines sorted by length so that rows x longest row <= N per micro-batch (charlm only)"
        if batch_options
        else hidden,
    )
    parser.add_argument(
        "--memory-budget",
        type=byte_count,
        metavar="BYTES",
        help="memory budget for --micro-batch-size auto, e.g. 2GiB" if batch_options else hidden,
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="autocast mode of the forward passes (default: fp32)",
    )
    parser.add_argument(
        "--accum-dtype",
        choices=tuple(ACCUM_DTYPES),
        help="dtype of the gradient accumulation buffers (default: the parameters' dtype)",
    )
    parser.add_argument(
        "--lr",
        type=positive_float,
        help="learning rate at the task's reference batch size (default: the task's)",
    )
    parser.add_argument(
        "--lr-scaling",
        choices=[choice.value for choice in LrScaling],
        default=LrScaling.NONE.value,
        help="scale the lr with the effective batch B relative to the task's reference batch: "
        "none, linear (lr * B / B_ref) or sqrt (default: none)",
    )
    parser.add_argument(
        "--warmup",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="linear lr warmup over N optimizer steps (default: 0)",
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--epochs",
        type=positive_int,
        metavar="N",
        help="passes over the training set (default: the task's)",
    )
    length.add_argument(
        "--steps", type=positive_int, metavar="N", help="optimizer steps, instead of --epochs"
    )
    parser.add_argument("--seed", type=int, default=0, help="data and weight seed (default: 0)")
    parser.add_argument(
        "--norm",
        choices=("batch", "group"),
        default="batch",
        help="normalization layers of the shapes U-Net: BatchNorm or GroupNorm (default: batch)",
    )
    parser.add_argument(
        "--bn",
        choices=_BN_CHOICES,
        default=None if resumable else "micro",
        help="BatchNorm under accumulation: micro (plain PyTorch: statistics per micro-batch), "
        "pooled (running statistics once per step from all its items), frozen (eval-mode "
        "BatchNorm, for fine-tuning; see --init-from) or group (GroupNorm model, exact) "
        "(default: micro; see docs/batchnorm.md)",
    )
    parser.add_argument(
        "--recalibrate",
        type=non_negative_int,
        default=None if resumable else 0,
        metavar="N",
        help="before each validation, set the BatchNorm running statistics to the exact "
        "statistics of the first N training batches (PreciseBN; 0: off, the default)",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        metavar="CHECKPOINT",
        help="start from the model weights of a checkpoint.pt of an earlier run (only the "
        "weights: optimizer and schedule start fresh)",
    )
    add_threads_option(parser)
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="folder for the results; must not exist yet or be empty "
        "(default: runs/<command>-<task>-<timestamp>)",
    )
    if resumable:
        parser.set_defaults(**dict.fromkeys(_DEFAULTS))


def fill_defaults(args: argparse.Namespace) -> None:
    """Give the options of `add_training_options(resumable=True)` left out their defaults."""
    for name, value in _DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def build_config(
    args: argparse.Namespace,
    *,
    batch_size: int | None,
    micro_batch_size: int | str | None,
    max_tokens: int | None = None,
) -> TrainConfig:
    """The `TrainConfig` that `args` describe, with the given batch sizes (or token budget)."""
    return TrainConfig(
        task=args.task,
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        memory_budget=args.memory_budget,
        precision=args.precision,
        accum_dtype=args.accum_dtype,
        lr=args.lr,
        lr_scaling=LrScaling(args.lr_scaling),
        warmup=args.warmup,
        epochs=args.epochs,
        steps=args.steps,
        seed=args.seed,
        norm=args.norm,
        bn=args.bn,
        recalibrate=args.recalibrate,
        # Absolute: a resumed run, or a report, may be read from another directory.
        init_from=None if args.init_from is None else str(args.init_from.resolve()),
    )


@dataclass(frozen=True)
class CheckedRun:
    """A configuration that passed every check, with its resolved settings."""

    config: TrainConfig
    label: str
    effective_batch: int
    micro_batch_size: int
    lr: float
    total_steps: int
    steps_per_epoch: int
    batchnorm_layers: int = 0
    max_tokens: int | None = None


def validate_config(config: TrainConfig, n_train: int, *, resuming: bool = False) -> CheckedRun:
    """Check `config` fully, without training or writing anything.

    Resolves it with `runner.resolve`, then builds its model, an AdamW optimizer and the
    `Accumulator` as the runner does (`runner.build_accumulator`), so that an option the task or
    the library refuses (such as `--norm group` on a task without normalization layers) is
    reported now rather than after the out folder exists.

    Args:
        config: The configuration.
        n_train: Size of the task's training set (see `train_items`).
        resuming: The run's own checkpoint will replace the `--init-from` weights, so that
            file is not read (it may be gone).

    Returns:
        The resolved settings.

    Raises:
        UsageError: If anything is refused; the message is the library's reason.
    """
    if config.micro_batch_size != "auto" and config.memory_budget is not None:
        raise UsageError("--memory-budget only applies with --micro-batch-size auto")
    if config.norm == "group" and config.bn not in ("micro", "group"):
        raise UsageError(
            f"--bn {config.bn} acts on BatchNorm layers, and --norm group builds none; drop one"
        )
    try:
        run = resolve(config, n_train)
        model = make_model(config, initial_weights=not resuming)
        optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr)
        build_accumulator(run, model, optimizer)
        if config.max_tokens is not None:
            train = get_task(config.task).make_data(config.seed).train
            check_token_budget(train, config.max_tokens)
    except (ValueError, TypeError) as error:
        raise UsageError(one_line(error)) from None
    batchnorm_layers = len(batchnorm_modules(model))
    if not batchnorm_layers and not resuming:
        _refuse_batchnorm_options(config)
    return CheckedRun(
        config=config,
        label=run.label,
        effective_batch=run.effective_batch,
        micro_batch_size=run.micro_batch_size,
        lr=run.lr,
        total_steps=run.total_steps,
        steps_per_epoch=run.steps_per_epoch,
        batchnorm_layers=batchnorm_layers,
        max_tokens=run.max_tokens,
    )


def _refuse_batchnorm_options(config: TrainConfig) -> None:
    """Refuse the BatchNorm options on a model without BatchNorm, where they would do nothing."""
    if config.bn in ("pooled", "frozen"):
        raise UsageError(
            f"--bn {config.bn} acts on BatchNorm layers, and the {config.task} model has none; "
            "drop --bn (it would change nothing), or use --task shapes"
        )
    if config.recalibrate:
        raise UsageError(
            f"--recalibrate {config.recalibrate} recomputes BatchNorm statistics, and the "
            f"{config.task} model has none; drop --recalibrate (it would change nothing), or use "
            "--task shapes"
        )


def describe_run(checked: CheckedRun) -> str:
    """One line: batch split, lr, length, precision and seed of a checked configuration."""
    config = checked.config
    if config.steps is not None:
        length = f"{checked.total_steps} steps"
    else:
        epochs = checked.total_steps // checked.steps_per_epoch
        length = f"{checked.total_steps} steps ({epochs} epochs of {checked.steps_per_epoch})"
    accumulation = -(-checked.effective_batch // checked.micro_batch_size)
    split = (
        f"{accumulation} micro-batch{'es' if accumulation > 1 else ''} of up to "
        f"{checked.micro_batch_size}"
        if checked.max_tokens is None
        else f"micro-batches packed by length, each at most {checked.max_tokens} padded tokens "
        "(rows x longest row)"
    )
    return (
        f"{checked.label}: batch {checked.effective_batch} = {split}, "
        f"lr {checked.lr:.3g}, {length}, {config.precision}, seed {config.seed}"
    )


def train_items(task_name: str, seed: int) -> int:
    """Number of training items of a task (builds its data once).

    Raises:
        UsageError: If the task cannot build its data (e.g. scikit-learn is missing).
    """
    try:
        return batching.batch_size(get_task(task_name).make_data(seed).train)
    except (ImportError, ValueError) as error:
        raise UsageError(one_line(error)) from None
