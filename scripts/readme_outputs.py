"""Regenerate, or check, the sample outputs shown in README.md.

A generated block is a ```text fence right after a marker line naming the command:

    <!-- output: gradaccum plan --task charlm --batch-size 256 --memory-budget 64MiB -->
    <!-- output lines=1-3,7,9-12: gradaccum demo -->

The command runs in a fresh temporary folder (so files it writes and the relative paths it prints
are always the same), with `gradaccum` replaced by `python -m gradaccum` on the interpreter
running this script; its stdout is the block. `lines=` keeps only those lines (1-based, of the
whole output) for an abridged block: recheck the selection by eye after the output changes.
Trailing spaces are stripped and the temporary folder's path is removed.

Run-to-run noise stays in the README as last generated but is left out of the comparison: before
comparing, both sides go through `normalize`, which replaces durations (`0.6 s`), throughputs
(the samples/s column, `812 samples/s`) and timestamps (run folders are named after the time)
with placeholders and collapses runs of spaces (a wider number realigns a table). Machine
noise is matched loosely: float64 gaps of 1e-12 and below are placeholders too, and float32
training figures, which differ with the CPU's kernels, match within a factor of 3 (gaps in
e-notation) or 0.01 (accuracies `0.dddd`); see `_loosely_equal`. Everything else must match
exactly.

Usage:
    python scripts/readme_outputs.py           # rewrite every block in README.md (make docs)
    python scripts/readme_outputs.py --check   # compare only; exit 1 listing the blocks that differ
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = re.compile(r"<!-- output(?: lines=(?P<lines>[0-9,\-]+))?: (?P<command>.+?) -->")
FENCE = "```text"

# (pattern, placeholder): what differs from run to run. Applied in this order.
NOISE = [
    (re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}\S*"), "<timestamp>"),
    # Run folders are named after the time: runs/compare-digits-20261125-035247.
    (re.compile(r"\b\d{8}-\d{6}\b"), "<timestamp>"),
    # A table's samples/s and wall-time columns, side by side: "3,329      0.9 s".
    (re.compile(r"\b\d[\d,]*(?:\.\d+)?\s+\d+(?:\.\d+)? s\b"), "<rate> <time> s"),
    (re.compile(r"\b\d[\d,]*(?:\.\d+)? samples/s\b"), "<rate> samples/s"),
    (re.compile(r"\b\d+(?:\.\d+)? s\b"), "<time> s"),
    (re.compile(r"\b\d+:\d{2}:\d{2}\b"), "<h:mm:ss>"),
    # Float64 rounding (1e-12 and below) differs with the CPU's kernels (its vector width), not
    # with the code: `check`'s per-parameter gaps. A real inexactness shows at 1e-9 and above.
    (re.compile(r"\b\d(?:\.\d+)?e-(?:1[2-9]|[2-9]\d)\b"), "<rounding>"),
]


class BlockError(ValueError):
    """A marker without a well-formed block, or a command that did not run."""


@dataclass(frozen=True)
class Block:
    """One generated block of the README.

    Attributes:
        command: The command line, as written in the marker.
        lines: The 1-based output lines kept, or None for the whole output.
        start: Index (0-based, in the README's lines) of the first line inside the fence.
        end: Index of the closing fence line.
        body: The block's current text.
    """

    command: str
    lines: tuple[int, ...] | None
    start: int
    end: int
    body: str

    @property
    def name(self) -> str:
        """The command, with the abridged selection if any: how messages name the block."""
        return self.command if self.lines is None else f"{self.command} (abridged)"


def parse_lines(spec: str) -> tuple[int, ...]:
    """Parse `1-3,7` into (1, 2, 3, 7); raise BlockError on an empty or reversed range."""
    kept: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise BlockError(f"bad lines= selection {spec!r}: use e.g. 1-3,7")
        low, high = int(first), int(last or first)
        if low < 1 or high < low:
            raise BlockError(f"bad lines= range {part!r} in {spec!r}")
        kept.extend(range(low, high + 1))
    return tuple(kept)


def parse_blocks(text: str) -> list[Block]:
    """Find every marked block of a README's text, in order.

    Raises:
        BlockError: If a marker is not directly followed by a closed ```text fence.
    """
    lines = text.splitlines()
    blocks = []
    for index, line in enumerate(lines):
        match = MARKER.fullmatch(line.strip())
        if match is None:
            continue
        if index + 1 >= len(lines) or lines[index + 1].strip() != FENCE:
            raise BlockError(f"line {index + 1}: the marker must be followed by a {FENCE} fence")
        try:
            end = lines.index("```", index + 2)
        except ValueError:
            raise BlockError(f"line {index + 1}: the {FENCE} fence is never closed") from None
        spec = match["lines"]
        blocks.append(
            Block(
                command=match["command"].strip(),
                lines=parse_lines(spec) if spec else None,
                start=index + 2,
                end=end,
                body="\n".join(lines[index + 2 : end]),
            )
        )
    return blocks


def run(block: Block, timeout: float = 300) -> str:
    """Run a block's command in a fresh temporary folder; return the block's new text.

    Raises:
        BlockError: If the command is not a gradaccum command, fails with exit code 2 or more
            (1 is a verdict, e.g. `gradaccum check` on an inexact model), prints nothing, or
            has fewer lines than `lines=` asks for.
    """
    argv = shlex.split(block.command)
    if argv[0] != "gradaccum":
        raise BlockError(f"{block.command!r}: only gradaccum commands are run")
    # Not the caller's terminal size: a rich table must be laid out the same for everyone.
    env = {k: v for k, v in os.environ.items() if k not in {"COLUMNS", "LINES"}}
    with tempfile.TemporaryDirectory(prefix="readme-output-") as folder:
        done = subprocess.run(
            [sys.executable, "-m", "gradaccum", *argv[1:]],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        # The folder as printed, resolved or not (macOS /tmp is a symlink).
        out = done.stdout
        for path in {str(Path(folder).resolve()), folder}:
            out = out.replace(path + os.sep, "").replace(path, ".")
    if done.returncode >= 2 or not out.strip():
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise BlockError(f"{block.command!r} exited {done.returncode}:\n{tail}")
    lines = [line.rstrip() for line in out.rstrip("\n").splitlines()]
    if block.lines is not None:
        if max(block.lines) > len(lines):
            raise BlockError(
                f"{block.name}: lines= asks for line {max(block.lines)} of {len(lines)}"
            )
        lines = [lines[n - 1] for n in block.lines]
    return "\n".join(lines)


def normalize(text: str) -> list[str]:
    """The lines compared: noise replaced by placeholders, runs of spaces collapsed."""
    lines = []
    for line in text.splitlines():
        for pattern, placeholder in NOISE:
            line = pattern.sub(placeholder, line)
        lines.append(" ".join(line.split()))
    return lines


# Float32 training figures differ with the CPU's kernels (vector width, BLAS paths), not with
# the code: on two machines one commit's digits run ends one held-out item apart (0.9805 and
# 0.9833), and a rounding-level gap, or a ratio of two, by a factor under 2. Such numbers match
# loosely; every other number, and all the text around them, must match exactly.
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]\d+)?")
_SCORE = re.compile(r"0\.\d{4}")  # an accuracy over a few hundred held-out items
_LOOSE_FACTOR = 3.0  # e-notation gaps and their ratios
_LOOSE_SCORE = 0.01  # about three held-out items of digits


