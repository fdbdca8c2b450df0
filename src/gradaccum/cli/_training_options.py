"""Options and checks shared by `gradaccum train` and `gradaccum compare`.

Both commands take the same training options, check every one of them (and resolve every
configuration with `runner.resolve`) before anything is written, and write their results into a
hidden staging folder that is renamed to `--out` only when the command succeeds. So a bad option,
an error during training or an interrupt leaves no half-written results behind.

Example:
    >>> parse_config_label("8x2")
    (8, 2)
    >>> parse_bytes("1.5KiB")
    1536
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from gradaccum import batching
from gradaccum.accumulator import Accumulator
from gradaccum.cli import UsageError
from gradaccum.experiments.base import LrScaling, TrainConfig
from gradaccum.experiments.runner import ACCUM_DTYPES, resolve
from gradaccum.experiments.tasks import TASKS, get_task

__all__ = [
    "CheckedRun",
    "add_training_options",
    "build_config",
    "check_out_dir",
    "default_out_dir",
    "describe_run",
    "parse_bytes",
    "parse_config_label",
    "positive_int",
    "staged_out_dir",
    "terminate_as_interrupt",
    "train_items",
    "validate_config",
]

_CONFIG_PATTERN = re.compile(r"(\d+)x(\d+)")
_BYTES_PATTERN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)", re.IGNORECASE)
_UNIT_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def positive_int(text: str) -> int:
    """Argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _micro_batch_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a positive integer nor 'auto'"
        ) from None


