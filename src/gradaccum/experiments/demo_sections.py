"""The four sections of `gradaccum demo`, their checks and its `report.md`.

`charlm_sections` turns a `demo.CharlmResult` into sections 1-3 (exactness, negative control,
memory), `digits_section` a `demo.DigitsResult` into section 4 (equal weights); each also returns
its checks by name. A `Section` renders both as terminal text and as markdown; `report_markdown`
joins them into the demo's `report.md`.

Example:
    >>> section = Section("Title", ["Intro."], ["run", "gap"], [["(b)", "1.0e-16"]], ["Done."],
    ...     right=frozenset({1}))
    >>> print(section.text(1))
    1. Title
       Intro.
    <BLANKLINE>
       run      gap
       (b)  1.0e-16
    <BLANKLINE>
       Done.
    >>> print(section.markdown(1))
    ## 1. Title
    <BLANKLINE>
    Intro.
    <BLANKLINE>
    | run | gap |
    | --- | ---: |
    | (b) | 1.0e-16 |
    <BLANKLINE>
    Done.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from gradaccum.experiments.demo import DIGITS_CONFIGS, CharlmResult, DigitsResult

__all__ = [
    "CONTROL_FACTOR",
    "EXACT_RTOL",
    "FLOAT32_RTOL",
    "INDENT",
    "Section",
    "charlm_sections",
    "digits_section",
    "report_markdown",
    "wrapped",
]

# A float64 gap below this is rounding; an algorithmic difference is orders of magnitude larger.
EXACT_RTOL = 1e-10
# The same for float32 runs (section 4).
FLOAT32_RTOL = 1e-5
# A negative control must land at least this many tolerances away to count as caught.
CONTROL_FACTOR = 1000

INDENT = "   "
_GAP_NOTE = "param gap: the largest over parameter tensors of ||p - p_ref|| / ||p_ref||."


@dataclass
class Section:
    """One section of the demo, rendered both as terminal text and as markdown.

    `right` holds the indexes of right-aligned columns. `inset_text` and `inset_markdown` go
    between the introduction and the table (section 4 puts the compare report there).
    """

    title: str
    before: list[str]
    headers: list[str]
    rows: list[list[str]]
    after: list[str]
    right: frozenset[int] = frozenset()
    inset_text: str = ""
    inset_markdown: str = ""

    def text(self, number: int) -> str:
        """The section as aligned terminal text, titled `"<number>. <title>"`."""
        lines = [f"{number}. {self.title}", *wrapped(self.before), ""]
        if self.inset_text:
            lines += [self.inset_text, ""]
        widths = [max(map(len, column)) for column in zip(self.headers, *self.rows, strict=True)]
        for cells in [self.headers, *self.rows]:
            padded = [
                cell.rjust(width) if index in self.right else cell.ljust(width)
                for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
            ]
            lines.append((INDENT + "  ".join(padded)).rstrip())
        return "\n".join([*lines, "", *wrapped(self.after)])

    def markdown(self, number: int) -> str:
        """The section as GitHub markdown, under a `## <number>. <title>` heading."""
        lines = [f"## {number}. {self.title}", "", " ".join(self.before), ""]
        if self.inset_markdown:
            lines += [self.inset_markdown, ""]
        align = ["---:" if index in self.right else "---" for index in range(len(self.headers))]
        for cells in [self.headers, align, *self.rows]:
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join([*lines, "", *(f"{line}  " for line in self.after)]).rstrip()


def wrapped(paragraphs: list[str]) -> list[str]:
    """The paragraphs as lines of at most 100 characters, indented by `INDENT`."""
    return [
        line
        for text in paragraphs
        for line in textwrap.wrap(
            text, 100, initial_indent=INDENT, subsequent_indent=INDENT, break_on_hyphens=False
        )
    ]


def charlm_sections(result: CharlmResult) -> tuple[list[Section], dict[str, bool]]:
    """Sections 1-3, and the checks `"(b) exact"` (under `EXACT_RTOL`) and `"(c) caught"`."""
    exact = result.gaps["accumulated"][0] < EXACT_RTOL
    caught = result.gaps["naive"][0] > CONTROL_FACTOR * EXACT_RTOL
    sections = [_exactness(result, exact), _negative_control(result, caught), _memory(result)]
    return sections, {"(b) exact": exact, "(c) caught": caught}


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


_MAX_ROWS = 12  # rows of the negative control's table; more are elided


def _negative_control(result: CharlmResult, caught: bool) -> Section:
    n, total = result.micro_batches, sum(result.tokens)
    rows = [
        [str(index), str(lines), f"{count:,}", f"{total / (n * count):.2f}x" if count else "-"]
        for index, (lines, count) in enumerate(
            zip(result.micro_lines, result.tokens, strict=True), start=1
        )
    ]
    if len(rows) > _MAX_ROWS:  # a batch of thousands of lines: the first rows and the last
        rows = [*rows[: _MAX_ROWS - 2], ["..."] + [""] * 3, rows[-1]]
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
            f"1/{total:,}. Step 1"
            + (
                f" ({n} micro-batches; the first {_MAX_ROWS - 2} and the last):"
                if n > _MAX_ROWS
                else ":"
            ),
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
    mib = f"{full / 2**20:.1f} MiB", f"{micro / 2**20:.1f} MiB"
    return Section(
        title="Memory saving: activations a forward keeps for its backward, measured",
        before=["gradaccum.memory.measure_activation_bytes on the step-1 batch, float64 model:"],
        headers=["forward", "activation bytes", "MiB"],
        rows=[
            [f"full batch ({result.batch_size} lines)", f"{full:,}", mib[0]],
            [f"largest micro-batch ({result.micro_batch_size} lines)", f"{micro:,}", mib[1]],
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


def digits_section(result: DigitsResult) -> tuple[Section, dict[str, bool]]:
    """Section 4 with the compare table and report inset, and its checks (8x4 equal, 8x1 not)."""
    from gradaccum.experiments.report import PEAK_MEMORY_NOTE, format_table

    labels = [f"{m}x{k}" for m, k in DIGITS_CONFIGS]
    reference, twin, control = labels
    batches = {label: m * k for label, (m, k) in zip(labels, DIGITS_CONFIGS, strict=True)}
    twin_gap, control_gap = result.gaps[twin][0], result.gaps[control][0]
    equal = twin_gap < FLOAT32_RTOL
    differs = control_gap > CONTROL_FACTOR * FLOAT32_RTOL
    verdict = "differs" if differs else "SAME"
    table = [INDENT + line for line in format_table(result.summaries).splitlines()]
    section = Section(
        title=f"Mini compare on digits: {', '.join(labels)}, {result.epochs} epochs each",
        before=[
            "gradaccum.experiments.runner.train, one run per config (micro-batch x accumulation "
            "steps), same seed and data order, float32 AdamW; the table is "
            "gradaccum.experiments.report's.",
        ],
        inset_text="\n".join([*table, "", *wrapped([PEAK_MEMORY_NOTE])]),
        inset_markdown=_demote(result.paths["report"].read_text()),
        headers=["config", "effective batch", f"param gap vs {reference}", "verdict"],
        rows=[
            [twin, str(batches[twin]), f"{twin_gap:.1e}", "equal" if equal else "NOT EQUAL"],
            [control, str(batches[control]), f"{control_gap:.1e}", verdict],
        ],
        after=[
            f"Final checkpoints vs {reference}, float32, rtol {FLOAT32_RTOL:g}. {_GAP_NOTE}",
            f"{twin} and {reference} see the same batches in the same order, so they must agree "
            f"to float32 rounding; {control} (effective batch {batches[control]}) is the control.",
        ],
        right=frozenset({1, 2}),
    )
    return section, {f"{twin} equals {reference}": equal, f"{control} differs": differs}


def _demote(markdown: str) -> str:
    """The compare report without its title, its other headings two levels down."""
    lines = markdown.strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join("##" + line if line.startswith("#") else line for line in lines).strip()


def report_markdown(command: str, sections: Sequence[Section], elapsed: float) -> str:
    """The demo's `report.md`: a title, how it was written, then every section.

    Example:
        >>> print(report_markdown("gradaccum demo", [], 9.87))
        # gradaccum demo
        <BLANKLINE>
        Written by `gradaccum demo` in 9.9 s; every number below was measured in that run.
        <BLANKLINE>
    """
    parts = [
        "# gradaccum demo",
        "",
        f"Written by `{command}` in {elapsed:.1f} s; every number below was measured in that run.",
    ]
    for number, section in enumerate(sections, start=1):
        parts += ["", section.markdown(number)]
    return "\n".join([*parts, ""])
