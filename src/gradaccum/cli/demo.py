"""`gradaccum demo`: exactness, memory saving and a mini compare, shown with measured numbers.

Nothing is downloaded; in well under a minute on two CPU cores it prints four sections
(`gradaccum.experiments.demo` measures, `gradaccum.experiments.demo_sections` renders and checks):
charlm trained three ways in float64 (plain full batch, `gradaccum.Accumulator`, the naive loop),
why the naive loop is wrong, the activation memory saved, and a mini compare on digits.
Everything goes to `--out`: `report.md`, `curves.png`, `memory.png` and `runs/<config>/`.
Exit code 0 when every check holds, 1 when one fails, 2 on bad usage (nothing is written then).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

from gradaccum._install import install_hint
from gradaccum.cli import UsageError
from gradaccum.cli._args import path, positive_int, seed, thread_count, torch_threads
from gradaccum.experiments.demo import OUT_NAMES
from gradaccum.experiments.folders import check_out_dir, staged_out_dir, terminate_as_interrupt

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `demo` command on the top-level parser's `subparsers`; return its parser."""
    parser = subparsers.add_parser(
        "demo",
        help="show, with measured numbers, that accumulation equals full-batch training",
        description=(
            "Train charlm three ways in float64 (plain full batch, gradaccum.Accumulator, the "
            "naive mean-of-means loop) and compare their parameters; measure the activation "
            "memory of a full-batch and a micro-batch forward; run a mini compare on digits "
            "(32x1, 8x4, 8x1). Writes report.md, curves.png and memory.png to --out. Nothing "
            "is downloaded. Exit 1 if a check fails, 2 on bad usage."
        ),
    )
    add = parser.add_argument
    add("--steps", type=positive_int, default=12, help="charlm optimizer steps (default: 12)")
    add("--batch-size", type=positive_int, default=32, help="charlm lines per step (default: 32)")
    add("--micro-batch-size", type=positive_int, default=8,
        help="charlm lines per micro-batch, less than --batch-size (default: 8)")  # fmt: skip
    add("--epochs", type=positive_int, default=2, help="digits epochs per config (default: 2)")
    add("--seed", type=seed, default=0, help="data and weight seed, 0 to 2**32 - 1 (default: 0)")
    add("--threads", type=thread_count, default=1, metavar="N",
        help="torch CPU threads, restored afterwards (default: 1)")  # fmt: skip
    add("--out", type=path, default=Path("gradaccum-demo"), metavar="DIR",
        help="results folder: new, empty, or a previous demo's, which is replaced "
        "(default: gradaccum-demo)")  # fmt: skip
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the options and `--out`, run and print the four sections, write the report.

    Returns 0 if every check holds, 1 if one fails. Raises `UsageError` on bad options or an
    unusable `--out`, before any work or writing.
    """
    started = time.perf_counter()
    _check(args)
    with torch_threads(args.threads):
        return _run(args, started)


def _check(args: argparse.Namespace) -> None:
    if args.micro_batch_size >= args.batch_size:
        raise UsageError(
            f"--micro-batch-size {args.micro_batch_size} must be less than --batch-size "
            f"{args.batch_size}: the demo accumulates several micro-batches per step"
        )
    for module, package in (("matplotlib", "matplotlib"), ("sklearn", "scikit-learn")):
        if importlib.util.find_spec(module) is None:
            raise UsageError(
                f"the demo needs {package}, which is not installed; " + install_hint("cli")
            )
    check_out_dir(args.out, replaceable=OUT_NAMES)


def _run(args: argparse.Namespace, started: float) -> int:
    from gradaccum.experiments import demo, demo_sections
    from gradaccum.experiments.tasks import get_task

    threads = f"{args.threads} thread{'s' if args.threads > 1 else ''}"
    print(f"gradaccum demo: exact gradient accumulation, measured (seed {args.seed}, {threads})\n")
    charlm = demo.run_charlm(get_task("charlm"), seed=args.seed, steps=args.steps,
                             size=args.batch_size, micro=args.micro_batch_size)  # fmt: skip
    sections, checks = demo_sections.charlm_sections(charlm)
    for number, section in enumerate(sections, start=1):
        print(section.text(number), end="\n\n")
    with terminate_as_interrupt(), staged_out_dir(args.out, replaceable=OUT_NAMES) as staging:
        digits = demo.run_digits(staging, seed=args.seed, epochs=args.epochs)
        section, digits_checks = demo_sections.digits_section(digits)
        sections, checks = [*sections, section], {**checks, **digits_checks}
        print(section.text(len(sections)), end="\n\n")
        elapsed = time.perf_counter() - started
        command = (f"gradaccum demo --seed {args.seed} --steps {args.steps} --batch-size "
                   f"{args.batch_size} --micro-batch-size {args.micro_batch_size} --epochs "
                   f"{args.epochs} --threads {args.threads}")  # fmt: skip
        report = demo_sections.report_markdown(command, sections, elapsed)
        digits.paths["report"].write_text(report)
    failed = [name for name, ok in checks.items() if not ok]
    summary = f"FAILED: {', '.join(failed)}" if failed else f"all {len(checks)} hold"
    print(f"checks: {summary}")
    print(f"results in {args.out}: report.md, curves.png, memory.png, runs/<config>/")
    print(f"done in {elapsed:.1f} s")
    return 1 if failed else 0
