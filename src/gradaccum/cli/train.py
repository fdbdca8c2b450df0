"""`gradaccum train`: train one configuration of an embedded task; checkpoint, stop and resume it.

Every option is checked (and the configuration resolved) before anything is written. The run then
writes into `--out` itself:

- `config.json`: the configuration, the checkpoint interval and the thread count (for `--resume`);
- `metrics.jsonl`: one line per optimizer step (step, samples, loss, lr, grad_norm, time,
  micro_batches);
- `validation.jsonl`: the validation metric after each epoch (and after the last step);
- `summary.json`: the run's `RunSummary`;
- `checkpoint.pt`: model, optimizer, scheduler and Accumulator state and the run's position
  (`gradaccum.load_checkpoint`); written every `--checkpoint-every`, when the run is stopped, and
  at the end.

`--max-tokens N` (charlm) replaces `--micro-batch-size`: each effective batch is packed by
`gradaccum.packing.pack_by_tokens` into micro-batches of at most N padded tokens (rows x longest
row), and the run is labelled `B@Nt`; `summary.json` then reports the packing (the largest
micro-batch's rows, the most micro-batches of a window and their mean per step).

`--checkpoint-every N` (or `Nstep`) writes a checkpoint every N optimizer steps, `Nmicro` every N
micro-batches, even in the middle of a window. The first SIGTERM or SIGINT (Ctrl-C) makes the run
finish its current micro-batch, write a checkpoint and exit 0 with one line on stderr telling how
to resume; a second one exits at once (130). `--resume DIR` continues the run in DIR with the
settings of its `config.json`, from its checkpoint, exactly: the final parameters are bitwise
those of an uninterrupted run on the same machine with the same `--threads`. Lines that
`metrics.jsonl` got after that checkpoint are dropped first, so no step is logged twice.

A run stopped by a signal or killed keeps its folder. After an error, the folder stays if it holds
a checkpoint, and is removed otherwise (there is nothing to resume).

Test hook (for the test suite, not for users): with `GRADACCUM_TEST_SIGNAL_AT=STEP:MICRO:SIG`
(`SIG` one of TERM, INT, KILL, or several joined by `+`) the run sends itself those signals when it
reaches STEP optimizer steps and MICRO micro-batches of the next window, so a test can stop it at
an exact position.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from gradaccum.cli import UsageError
from gradaccum.cli._args import one_line, torch_threads
from gradaccum.cli._auto import plan_auto
from gradaccum.cli._notes import batchnorm_warnings_as_notes, show_batchnorm_notes
from gradaccum.cli._outdir import (
    StopRequest,
    resolve_out_dir,
    resumable_out_dir,
    stop_on_signals,
)
from gradaccum.cli._training_options import (
    CONFIG_OPTIONS,
    CheckedRun,
    add_training_options,
    build_config,
    describe_run,
    fill_defaults,
    train_items,
    validate_config,
)
from gradaccum.experiments._resume import (
    CHECKPOINT_NAME,
    CheckpointEvery,
    RunStopped,
    write_text_atomic,
)
from gradaccum.experiments.base import LrScaling, RunSummary, TrainConfig
from gradaccum.experiments.runner import (
    Position,
    ResumeError,
    StopCheck,
    TrainingRun,
    open_run,
    plain_config,
)
from gradaccum.sizing import format_bytes

__all__ = ["add_parser", "run"]

CONFIG_NAME = "config.json"
TEST_HOOK = "GRADACCUM_TEST_SIGNAL_AT"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `train` command.

    Args:
        subparsers: The top-level parser's sub-parser collection.

    Returns:
        The `train` sub-parser.
    """
    parser = subparsers.add_parser(
        "train",
        help="train one configuration of an embedded task (digits, shapes, charlm)",
        description=(
            "Train an embedded task with exact gradient accumulation: each optimizer step sees "
            "--batch-size items, split into micro-batches of --micro-batch-size (or, on charlm, "
            "packed into micro-batches of at most --max-tokens padded tokens). Shows progress "
            "on stderr and writes config.json, metrics.jsonl, validation.jsonl, summary.json and "
            "checkpoint.pt to --out. SIGTERM or Ctrl-C stops at the next micro-batch with a "
            "checkpoint (exit 0; a second one exits at once); --resume DIR continues exactly. "
            "Exit 2 on bad usage or input, with nothing written."
        ),
    )
    add_training_options(parser, batch_options=True, resumable=True)
    parser.add_argument(
        "--checkpoint-every",
        type=_checkpoint_every,
        metavar="N[step|micro]",
        help="also write checkpoint.pt every N optimizer steps (N or Nstep), or every N "
        "micro-batches (Nmicro), e.g. 50 or 200micro (default: only when stopped and at the end)",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue the run in DIR from its checkpoint.pt, with the settings of its "
        "config.json; give no option that changes them (only --threads and --checkpoint-every)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the options, train (or resume), and print a short summary.

    Args:
        args: The parsed options of `add_parser`.

    Returns:
        0 on success, and when stopped by a signal after writing a checkpoint.

    Raises:
        UsageError: On bad options or an unusable `--resume` folder, before anything is written.
    """
    # Threads are set once the options are checked (`_prepare_*`); they are restored on return.
    with torch_threads(), batchnorm_warnings_as_notes():
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    from gradaccum.experiments.progress import progress

    hook = _test_hook()
    prepared = _prepare_resume(args) if args.resume is not None else _prepare_new(args)
    checked, out, session = prepared.checked, prepared.out, prepared.session
    name = checked.config.task
    print(f"gradaccum train: {name} {describe_run(checked)}")
    show_batchnorm_notes([checked])
    if prepared.resumed:
        here = session.position
        print(f"  resuming at step {here.step} (+{here.micro} micro-batches) from {out}")
    else:
        print(f"  writing to {out}")
    with stop_on_signals() as request, _out_dir(out, prepared.resumed):
        if not prepared.resumed:
            _write_settings(out, checked.config, prepared.every, prepared.threads)
        try:
            with progress(f"{name} {checked.label}", checked.total_steps) as on_step:
                summary = session.run(
                    on_step=on_step,
                    checkpoint_every=prepared.every,
                    stop=_stop_check(request, hook),
                )
        except RunStopped as stopped:
            print(_stopped_line(stopped, request, checked, out), file=sys.stderr)
            return 0
    _print_summary(summary, out)
    return 0


@dataclass(frozen=True)
class _Prepared:
    """A run that passed every check, built and (when resuming) loaded: ready to train."""

    checked: CheckedRun
    out: Path
    session: TrainingRun
    every: CheckpointEvery | None
    threads: int
    resumed: bool


def _prepare_new(args: argparse.Namespace) -> _Prepared:
    if args.task is None:
        raise UsageError("--task is required (or --resume DIR to continue a run)")
    fill_defaults(args)
    config = build_config(
        args,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        max_tokens=args.max_tokens,
    )
    if config.micro_batch_size == "auto" and config.max_tokens is None:  # else refused below
        auto = plan_auto(config)
        config = auto.config
        print(
            f"gradaccum train: --micro-batch-size auto chose {config.micro_batch_size} for "
            f"--memory-budget {args.memory_budget} (largest that fits: "
            f"{auto.plan.micro_batch_size}, predicted peak "
            f"{format_bytes(auto.plan.predicted_peak_bytes)}; `gradaccum plan` shows the "
            f"table): {auto.reason}"
        )
    checked = validate_config(config, train_items(args.task, args.seed))
    if args.out is not None and (args.out / CONFIG_NAME).is_file():
        raise UsageError(
            f"--out {args.out}: holds a run of `gradaccum train`; continue it with: gradaccum "
            f"train --resume {shlex.quote(str(args.out))} (or choose a new folder)"
        )
    out = resolve_out_dir(args.out, "train", args.task)
    torch.set_num_threads(args.threads)
    session = open_run(config, out=out)
    return _Prepared(checked, out, session, args.checkpoint_every, args.threads, False)


def _prepare_resume(args: argparse.Namespace) -> _Prepared:
    folder: Path = args.resume
    given = [flag for dest, flag in (*CONFIG_OPTIONS, ("out", "--out")) if _given(args, dest)]
    if given:
        raise UsageError(
            f"{', '.join(given)} cannot be combined with --resume: a resumed run keeps the "
            f"settings in {folder / CONFIG_NAME}; drop {'them' if len(given) > 1 else 'it'} "
            "(to change settings, start a new run instead)"
        )
    config, saved_every, saved_threads = _read_settings(folder)
    checked = validate_config(config, train_items(config.task, config.seed), resuming=True)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--resume {folder}: directory is not writable")
    every = args.checkpoint_every or saved_every
    threads = args.threads or saved_threads
    torch.set_num_threads(threads)
    try:
        session = open_run(config, out=folder, resume=True)
    except ResumeError as error:
        raise UsageError(f"--resume {folder}: {error}") from None
    return _Prepared(checked, folder, session, every, threads, True)


def _given(args: argparse.Namespace, dest: str) -> bool:
    return getattr(args, dest, None) is not None


def _read_settings(folder: Path) -> tuple[TrainConfig, CheckpointEvery | None, int]:
    """The configuration, checkpoint interval and threads in `folder/config.json`."""
    if not folder.is_dir():
        reason = "no such directory" if not folder.exists() else "not a directory"
        raise UsageError(f"--resume {folder}: {reason}")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise UsageError(
            f"--resume {folder}: holds no {CONFIG_NAME}, so it is not a run folder of "
            "`gradaccum train`"
        )
    try:
        settings = json.loads(path.read_text())
        plain = dict(settings["config"])
        plain["lr_scaling"] = LrScaling(plain["lr_scaling"])
        config = TrainConfig(**plain)
        every = settings.get("checkpoint_every")
        threads = settings.get("threads", 1)
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads={threads!r} is not a positive int")
        return config, None if every is None else CheckpointEvery.parse(every), threads
    except (ValueError, KeyError, TypeError) as error:
        raise UsageError(
            f"--resume {folder}: {CONFIG_NAME} is damaged ({type(error).__name__}: "
            f"{one_line(error)})"
        ) from None


def _write_settings(
    out: Path, config: TrainConfig, every: CheckpointEvery | None, threads: int
) -> None:
    settings = {
        "command": "gradaccum train",
        "config": plain_config(config),
        "checkpoint_every": None if every is None else str(every),
        "threads": threads,
    }
    write_text_atomic(out / CONFIG_NAME, json.dumps(settings, indent=2) + "\n")


def _out_dir(out: Path, resumed: bool) -> contextlib.AbstractContextManager[Path]:
    """The folder context: a resumed run's folder is never removed."""
    if resumed:
        return contextlib.nullcontext(out)
    return resumable_out_dir(out, keep_if=CHECKPOINT_NAME)


def _checkpoint_every(text: str) -> CheckpointEvery:
    try:
        return CheckpointEvery.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_Hook = tuple[tuple[int, int], list[signal.Signals]]


def _test_hook() -> _Hook | None:
    """`GRADACCUM_TEST_SIGNAL_AT=STEP:MICRO:SIG[+SIG]`, read: see the module docstring."""
    text = os.environ.get(TEST_HOOK)
    if not text:
        return None
    try:
        step, micro, names = text.split(":")
        signals = [signal.Signals[f"SIG{name}"] for name in names.split("+")]
        return (int(step), int(micro)), signals
    except (ValueError, KeyError):
        raise UsageError(
            f"{TEST_HOOK}={text!r}: write STEP:MICRO:SIG[+SIG], e.g. 3:1:TERM"
        ) from None


def _stop_check(request: StopRequest, hook: _Hook | None) -> StopCheck:
    """The runner's `stop(position)`: whether a signal asked to stop (after the test hook)."""

    def stop(position: Position) -> bool:
        if hook is not None and (position.step, position.micro) == hook[0]:
            for number in hook[1]:
                os.kill(os.getpid(), number)
        return bool(request)

    return stop


def _stopped_line(stopped: RunStopped, request: StopRequest, checked: CheckedRun, out: Path) -> str:
    here = stopped.position
    return (
        f"gradaccum train: {request.signal or 'stop'} received; stopped after step {here.step} "
        f"of {checked.total_steps} and {here.micro} of the {stopped.window_micro_batches} "
        f"micro-batches of step {here.step + 1}, checkpoint written to {stopped.checkpoint}; "
        f"resume with: gradaccum train --resume {shlex.quote(str(out))}"
    )


def _print_summary(summary: RunSummary, out: object) -> None:
    from gradaccum.experiments.report import PEAK_MEMORY_NOTE, format_bytes, format_seconds

    print(
        f"done: {summary.optimizer_steps} optimizer steps, {summary.samples_seen:,} samples, "
        f"{summary.samples_per_second:,.0f} samples/s, wall time "
        f"{format_seconds(summary.wall_seconds)}"
    )
    print(
        f"  validation {summary.metric}: final {summary.final_metric:.4f}, "
        f"best {summary.best_metric:.4f}"
    )
    if summary.max_tokens is not None:
        print(
            f"  micro-batches packed by {summary.max_tokens} tokens: "
            f"{summary.micro_batches_per_step:g} per step on average, at most "
            f"{summary.accumulation_steps}; the largest {summary.micro_batch_size} rows"
        )
    print(f"  peak memory {format_bytes(summary.peak_memory_bytes)}")
    print(f"  ({PEAK_MEMORY_NOTE})")
    print(f"  results in {out}")
