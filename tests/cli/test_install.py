"""Installing: `python -m gradaccum`, LICENSE, CHANGELOG, and the install advice in errors."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gradaccum
from gradaccum.cli import main

ROOT = Path(__file__).resolve().parents[2]
ADVICE = "(see the README, section Installing)"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def test_python_dash_m_gradaccum_is_the_command():
    done = _run("-m", "gradaccum", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"gradaccum {gradaccum.__version__}"
    done = _run("-m", "gradaccum")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "no command given" in done.stderr


def test_import_without_torch_says_to_install_torch_first():
    # -S: no site-packages, so neither torch nor numpy can be found; gradaccum comes from src/.
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = _run("-S", "-c", "import gradaccum", env=env)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: gradaccum needs PyTorch, which is not installed")
    assert "--index-url https://download.pytorch.org/whl/cpu" in last
    assert last.endswith(ADVICE)


@pytest.mark.parametrize(
    ("command", "missing"), [("demo", "matplotlib"), ("compare", "matplotlib")]
)
def test_a_missing_extra_names_the_pip_command_and_the_readme(
    tmp_path, monkeypatch, capsys, command, missing
):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a)
    )
    args = [command, "--out", str(tmp_path / "out")]
    if command == "compare":
        args += ["--task", "digits", "--configs", "8x1", "--epochs", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{missing}, which is not installed; install it with: " in err
    assert "pip install 'gradaccum[cli]'" in err
    assert err.rstrip().endswith(ADVICE)
    assert not (tmp_path / "out").exists()


def test_license_is_mit_as_pyproject_says():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "Copyright (c) 2026 the gradaccum developers" in text
    assert 'license = { text = "MIT" }' in (ROOT / "pyproject.toml").read_text()


def test_changelog_has_an_unreleased_section():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "keepachangelog.com" in text
    assert "## [Unreleased]" in text


def test_readme_installing_section_puts_torch_first():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Installing", 1)[1].split("\n## ", 1)[0]
    torch_at = section.index("--index-url https://download.pytorch.org/whl/cpu")
    assert torch_at < section.index("pip install 'gradaccum[cli]'")
    for extras in ("cli", "hf", "cli,dev"):
        assert f"pip install 'gradaccum[{extras}]'" in section
