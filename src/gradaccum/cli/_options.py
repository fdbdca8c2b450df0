"""The training options of `train` and `compare`, declared once, and the checks of a run.

Each option is one row of `OPTIONS`: the `TrainConfig` field it sets, its value type and its help.
That row adds it to argparse (with no default, so a left-out option stays None and is visible),
builds the `TrainConfig` (left-out options take the dataclass's defaults, the only place they
live) and tells `--resume` which options were given. A run is then opened once
(`experiments.runner.open_run`: data, model, optimizer, Accumulator), which checks everything
before anything is written; that same run is trained.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradaccum._install import install_hint
from gradaccum.batchnorm import BatchNormAccumulationWarning, batchnorm_modules
from gradaccum.cli import UsageError
from gradaccum.cli._args import (
    byte_count,
    int_or_auto,
    non_negative_int,
    one_line,
    path,
    positive_float,
    positive_int,
    seed,
    thread_count,
)
from gradaccum.experiments.base import LrScaling, TrainConfig
from gradaccum.experiments.runner import (
    ACCUM_DTYPES,
    CheckpointEvery,
    TrainingRun,
    open_run,
    resolve_micro_batch_size,
)
from gradaccum.experiments.tasks import TASKS


def token_budget(text: str) -> int:
    """Argparse type of `--max-tokens`: padded tokens (rows x longest row) per micro-batch."""
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive integer: give the padded tokens (rows x longest row) "
            "one micro-batch may hold, e.g. --max-tokens 2048"
        ) from None


def checkpoint_every(text: str) -> CheckpointEvery:
    """Argparse type of `--checkpoint-every`: `N`, `Nstep` or `Nmicro`."""
    try:
        return CheckpointEvery.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True)
class Option:
    """One training option: the `TrainConfig` field it sets, how to read it, what it does."""

    field: str
    type: Callable[[str], Any] | None
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    batch: bool = False  # how a batch is split: `train` only (compare's configs set these)

    @property
    def flag(self) -> str:
        """The option as written on the command line."""
        return "--" + self.field.replace("_", "-")


_BN = "BatchNorm under accumulation: micro (plain PyTorch: statistics per micro-batch), pooled "
_BN += "(running statistics once per step from all its items), frozen (eval-mode BatchNorm, "
_BN += "for fine-tuning; see --init-from) or group (GroupNorm model, exact); docs/batchnorm.md"
OPTIONS = (
    Option("task", None, "embedded task to train", TASKS),
    Option("batch_size", positive_int, "effective batch B: items per optimizer step", batch=True),
    Option(
        "micro_batch_size",
        int_or_auto,
        "items per forward/backward (default: B); 'auto': the fastest size that fits "
        "--memory-budget, planned and timed before training",
        metavar="{M,auto}",
        batch=True,
    ),
    Option(
        "max_tokens",
        token_budget,
        "instead of --micro-batch-size: pack each batch, sorted by length, into micro-batches "
        "of at most N padded tokens (charlm)",
        metavar="N",
        batch=True,
    ),
    Option("memory_budget", byte_count, "for --micro-batch-size auto, e.g. 2GiB", batch=True),
    Option("precision", None, "autocast of the forward passes", ("fp32", "bf16", "fp16")),
    Option("accum_dtype", None, "dtype of the gradient buffers", tuple(ACCUM_DTYPES)),
    Option("lr", positive_float, "learning rate at the task's reference batch"),
    Option(
        "lr_scaling", None, "lr * B/B_ref (linear) or its sqrt", tuple(s.value for s in LrScaling)
    ),
    Option("warmup", non_negative_int, "linear lr warmup over N optimizer steps", metavar="N"),
    Option("epochs", positive_int, "passes over the training set", metavar="N"),
    Option("steps", positive_int, "optimizer steps, instead of --epochs", metavar="N"),
    Option("seed", seed, "data and weight seed, 0 to 2**32 - 1"),
    Option("norm", None, "normalization layers of the shapes model", ("batch", "group")),
    Option("bn", None, _BN, ("micro", "pooled", "frozen", "group")),
    Option(
        "recalibrate",
        non_negative_int,
        "before each validation, set BatchNorm running statistics from the first N training "
        "batches (PreciseBN)",
        metavar="N",
    ),
    Option(
        "init_from",
        path,
        "start from the model weights of an earlier run's checkpoint.pt",
        metavar="CHECKPOINT",
    ),
)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def add_options(parser: argparse.ArgumentParser, *, batch: bool) -> None:
    """Add `OPTIONS` to `parser` (without the batch-split ones unless `batch`), all default None."""
    length = parser.add_mutually_exclusive_group()
    for option in OPTIONS:
        shown = getattr(_DEFAULTS[option.field], "value", _DEFAULTS[option.field])
        suffix = "" if shown in (None, "") or option.field == "task" else f" (default: {shown})"
        hidden = option.batch and not batch  # taken only to say what to use instead
        (length if option.field in ("epochs", "steps") else parser).add_argument(
            option.flag,
            type=option.type,
            choices=option.choices,
            metavar=option.metavar,
            help=argparse.SUPPRESS if hidden else option.help + suffix,
        )


def add_output_options(parser: argparse.ArgumentParser, command: str) -> None:
    """`--out`, `--threads`, `--checkpoint-every`, `--tensorboard` and `--resume`."""
    parser.add_argument(
        "--out",
        type=path,
        metavar="DIR",
        help=f"results folder, new or empty (default: runs/{command}-<task>-<time>)",
    )
    parser.add_argument(
        "--threads", type=thread_count, metavar="N", help="torch threads (default: 1)"
    )
    parser.add_argument(
        "--checkpoint-every",
        type=checkpoint_every,
        metavar="N[step|micro]",
        help="also write checkpoint.pt every N steps or N micro-batches (default: when stopped "
        "and at the end)",
    )
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        default=None,
        help="also write TensorBoard event files to <run>/tensorboard (extra [tensorboard])",
    )
    parser.add_argument(
        "--resume",
        type=path,
        metavar="DIR",
        help=f"continue the {command} in DIR with its settings"
        + (" (--epochs/--steps: extend it, even when finished)" if command == "train" else ""),
    )


def require_packages(args: argparse.Namespace, *, matplotlib: bool = False) -> None:
    """Refuse the command, before it writes anything, when an extra it needs is missing."""
    needed = [("matplotlib", "cli")] if matplotlib else []
    needed += [("tensorboard", "tensorboard")] if args.tensorboard else []
    for package, extra in needed:
        if importlib.util.find_spec(package) is None:
            raise UsageError(
                f"this needs {package}, which is not installed; " + install_hint(extra)
            )


def config_from(args: argparse.Namespace, **overrides: Any) -> TrainConfig:
    """The `TrainConfig` of the given options (and `overrides`); the rest keep their defaults."""
    values = {o.field: getattr(args, o.field, None) for o in OPTIONS}
    values = {name: value for name, value in values.items() if value is not None}
    values.update(overrides)
    if "lr_scaling" in values:
        values["lr_scaling"] = LrScaling(values["lr_scaling"])
    if values.get("init_from") is not None:  # absolute: a resumed run may start elsewhere
        values["init_from"] = str(Path(values["init_from"]).resolve())
    return TrainConfig(**values)


def given_flags(args: argparse.Namespace, allowed: tuple[str, ...] = ()) -> list[str]:
    """The training options given on the command line, except those in `allowed`."""
    given = [o.flag for o in OPTIONS if getattr(args, o.field, None) is not None]
    given += ["--out"] if args.out is not None else []
    return [flag for flag in given if flag not in allowed]


def open_checked(config: TrainConfig, out: Path | None, *, resume: bool = False) -> TrainingRun:
    """Open the run of `config` (the objects it trains with), or refuse it with a `UsageError`.

    Raises:
        UsageError: If the task or the library refuses an option, or a BatchNorm option would
            change nothing; nothing is written either way.
    """
    if config.micro_batch_size != "auto" and config.memory_budget is not None:
        raise UsageError("--memory-budget only applies with --micro-batch-size auto")
    if config.norm == "group" and config.bn not in ("micro", "group"):
        raise UsageError(
            f"--bn {config.bn} acts on BatchNorm layers, and --norm group builds none; drop one"
        )
    try:
        session = open_run(config, out=out, resume=resume)
    except (ValueError, TypeError, ImportError) as error:
        prefix = f"--resume {out}: " if resume else ""
        raise UsageError(prefix + one_line(error)) from None
    acts_on_batchnorm = config.bn in ("pooled", "frozen") or config.recalibrate
    if acts_on_batchnorm and not resume and not batchnorm_modules(session.model):
        option = (
            f"--recalibrate {config.recalibrate}" if config.recalibrate else f"--bn {config.bn}"
        )
        raise UsageError(
            f"{option} acts on BatchNorm layers, and the {config.task} model has none; drop "
            f"{option.split()[0]} (it would change nothing), or use --task shapes"
        )
    return session


def batchnorm_notes(sessions: list[TrainingRun]) -> None:
    """Print once on stderr why BatchNorm makes a run inexact (or `--bn frozen` untrained)."""
    notes: dict[str, None] = {}
    for session in sessions:
        plan, config = session.plan, session.plan.config
        if not batchnorm_modules(session.model):
            continue
        if config.bn == "frozen" and config.init_from is None:
            notes[
                "note: --bn frozen keeps the BatchNorm statistics the model starts with, and "
                "without --init-from they are untrained (mean 0, variance 1)"
            ] = None
        elif config.bn == "micro" and plan.micro_batch_size < plan.effective_batch:
            notes[
                f"note: BatchNorm normalizes each micro-batch of {plan.micro_batch_size} on its "
                f"own, so this is not exactly a batch of {plan.effective_batch}; see --bn pooled, "
                "frozen or group (docs/batchnorm.md)"
            ] = None
    for note in notes:
        print(note, file=sys.stderr)


@contextlib.contextmanager
def batchnorm_warnings_as_notes() -> Iterator[None]:
    """Inside the block only, drop the library's BatchNorm warning: `batchnorm_notes` said it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=BatchNormAccumulationWarning)
        yield


def plan_auto(config: TrainConfig) -> tuple[TrainConfig, str]:
    """Resolve `--micro-batch-size auto` once, before training: the config with the size, and why.

    The run records the size in its `config.json`, so a resumed run needs no plan.
    """
    try:
        choice = resolve_micro_batch_size(config)
    except (ValueError, TypeError) as error:
        raise UsageError(one_line(error)) from None
    return choice.fixed(config), (
        f"--micro-batch-size auto chose {choice.micro_batch_size} for --memory-budget "
        f"{config.memory_budget} (largest that fits: {choice.plan.micro_batch_size}; `gradaccum "
        f"plan` shows the table): {choice.reason}"
    )
