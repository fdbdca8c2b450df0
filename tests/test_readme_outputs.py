"""README.md's sample outputs are what the commands print now (scripts/readme_outputs.py).

Each block marked `<!-- output: COMMAND -->` is rerun and compared with the README after the
script's masking of run-to-run noise (durations, throughputs, timestamps, column widths); a
difference fails with a diff and the fix, `make docs`. Measured on 2 shared CPU cores: `check`
about 3 s and `plan` about 4 s run by default; `compare` (6-7 s each) and `demo` (9-11 s) are
marked slow, still part of `make test`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Subcommands fast enough to run in the default selection (about 4 s each, measured).
CHEAP = {"check", "plan", "--help"}


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "readme_outputs", ROOT / "scripts/readme_outputs.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


ro = _load_script()
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = ro.parse_blocks(README)


def _param(block: ro.Block) -> object:
    slow = block.command.split()[1] not in CHEAP
    return pytest.param(block, id=block.command, marks=[pytest.mark.slow] if slow else [])


def test_every_marker_is_well_formed() -> None:
    markers = [line for line in README.splitlines() if line.startswith("<!-- output")]
    assert len(markers) == len(BLOCKS) >= 5  # a marker the pattern misses would go unchecked
    for block in BLOCKS:
        assert block.command.startswith("gradaccum "), block.command
        assert block.body.strip(), f"{block.name}: empty block, run `make docs`"
        if block.lines is not None:
            assert len(block.body.splitlines()) == len(block.lines), block.name


def test_parse_rejects_a_marker_without_its_fence() -> None:
    with pytest.raises(ro.BlockError, match="must be followed"):
        ro.parse_blocks("<!-- output: gradaccum plan -->\n\n```text\nx\n```\n")
    with pytest.raises(ro.BlockError, match="never closed"):
        ro.parse_blocks("<!-- output: gradaccum plan -->\n```text\nx\n")
    with pytest.raises(ro.BlockError, match="bad lines"):
        ro.parse_blocks("<!-- output lines=3-1: gradaccum plan -->\n```text\nx\n```\n")


def test_normalize_ignores_noise_and_nothing_else() -> None:
    row = " 8x1   8   360   0.9805   744.5 KiB      2,684      1.1 s"
    faster = " 8x1   8   360   0.9805   744.5 KiB     12,840      0.2 s"
    assert ro.normalize(row) == ro.normalize(faster)
    assert ro.normalize("results in runs/compare-digits-20261125-035247") == ro.normalize(
        "results in runs/compare-digits-20270101-000000"
    )
    assert ro.normalize("done in 8.9 s, 812 samples/s") == ro.normalize("done in 10 s, 9 samples/s")
    assert ro.normalize(row) != ro.normalize(row.replace("0.9805", "0.9806"))  # a new figure...
    assert ro.normalize(row) != ro.normalize(row.replace("744.5 KiB", "744.6 KiB"))
    # float64 rounding differs with the CPU's kernels; a gap of 1e-9 or more is a real change
    gaps = "max abs diff 2.082e-17  max rel diff 1.369e-15  -> OK"
    assert ro.normalize(gaps) == ro.normalize(gaps.replace("1.369e-15", "5.432e-16"))
    assert ro.normalize(gaps) != ro.normalize(gaps.replace("1.369e-15", "3.1e-09"))


def _differs(body: str, fresh: str) -> bool:
    return bool(ro.difference(ro.Block("gradaccum compare", None, 0, 0, body), fresh))


def test_float32_training_figures_match_loosely_and_nothing_else_does() -> None:
    """...which a run on another CPU gives too: float32 training differs with the kernels."""
    row = "8x1 8 8 360 0.9805 0.9805 744.5 KiB  8x2 16 7.6e-07 equal; 1.1e+11 times the gap"
    assert not _differs(row, row.replace("0.9805", "0.9833").replace("7.6e-07", "7.9e-07"))
    assert not _differs(row, row.replace("1.1e+11", "6.4e+10"))
    assert _differs(row, row.replace("0.9805 0.9805", "0.9500 0.9500"))  # ten items: the code
    assert _differs(row, row.replace("7.6e-07", "7.6e-05"))  # a gap 100 times larger
    assert _differs(row, row.replace("744.5 KiB", "744.6 KiB"))  # memory is counted, exact
    assert _differs(row, row.replace("360", "361"))
    assert _differs(row, row.replace("equal", "differs"))
    assert _differs(row, row + " extra")


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_block_matches_the_command_output(block: ro.Block) -> None:
    diff = ro.difference(block, ro.run(block))
    assert not diff, f"README block `{block.name}` is stale; rerun `make docs`:\n{diff}"
