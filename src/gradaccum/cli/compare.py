"""`gradaccum compare`: train several micro-batch x accumulation configs and compare them.

A config `MxK` trains micro-batches of M with K accumulation steps (effective batch M*K); `B@Nt`
(charlm) packs an effective batch of B by a token budget of N. All share the seed, hence the
initial weights and, for equal effective batches, the batches: on a task without BatchNorm `8x8`,
`64x1` and `64@2048t` end with the same parameters, to float32 rounding, and the parameter-gap
table shows it.

`--out` gets `compare.json` (the settings, for `--resume`), one `gradaccum train` folder per
config, written as it trains, and at the end `report.md`, `curves.png` and `memory.png`. The
first SIGTERM or Ctrl-C stops the config in progress with a checkpoint; `--resume DIR` skips the
finished configs, resumes the stopped one and trains the rest.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path

import torch

from gradaccum.cli import UsageError
from gradaccum.cli._args import torch_threads
from gradaccum.cli._options import (
    OPTIONS,
    add_options,
    add_output_options,
    batchnorm_notes,
    batchnorm_warnings_as_notes,
    config_from,
    given_flags,
    open_checked,
    require_packages,
)
from gradaccum.cli.train import CONFIG_NAME, train_session
from gradaccum.experiments import folders
from gradaccum.experiments.base import RunSummary, TrainConfig, parse_label
from gradaccum.experiments.runner import CHECKPOINT_NAME, TrainingRun
from gradaccum.experiments.settings import RunSettings, check_unchanged

__all__ = ["SETTINGS_NAME", "add_parser", "run"]

SETTINGS_NAME = "compare.json"
FLOAT32_RTOL = 1e-5  # a float32 gap below this is rounding


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `compare` command."""
    parser = subparsers.add_parser(
        "compare",
        help="compare micro-batch x accumulation configs on an embedded task",
        description="Train one run per config, MICROxSTEPS (8x2: micro-batches of 8, 2 steps, "
        "batch 16) or BATCH@TOKENSt (charlm; 64@2048t: batch 64 packed into micro-batches of at "
        "most 2048 padded tokens), with the same seed and data order; write report.md, "
        "curves.png and memory.png to --out and print the table and the parameter gaps. Ctrl-C "
        "keeps finished configs; --resume DIR goes on. Exit 2 on bad usage, nothing written.",
    )
    parser.add_argument(  # extend: `--configs 8x1 --configs 8x2` keeps both, as it reads
        "--configs", nargs="+", action="extend", metavar="MxK|B@Nt", help="e.g. 8x1 8x2 64@2048t"
    )
    add_options(parser, batch=False)
    add_output_options(parser, "compare")
    return parser


def run(args: argparse.Namespace) -> int:
    """Check everything, train each config not yet finished, report and print the tables.

    Returns:
        0 when every config finished, and when a signal stopped one with a checkpoint.

    Raises:
        UsageError: On bad options, configs or folder, before anything is written.
    """
    started = time.perf_counter()
    with torch_threads(), batchnorm_warnings_as_notes():
        out, base, labels = _resumed(args) if args.resume is not None else _new(args)
        require_packages(args, matplotlib=True)
        torch.set_num_threads(args.threads)
        configs = {label: base.replace(**_split(label)) for label in labels}
        sessions = _open_pending(out, configs)
        count = f"{len(labels)} config{'s' if len(labels) > 1 else ''}"
        print(f"gradaccum compare: {base.task}, {count}, seed {base.seed}")
        for label in labels:
            print(
                f"  {sessions[label].plan.describe()}" if label in sessions else f"  {label}: done"
            )
        batchnorm_notes(list(sessions.values()))
        print(f"  writing to {out}")
        with folders.stop_on_signals() as request, folders.run_folder(out, keep_if=CHECKPOINT_NAME):
            every = args.checkpoint_every
            board = bool(args.tensorboard)
            RunSettings(base, every, args.threads, board, tuple(labels)).save(out / SETTINGS_NAME)
            for index, (label, session) in enumerate(sessions.items(), start=1):
                with folders.run_folder(out / label, keep_if=CHECKPOINT_NAME):
                    settings = RunSettings(session.plan.config, every, args.threads, board)
                    settings.save(out / label / CONFIG_NAME)
                    name = f"[{index}/{len(sessions)}] {label}"
                    if train_session(session, name, "compare", out, request, every, board) is None:
                        return 0
            _report(out, base, labels, args.threads)
    print(f"total time {time.perf_counter() - started:.1f} s")
    return 0


def _new(args: argparse.Namespace) -> tuple[Path, TrainConfig, list[str]]:
    if args.configs is None or args.task is None:
        raise UsageError("--task and --configs are required (or --resume DIR to continue)")
    for option in OPTIONS:
        if option.batch and getattr(args, option.field) is not None:
            raise UsageError(
                f"{option.flag} is not a compare option: batch sizes come from --configs (e.g. "
                "8x2 = micro-batch 8 x 2 accumulation steps, 64@2048t = batch 64 packed by 2048 "
                "tokens)"
            )
    labels = [_canonical(label) for label in args.configs]
    for label, text in zip(labels, args.configs, strict=True):
        if labels.count(label) > 1:
            raise UsageError(f"config {text!r} is given twice")
    folders.check_not_resumable(args.out, SETTINGS_NAME, "compare", "a compare")
    out = args.out or folders.default_out_dir("compare", args.task)
    folders.check_out_dir(out)
    args.threads = args.threads or 1
    return out, config_from(args), labels