def parse_bytes(text: str) -> int:
    """Parse a byte count such as `"2GiB"`, `"512MB"`, `"1.5KiB"` or `"1000000"`.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) of 1000.

    Args:
        text: The count, with an optional unit (case-insensitive).

    Returns:
        The number of bytes, rounded down.

    Raises:
        argparse.ArgumentTypeError: If `text` is not a positive byte count.
    """
    match = _BYTES_PATTERN.fullmatch(text.strip())
    if match is None or (match.group(3) and not match.group(2)):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a byte count; write e.g. 2GiB, 512MiB, 500MB or 1000000"
        )
    number, prefix, binary, _ = match.groups()
    base = 1024 if binary else 1000
    value = int(float(number) * base ** _UNIT_POWERS[prefix.lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least one byte")
    return value


def _memory_budget(text: str) -> str:
    parse_bytes(text)
    return text.strip()


def parse_config_label(text: str) -> tuple[int, int]:
    """Read a compare config `"MxK"`: micro-batch size M and K accumulation steps.

    Args:
        text: The config as written on the command line, e.g. `"8x2"`.

    Returns:
        `(micro_batch_size, accumulation_steps)`; the effective batch is their product.

    Raises:
        UsageError: If `text` is not two positive integers joined by `x`.
    """
    match = _CONFIG_PATTERN.fullmatch(text)
    if match is None:
        raise UsageError(
            f"malformed config {text!r}: write MICROxSTEPS, e.g. 8x2 (micro-batch 8, "
            "2 accumulation steps, effective batch 16)"
        )
    micro, steps = int(match.group(1)), int(match.group(2))
    if micro < 1 or steps < 1:
        raise UsageError(
            f"malformed config {text!r}: micro-batch size and accumulation steps must be >= 1"
        )
    return micro, steps


def add_training_options(parser: argparse.ArgumentParser, *, batch_options: bool) -> None:
    """Add the options `train` and `compare` share to `parser`.

    Args:
        parser: The command's parser.
        batch_options: Add `--batch-size`, `--micro-batch-size` and `--memory-budget` with help
            text (train); when False they are hidden, so `compare` can reject them by name.
    """
    parser.add_argument(
        "--task", required=True, choices=TASKS, help="embedded task to train (required)"
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
        type=_micro_batch_size,
        metavar="{M,auto}",
        help="items per forward/backward; B is split into ceil(B / M) micro-batches "
        "(default: B, no accumulation; 'auto' is not available yet)"
        if batch_options
        else hidden,
    )
    parser.add_argument(
        "--memory-budget",
        type=_memory_budget,
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
        type=_positive_float,
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
        type=_non_negative_int,
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
        "--threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="torch intra-op threads (default: 1; the models are tiny, and more threads on a "
        "shared CPU mostly add synchronization)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="folder for the results; must not exist yet or be empty "
        "(default: runs/<command>-<task>-<timestamp>)",
    )


def build_config(
    args: argparse.Namespace, *, batch_size: int | None, micro_batch_size: int | str | None
) -> TrainConfig:
    """The `TrainConfig` that `args` describe, with the given batch sizes."""
    return TrainConfig(
        task=args.task,
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
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


def validate_config(config: TrainConfig, n_train: int) -> CheckedRun:
    """Check `config` fully, without training or writing anything.

    Resolves it with `runner.resolve`, then builds its model, an AdamW optimizer and the
    `Accumulator`, so that an option the task or the library refuses (such as `--norm group` on
    a task without normalization layers) is reported now rather than after the out folder exists.

    Args:
        config: The configuration.
        n_train: Size of the task's training set (see `train_items`).

    Returns:
        The resolved settings.

    Raises:
        UsageError: If anything is refused; the message is the library's reason.
    """
    if config.micro_batch_size != "auto" and config.memory_budget is not None:
        raise UsageError("--memory-budget only applies with --micro-batch-size auto")
    try:
        run = resolve(config, n_train)
        model = run.task.make_model(config.seed, config.norm)
        optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr)
        Accumulator(
            model,
            optimizer,
            micro_batch_size=run.micro_batch_size,
            precision=config.precision,
            accum_dtype=ACCUM_DTYPES.get(config.accum_dtype or ""),
        )
    except (ValueError, TypeError) as error:
        raise UsageError(_one_line(error)) from None
    steps = -(-run.effective_batch // run.micro_batch_size)
    return CheckedRun(
        config=config,
        label=f"{run.micro_batch_size}x{steps}",
        effective_batch=run.effective_batch,
        micro_batch_size=run.micro_batch_size,
        lr=run.lr,
        total_steps=run.total_steps,
        steps_per_epoch=run.steps_per_epoch,
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
    return (
        f"{checked.label}: batch {checked.effective_batch} = {accumulation} micro-batch"
        f"{'es' if accumulation > 1 else ''} of up to {checked.micro_batch_size}, "
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
        raise UsageError(_one_line(error)) from None


def default_out_dir(command: str, task: str) -> Path:
    """`runs/<command>-<task>-<YYYYmmdd-HHMMSS>`, with a numeric suffix if that exists."""
    stem = Path("runs") / f"{command}-{task}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, suffix = stem, 1
    while os.path.lexists(candidate):
        suffix += 1
        candidate = stem.with_name(f"{stem.name}-{suffix}")
    return candidate


def check_out_dir(path: Path) -> None:
    """Check that results can be written to `path`, without creating anything.

    `path` must be an empty folder, or not exist and have a writable folder as its nearest
    existing ancestor (missing folders in between are created later).

    Raises:
        UsageError: If `path` exists and is not an empty folder, or cannot be created or written.
    """
    if os.path.lexists(path):
        if not path.is_dir():
            raise UsageError(f"--out {path}: exists and is not a directory")
        if any(path.iterdir()):
            raise UsageError(f"--out {path}: directory is not empty; choose a new folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"--out {path}: directory is not writable")
        parent = path.resolve().parent
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(
                f"--out {path}: its parent {parent} is not writable, so results cannot be "
                "moved into place"
            )
        return
    ancestor = path.absolute().parent
    while not os.path.lexists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"--out {path}: cannot create it, {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: cannot create it, {ancestor} is not writable")


@contextlib.contextmanager
def staged_out_dir(path: Path) -> Iterator[Path]:
    """Yield a hidden staging folder next to `path`; on success rename it to `path`.

    On any exception (including KeyboardInterrupt) the staging folder and any parent folders
    created for it are removed, and the exception propagates: nothing half-written stays.

    Args:
        path: The final folder, already checked with `check_out_dir`.
    """
    parent = path.absolute().parent
    created: list[Path] = []
    probe = parent
    while not probe.exists():
        created.append(probe)
        probe = probe.parent
    staging: Path | None = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=parent))
        staging.chmod(0o777 & ~_umask())
        yield staging
        os.replace(staging, path)  # also replaces an empty `path` folder
        staging = None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
            for folder in created:  # innermost first
                with contextlib.suppress(OSError):
                    folder.rmdir()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt, so cleanup code runs.

    Python's default SIGTERM ends the process at once, which would leave a staging folder
    behind. Only the main thread can install handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