def _loosely_equal(expected: str, actual: str) -> bool:
    """Whether two normalized lines differ only in float32 figures, within their looseness."""
    if _NUMBER.split(expected) != _NUMBER.split(actual):
        return False
    pairs = zip(_NUMBER.findall(expected), _NUMBER.findall(actual), strict=True)
    return all(old == new or _close_figures(old, new) for old, new in pairs)


def _close_figures(old: str, new: str) -> bool:
    if "e" in old and "e" in new:  # a gap or a ratio of gaps: within a factor
        a, b = float(old), float(new)
        return a > 0 and b > 0 and max(a / b, b / a) <= _LOOSE_FACTOR
    if _SCORE.fullmatch(old) and _SCORE.fullmatch(new):  # an accuracy: within a few items
        return abs(float(old) - float(new)) <= _LOOSE_SCORE
    return False


def difference(block: Block, fresh: str, label: str = "README.md") -> str:
    """A unified diff of the normalized texts, empty when the block is current."""
    expected, actual = normalize(block.body), normalize(fresh)
    if len(expected) == len(actual) and all(map(_loosely_equal, expected, actual)):
        return ""
    return "\n".join(difflib.unified_diff(expected, actual, label, "now", lineterm=""))


def main(argv: list[str] | None = None) -> int:
    """Rewrite or check every block; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; write nothing")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)

    text = args.readme.read_text(encoding="utf-8")
    lines = text.splitlines()
    stale: list[str] = []
    # Bottom to top, so that rewriting a block leaves the indices of those above it valid.
    for block in reversed(parse_blocks(text)):
        print(f"running: {block.command}", file=sys.stderr, flush=True)
        fresh = run(block)
        diff = difference(block, fresh, args.readme.name)
        if diff:
            stale.append(f"{block.name}\n{diff}")
        if not args.check and fresh != block.body:
            lines[block.start : block.end] = fresh.splitlines()

    if args.check:
        if stale:
            print(
                f"{len(stale)} block(s) of {args.readme.name} differ; rerun `make docs`:\n",
                file=sys.stderr,
            )
            print("\n\n".join(reversed(stale)), file=sys.stderr)
            return 1
        print(f"{args.readme.name}: every output block is current", file=sys.stderr)
        return 0
    args.readme.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{args.readme.name}: {len(stale)} block(s) changed beyond noise", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