def _resumed(args: argparse.Namespace) -> tuple[Path, TrainConfig, list[str]]:
    folder: Path = args.resume
    given = given_flags(args) + (["--configs"] if args.configs else [])
    if given:
        raise UsageError(
            f"{', '.join(given)} cannot be combined with --resume: the compare in {folder} keeps "
            f"its settings; drop {'them' if len(given) > 1 else 'it'}"
        )
    folders.check_resume_dir(folder)
    if not (folder / SETTINGS_NAME).is_file():
        raise UsageError(f"--resume {folder}: holds no {SETTINGS_NAME} of `gradaccum compare`")
    try:
        saved = RunSettings.load(folder / SETTINGS_NAME)
        labels = [_canonical(label) for label in saved.configs]
    except (ValueError, UsageError) as error:
        raise UsageError(f"--resume {folder}: {error}") from None
    args.threads = args.threads or saved.threads
    args.checkpoint_every = args.checkpoint_every or saved.checkpoint_every
    args.tensorboard = args.tensorboard or saved.tensorboard  # as the compare was started
    return folder, saved.config, labels


def _canonical(text: str) -> str:
    try:
        batch, micro, tokens = parse_label(text)
    except ValueError as error:  # a malformed config given
        raise UsageError(str(error)) from None
    return f"{micro}x{batch // micro}" if micro else f"{batch}@{tokens}t"


def _split(label: str) -> dict[str, int | None]:
    batch, micro, tokens = parse_label(label)
    return {"batch_size": batch, "micro_batch_size": micro, "max_tokens": tokens}


def _open_pending(out: Path, configs: dict[str, TrainConfig]) -> dict[str, TrainingRun]:
    """Open every config not yet finished (resuming those with a checkpoint); all are checked."""
    sessions = {}
    for label, config in configs.items():
        folder = out / label
        if (folder / "summary.json").is_file():
            check_unchanged(folder, config, out)  # its row and gap would compare unlike runs
            continue
        resume = (folder / CHECKPOINT_NAME).is_file()
        if folder.exists() and not resume:  # killed before its first checkpoint: start it again
            shutil.rmtree(folder)
        try:
            sessions[label] = open_checked(config, folder, resume=resume)
        except UsageError as error:
            raise UsageError(_in_config_terms(label, str(error))) from None
    return sessions


_CONFIG_TERMS = {  # a run's check naming an option compare lacks -> said of the config instead
    r"--batch-size=\d+ is larger than (.+?) \((\d+) items\)": "its batch of {b} is larger than "
    "{0} ({1} items); give configs of at most {1} items per step",
    r"--max-tokens=\d+ is less than (.+?); give --max-tokens (\d+)": "{t} tokens is less than "
    "{0}; give a budget of {1} tokens or more, e.g. {b}@{1}t",
    r"--max-tokens packs token sequences by length, and (the \w+ task's)": "a B@Nt config packs "
    "token sequences by length, and {0} batches are not; use B@Nt with --task charlm, or MxK",
}


def _in_config_terms(label: str, message: str) -> str:
    """`message`, if `_CONFIG_TERMS` knows it, said of the config `label`: the fix is a config."""
    batch, _, tokens = parse_label(label)
    for pattern, said in _CONFIG_TERMS.items():
        if found := re.match(pattern, message):
            return f"config {label!r}: " + said.format(*found.groups(), b=batch, t=tokens)
    return message


def _report(out: Path, base: TrainConfig, labels: list[str], threads: int) -> None:
    """Write the report of the finished configs and print the tables."""
    from gradaccum.experiments import report
    from gradaccum.experiments.gaps import format_gaps, gap_rows

    summaries = [
        RunSummary(**json.loads((out / name / "summary.json").read_text())) for name in labels
    ]
    curves = {name: report.read_metrics(out / name / "metrics.jsonl") for name in labels}
    settings = report.report_settings(base, threads)
    paths = report.write_report(out, base.task, summaries, curves=curves, settings=settings)
    if len(labels) > 1:
        batches = {s.config: s.effective_batch for s in summaries}
        reference, rows = gap_rows(
            {name: out / name / CHECKPOINT_NAME for name in labels}, batches, FLOAT32_RTOL
        )
        table = format_gaps(reference, rows, FLOAT32_RTOL, markdown=True)
        with paths["report"].open("a") as handle:
            handle.write(f"\n## Parameter gaps\n\n{table}\n")
    print()
    report.print_table(summaries, title=f"gradaccum compare: {base.task}")
    for note in [
        *report.packing_notes(summaries),
        report.PEAK_MEMORY_NOTE,
        report.noise_scale_note(summaries),
    ]:
        if note:
            print(note)
    if len(labels) > 1:
        print()
        print(format_gaps(reference, rows, FLOAT32_RTOL))
    print()
    print(f"results in {out}: " + ", ".join(path.name for path in paths.values()))
    print(f"  and one folder per config: {', '.join(labels)}")
