"""`gradaccum demo`: exactness, memory saving and a mini compare, shown with measured numbers.

Nothing is downloaded: both tasks ship with the package. In well under a minute on two CPU cores:

1. Exactness on `charlm` (a character transformer on padded lines, token-level loss). Three
   float64 runs start from the same weights and see the same batches with the same AdamW:
   (a) a plain full-batch reference written without gradaccum, (b) `gradaccum.Accumulator` with
   micro-batches, (c) the naive loop that divides each micro-batch's token mean by the number of
   micro-batches. The parameter gaps of (b) and (c) against (a) are printed.
2. The negative control: why (c) is wrong, with the token counts of the micro-batches.
3. The memory saving: activation bytes of a full-batch and of a micro-batch forward.
4. A mini compare on `digits` (32x1, 8x4, 8x1) with the experiment runner; 8x4 must end with the
   parameters of 32x1, 8x1 elsewhere.

Everything goes to `--out` (default `gradaccum-demo`): `report.md` with all four sections,
`curves.png`, `memory.png` and `runs/<config>/` for the digits runs. The exit code is 0 when every
check holds, 1 when one fails, 2 on bad usage (nothing is written then).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Sequence
from pathlib import Path

from gradaccum._install import install_hint
from gradaccum.cli import UsageError
from gradaccum.cli._args import add_threads_option, positive_int, torch_threads
from gradaccum.cli._demo_sections import (
    DIGITS_CONFIGS,
    INDENT,
    OUT_NAMES,
    CharlmResult,
    DigitsResult,
    Section,
    run_charlm,
    run_digits,
    wrapped,
)
from gradaccum.cli._outdir import check_out_dir, staged_out_dir, terminate_as_interrupt

__all__ = ["CONTROL_FACTOR", "EXACT_RTOL", "FLOAT32_RTOL", "add_parser", "run"]

# A float64 gap below this is rounding; an algorithmic difference is orders of magnitude larger.
EXACT_RTOL = 1e-10
# The same for float32 runs (section 4).
FLOAT32_RTOL = 1e-5
# A negative control must land at least this many tolerances away to count as caught.
CONTROL_FACTOR = 1000

_GAP_NOTE = "param gap: the largest over parameter tensors of ||p - p_ref|| / ||p_ref||."


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `demo` command.

    Args:
        subparsers: The top-level parser's sub-parser collection.

    Returns:
        The `demo` sub-parser.
    """
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
    parser.add_argument(
        "--steps", type=positive_int, default=12, help="charlm optimizer steps (default: 12)"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=32, help="charlm lines per step (default: 32)"
    )
    parser.add_argument(
        "--micro-batch-size",
        type=positive_int,
        default=8,
        help="charlm lines per micro-batch, less than --batch-size (default: 8)",
    )
    parser.add_argument(
        "--epochs", type=positive_int, default=2, help="digits epochs per config (default: 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="data and weight seed (default: 0)")
    add_threads_option(parser)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gradaccum-demo"),
        metavar="DIR",
        help="results folder: new, empty, or a previous demo's, which is replaced "
        "(default: gradaccum-demo)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the options and `--out`, run the four sections, print them and write the report.

    Args:
        args: The parsed options of `add_parser`.

    Returns:
        0 if every check holds, 1 if one fails.

    Raises:
        UsageError: On bad options or an unusable `--out`, before any work or writing.
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
    from gradaccum.experiments.report import PEAK_MEMORY_NOTE, format_table
    from gradaccum.experiments.tasks import get_task

    threads = f"{args.threads} thread{'s' if args.threads > 1 else ''}"
    print(f"gradaccum demo: exact gradient accumulation, measured (seed {args.seed}, {threads})")
    print()
    charlm = run_charlm(
        get_task("charlm"),
        seed=args.seed,
        steps=args.steps,
        size=args.batch_size,
        micro=args.micro_batch_size,
    )
    exact, caught = _charlm_checks(charlm)
    sections = [_exactness(charlm, exact), _negative_control(charlm, caught), _memory(charlm)]
    for number, section in enumerate(sections, start=1):
        print(section.text(number))
        print()
    with terminate_as_interrupt(), staged_out_dir(args.out, replaceable=OUT_NAMES) as staging:
        digits = run_digits(staging, seed=args.seed, epochs=args.epochs)
        equal, differs = _digits_checks(digits)
        rows = [INDENT + line for line in format_table(digits.summaries).splitlines()]
        table = "\n".join([*rows, "", *wrapped([PEAK_MEMORY_NOTE])])
        report = digits.paths["report"]
        compare = _demote(report.read_text())
        sections.append(_equal_weights(digits, equal, differs, table, compare))
        print(sections[-1].text(len(sections)))
        print()
        elapsed = time.perf_counter() - started
        report.write_text(_report(args, sections, elapsed))
    checks = {
        "(b) exact": exact,
        "(c) caught": caught,
        "8x4 equals 32x1": equal,
        "8x1 differs": differs,
    }
    failed = [name for name, ok in checks.items() if not ok]
    summary = f"FAILED: {', '.join(failed)}" if failed else f"all {len(checks)} hold"
    print(f"checks: {summary}")
    print(f"results in {args.out}: report.md, curves.png, memory.png, runs/<config>/")
    print(f"done in {elapsed:.1f} s")
    return 1 if failed else 0


def _charlm_checks(result: CharlmResult) -> tuple[bool, bool]:
    exact = result.gaps["accumulated"][0] < EXACT_RTOL
    caught = result.gaps["naive"][0] > CONTROL_FACTOR * EXACT_RTOL
    return exact, caught


def _digits_checks(result: DigitsResult) -> tuple[bool, bool]:
    twin, control = (f"{m}x{k}" for m, k in DIGITS_CONFIGS[1:])
    equal = result.gaps[twin][0] < FLOAT32_RTOL
    differs = result.gaps[control][0] > CONTROL_FACTOR * FLOAT32_RTOL
    return equal, differs


def _exactness(result: CharlmResult, exact: bool) -> Section:
    k, n, m = result.steps, result.micro_batches, result.micro_batch_size
    acc_gap, worst = result.gaps["accumulated"]
    runs = {
        "reference": "(a) full batch, plain PyTorch (reference)",
        "accumulated": f"(b) gradaccum.Accumulator, micro_batch_size={m}",
        "naive": f"(c) naive: each micro-batch's token mean / {n}",
    }
    rows = []
    for key, label in runs.items():
        losses = result.losses[key]
        gap, name = result.gaps.get(key, (None, "-"))
        gap_text = "-" if gap is None else f"{gap:.1e}"
        rows.append([label, f"{losses[0]:.6f}", f"{losses[-1]:.6f}", gap_text, name])
    if exact:
        verdict = (
            f"verdict: EXACT. (b) matches (a) to float64 rounding: {acc_gap:.1e} < {EXACT_RTOL:g}."
        )
    else:
        verdict = f"verdict: MISMATCH. (b) is {acc_gap:.1e} away from (a), over {EXACT_RTOL:g}."
    after = [_GAP_NOTE, verdict]
    if worst.endswith("qkv.bias"):
        after.append(
            f"(b)'s largest gap is in {worst}, which includes the attention key bias: its exact "
            "gradient is zero (softmax ignores a shift shared by all keys), so both runs step on "
            "rounding noise there, and AdamW's division by sqrt(v) + eps enlarges it."
        )
    return Section(
        title=f"Exactness on charlm: parameters after {k} steps vs a plain full-batch run",
        before=[
            f"Character transformer, {result.parameters:,} parameters, float64. {k} batches of "
            f"{result.batch_size} padded lines, {n} micro-batches of up to {m} each; padding is "
            f"ignored by the loss. Same initial weights, batches and AdamW(lr={result.lr:g}) "
            "for all three runs.",
        ],
        headers=["run", "loss, step 1", f"loss, step {k}", "param gap vs (a)", "worst tensor"],
        rows=rows,
        after=after,
        right=frozenset({1, 2, 3}),
    )


def _negative_control(result: CharlmResult, caught: bool) -> Section:
    n, total = result.micro_batches, sum(result.tokens)
    rows = [
        [str(index), str(lines), f"{count:,}", f"{total / (n * count):.2f}x" if count else "-"]
        for index, (lines, count) in enumerate(
            zip(result.micro_lines, result.tokens, strict=True), start=1
        )
    ]
    naive_gap = result.gaps["naive"][0]
    times = naive_gap / max(result.gaps["accumulated"][0], 1e-300)
    if caught:
        verdict = (
            f"verdict: CAUGHT. (c) ends {naive_gap:.1e} away from (a), {times:.1e} times the "
            "gap of (b)."
        )
    else:
        verdict = f"verdict: NOT CAUGHT. (c) is only {naive_gap:.1e} away from (a)."
    ref, naive = result.losses["reference"][0], result.losses["naive"][0]
    return Section(
        title="Negative control: the naive loop on the same batches",
        before=[
            f"The naive loop gives each micro-batch the weight 1/{n}, whatever its token count; "
            f"the full-batch objective gives each of the {total:,} tokens of step 1 the weight "
            f"1/{total:,}. Step 1:",
        ],
        headers=["micro-batch", "lines", "tokens counted", "naive weight / true weight"],
        rows=rows,
        after=[
            f"Objective at the same initial weights: token mean (a) {ref:.6f}, mean of "
            f"micro-batch means (c) {naive:.6f}.",
            verdict,
        ],
        right=frozenset({1, 2, 3}),
    )


def _memory(result: CharlmResult) -> Section:
    full, micro = result.full_bytes, result.micro_bytes
    return Section(
        title="Memory saving: activations a forward keeps for its backward, measured",
        before=["gradaccum.memory.measure_activation_bytes on the step-1 batch, float64 model:"],
        headers=["forward", "activation bytes", "MiB"],
        rows=[
            [f"full batch ({result.batch_size} lines)", f"{full:,}", _mib(full)],
            [f"largest micro-batch ({result.micro_batch_size} lines)", f"{micro:,}", _mib(micro)],
            ["ratio full / micro", f"{full / micro:.2f}x", ""],
        ],
        after=[
            "Counted: each distinct storage autograd saves for the backward during the forward "
            "(saved-tensor hooks). Not counted: weights, gradients, optimizer state and the "
            "input batch, which do not shrink with the micro-batch. Each micro-batch is cut to "
            "its own longest line; the largest one is the widest.",
        ],
        right=frozenset({1, 2}),
    )


def _equal_weights(
    result: DigitsResult, equal: bool, differs: bool, table: str, compare: str
) -> Section:
    labels = [f"{m}x{k}" for m, k in DIGITS_CONFIGS]
    reference, twin, control = labels
    batches = {label: m * k for label, (m, k) in zip(labels, DIGITS_CONFIGS, strict=True)}
    twin_gap, control_gap = result.gaps[twin][0], result.gaps[control][0]
    rows = [
        [twin, str(batches[twin]), f"{twin_gap:.1e}", "equal" if equal else "NOT EQUAL"],
        [control, str(batches[control]), f"{control_gap:.1e}", "differs" if differs else "SAME"],
    ]
    return Section(
        title=f"Mini compare on digits: {', '.join(labels)}, {result.epochs} epochs each",
        before=[
            "gradaccum.experiments.runner.train, one run per config (micro-batch x accumulation "
            "steps), same seed and data order, float32 AdamW; the table is "
            "gradaccum.experiments.report's.",
        ],
        inset_text=table,
        inset_markdown=compare,
        headers=["config", "effective batch", f"param gap vs {reference}", "verdict"],
        rows=rows,
        after=[
            f"Final checkpoints vs {reference}, float32, rtol {FLOAT32_RTOL:g}. {_GAP_NOTE}",
            f"{twin} and {reference} see the same batches in the same order, so they must agree "
            f"to float32 rounding; {control} (effective batch {batches[control]}) is the control.",
        ],
        right=frozenset({1, 2}),
    )


def _demote(markdown: str) -> str:
    """The compare report without its title, its other headings two levels down."""
    lines = markdown.strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join("##" + line if line.startswith("#") else line for line in lines).strip()


def _report(args: argparse.Namespace, sections: Sequence[Section], elapsed: float) -> str:
    """The final `report.md`: every section, with the compare report inside section 4."""
    command = (
        f"gradaccum demo --seed {args.seed} --steps {args.steps} --batch-size "
        f"{args.batch_size} --micro-batch-size {args.micro_batch_size} --epochs {args.epochs} "
        f"--threads {args.threads}"
    )
    parts = [
        "# gradaccum demo",
        "",
        f"Written by `{command}` in {elapsed:.1f} s; every number below was measured in that run.",
    ]
    for number, section in enumerate(sections, start=1):
        parts += ["", section.markdown(number)]
    return "\n".join([*parts, ""])


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"
