"""The examples that need an extra say which `pip install` line to run when it is missing.

A newcomer who installed `pip install -e '.[cli,dev]'`, as the README's Installing section says,
and ran `python examples/hf_finetune.py` got a bare `ModuleNotFoundError` traceback; the README
promises that an error about a missing package names the `pip install` line to run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Each module is blocked (None in sys.modules), as if not installed, before the example runs.
RUN_WITHOUT = (
    "import runpy, sys; sys.modules[sys.argv[1]] = None; path = sys.argv[2]; "
    "sys.argv = [path]; runpy.run_path(path, run_name='__main__')"
)


@pytest.mark.parametrize(
    ("example", "module", "extra"),
    [
        ("hf_finetune.py", "transformers", "hf"),
        ("keras_digits.py", "keras", "keras"),
        ("keras_digits.py", "sklearn", "cli"),
    ],
)
def test_an_example_without_its_extra_names_the_install_line(
    example: str, module: str, extra: str
) -> None:
    path = EXAMPLES / example
    if module == "sklearn":  # keras and tensorflow must import for sklearn's turn to come
        pytest.importorskip("keras")
        pytest.importorskip("tensorflow")
    done = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT, module, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    # The last line: TensorFlow, once imported, logs its own lines to stderr first.
    assert done.stderr.strip().splitlines()[-1] == (
        f"examples/{example} needs {module}, which is not installed; install it with: "
        f"pip install 'gradaccum[{extra}]' (see the README, section Installing)"
    )
    assert "Traceback" not in done.stderr
