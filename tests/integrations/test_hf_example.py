"""Smoke test of examples/hf_finetune.py: it runs from a fresh checkout and its loss falls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integrations._hf import import_transformers

import_transformers()

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_finetune.py"


def test_hf_finetune_example_accumulates_and_its_loss_falls() -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "12"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 micro-batches per step" in run.stdout  # the default budget really splits the batch
    assert ": fell" in run.stdout
