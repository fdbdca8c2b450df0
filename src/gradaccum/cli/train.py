"""`gradaccum train`: train one configuration of an embedded task; stop, resume and extend it.

The run writes into `--out`: `config.json` (its settings, for `--resume`), `metrics.jsonl` (one
line per optimizer step), `validation.jsonl`, `summary.json` and `checkpoint.pt` (model,
optimizer, scheduler and Accumulator states and the run's position; written every
`--checkpoint-every`, when stopped, and at the end). The first SIGTERM or Ctrl-C finishes the
current micro-batch, writes a checkpoint and exits 0 telling how to resume; a second one exits at
once (130). `--resume DIR` continues bitwise; with `--epochs N` or `--steps N` it extends the run,
finished or not, with its optimizer and schedule intact.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

from gradaccum.cli import UsageError
from gradaccum.cli._args import torch_threads
from gradaccum.cli._options import (
    add_options,
    add_output_options,
    batchnorm_notes,
    batchnorm_warnings_as_notes,
    config_from,
    given_flags,
    open_checked,
    plan_auto,
    require_packages,
)
from gradaccum.experiments import folders
from gradaccum.experiments.base import RunSummary
from gradaccum.experiments.runner import CHECKPOINT_NAME, CheckpointEvery, RunStopped, TrainingRun
from gradaccum.experiments.settings import RunSettings

__all__ = ["CONFIG_NAME", "add_parser", "run", "train_session"]

CONFIG_NAME = "config.json"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `train` command."""
    parser = subparsers.add_parser(
        "train",
        help="train one configuration of an embedded task (digits, shapes, charlm)",
        description="Train an embedded task with exact gradient accumulation: each optimizer step "
        "sees --batch-size items in micro-batches of --micro-batch-size (or packed by "
        "--max-tokens). Writes config.json, metrics.jsonl, validation.jsonl, summary.json and "
        "checkpoint.pt to --out. SIGTERM or Ctrl-C stops with a checkpoint (exit 0); --resume "
        "DIR continues exactly. Exit 2 on bad usage or input, with nothing written.",
    )
    add_options(parser, batch=True)
    add_output_options(parser, "train")
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the options, open the run (new or resumed), train it and print a summary.

    Returns:
        0 when the run finished, and when a signal stopped it after writing a checkpoint.

    Raises:
        UsageError: On bad options or an unusable folder, before anything is written.
    """
    with torch_threads(), batchnorm_warnings_as_notes():
        require_packages(args)
        if args.resume is not None:
            session, out, every = _open_resumed(args)
        else:
            session, out, every = _open_new(args)
        batchnorm_notes([session])
        with folders.stop_on_signals() as request, folders.run_folder(out, keep_if=CHECKPOINT_NAME):
            settings = RunSettings(session.plan.config, every, args.threads, bool(args.tensorboard))
            settings.save(out / CONFIG_NAME)
            label = f"{session.plan.config.task} {session.plan.label}"
            summary = train_session(session, label, "train", out, request, every, args.tensorboard)
    if summary is None:
        return 0
    _print_summary(summary, out)
    return 0


def _open_new(args: argparse.Namespace) -> tuple[TrainingRun, Path, CheckpointEvery | None]:
    if args.task is None:
        raise UsageError("--task is required (or --resume DIR to continue a run)")
    config = config_from(args)
    folders.check_not_resumable(args.out, CONFIG_NAME, "train", "a run")
    out = args.out or folders.default_out_dir("train", args.task)
    folders.check_out_dir(out)
    if config.micro_batch_size == "auto" and config.max_tokens is None:  # else refused below
        config, message = plan_auto(config)
        print(f"gradaccum train: {message}")
    args.threads = args.threads or 1
    torch.set_num_threads(args.threads)  # `run` restores them
    session = open_checked(config, out)
    print(f"gradaccum train: {config.task} {session.plan.describe()}")
    print(f"  writing to {out}")
    return session, out, args.checkpoint_every


def _open_resumed(args: argparse.Namespace) -> tuple[TrainingRun, Path, CheckpointEvery | None]:
    folder: Path = args.resume
    given = given_flags(args, allowed=("--epochs", "--steps"))
    if given:
        raise UsageError(
            f"{', '.join(given)} cannot be combined with --resume: a resumed run keeps the "
            f"settings in {folder / CONFIG_NAME}; drop {'them' if len(given) > 1 else 'it'} "
            "(only --epochs or --steps may extend it; to change settings, start a new run)"
        )
    folders.check_resume_dir(folder)
    if not (folder / CONFIG_NAME).is_file():
        raise UsageError(
            f"--resume {folder}: holds no {CONFIG_NAME}, so it is not a run folder of `gradaccum "
            "train`"
        )
    try:
        saved = RunSettings.load(folder / CONFIG_NAME)
    except ValueError as error:
        raise UsageError(f"--resume {folder}: {error}") from None
    config = saved.config
    if args.epochs is not None or args.steps is not None:
        config = config.replace(epochs=args.epochs, steps=args.steps)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--resume {folder}: directory is not writable")
    args.threads = args.threads or saved.threads
    args.tensorboard = args.tensorboard or saved.tensorboard  # as the run was started
    require_packages(args)
    torch.set_num_threads(args.threads)  # `run` restores them
    session = open_checked(config, folder, resume=True)
    here = session.position
    print(f"gradaccum train: {config.task} {session.plan.describe()}")
    print(f"  resuming at step {here.step} (+{here.micro} micro-batches) from {folder}")
    return session, folder, args.checkpoint_every or saved.checkpoint_every


def train_session(
    session: TrainingRun,
    label: str,
    command: str,
    out: Path,
    request: folders.StopRequest,
    every: CheckpointEvery | None,
    tensorboard: bool | None,
) -> RunSummary | None:
    """Train `session` to its end with a progress bar; None if `request` stopped it.

    A stop (the first SIGTERM or SIGINT of `stop_on_signals`) comes at the next micro-batch, after
    a checkpoint, with one line on stderr ending `resume with: gradaccum <command> --resume out`.
    """
    from gradaccum.experiments.progress import progress

    with progress(label, session.plan.total_steps) as on_step:
        try:
            return session.run(
                on_step=on_step,
                checkpoint_every=every,
                stop=lambda _: bool(request),
                tensorboard=bool(tensorboard),
            )
        except RunStopped as stopped:
            here, which = stopped.position, f"config {label} " if command == "compare" else ""
            print(
                f"gradaccum {command}: {request.signal or 'stop'} received; stopped {which}after "
                f"step {here.step} of {session.plan.total_steps} and {here.micro} of the "
                f"{stopped.window_micro_batches} micro-batches of step {here.step + 1}, "
                f"checkpoint written to {stopped.checkpoint}; resume with: gradaccum {command} "
                f"--resume {shlex.quote(str(out))}",
                file=sys.stderr,
            )
            return None


def _print_summary(summary: RunSummary, out: Path) -> None:
    from gradaccum.experiments.report import PEAK_MEMORY_NOTE, format_bytes, format_seconds

    print(
        f"done: {summary.optimizer_steps} optimizer steps, {summary.samples_seen:,} samples, "
        f"{summary.samples_per_second:,.0f} samples/s, wall time "
        f"{format_seconds(summary.wall_seconds)}"
    )
    final, best = summary.final_metric, summary.best_metric
    print(f"  validation {summary.metric}: final {final:.4f}, best {best:.4f}")
    if summary.max_tokens is not None:
        print(
            f"  micro-batches packed by {summary.max_tokens} tokens: "
            f"{summary.micro_batches_per_step:g} per step on average, at most "
            f"{summary.accumulation_steps}; the largest {summary.micro_batch_size} rows"
        )
    print(f"  peak memory {format_bytes(summary.peak_memory_bytes)}")
    print(f"  ({PEAK_MEMORY_NOTE})")
    print(f"  results in {out}")
