"""The import structure of `gradaccum`: layers point down, nothing cycles, the surface stays small.

The module graph is read statically from the source (`ast`), so an import counts wherever it is
written: at the top, inside a function, or under `if TYPE_CHECKING:`. Negative controls run the
same collector and cycle finder on synthetic inputs that hold what they must detect.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import gradaccum

PACKAGE = "gradaccum"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE
# The entry point `python -m gradaccum` runs the CLI, so it sits above the core too.
UPPER_LAYERS = ("gradaccum.cli", "gradaccum.experiments", "gradaccum.__main__")
HEAVY = ("transformers", "keras", "tensorflow", "jax", "jaxlib", "matplotlib", "rich", "sklearn")


def _module_files(root: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (`__init__` is the package)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_modules(
    module: str, source: str, *, is_package: bool, known: Iterable[str]
) -> set[str]:
    """Modules of `gradaccum` that `source` imports, anywhere in it.

    `from gradaccum.pkg import name` counts as importing `gradaccum.pkg.name` when that is a
    module, and `gradaccum.pkg` otherwise. Relative imports are resolved against `module`.
    """
    known = set(known)
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in known else target)
    return {name for name in found if name == PACKAGE or name.startswith(PACKAGE + ".")}


def import_graph() -> dict[str, set[str]]:
    """The package's module graph: each module -> the package modules it imports."""
    files = _module_files()
    graph = {}
    for module, path in files.items():
        graph[module] = imported_modules(
            module, path.read_text(), is_package=path.name == "__init__.py", known=files
        )
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A cycle of `graph` as a path `[a, b, ..., a]`, or None if the graph has none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path = [start]
        on_path = {start}
        stack = [iter(sorted(graph.get(start, ())))]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif child in on_path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                path.append(child)
                on_path.add(child)
                stack.append(iter(sorted(graph.get(child, ()))))
    return None


def _in_layer(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


# --- negative controls: the tools find what they must -------------------------------------------


def test_find_cycle_reports_the_cycle_of_a_synthetic_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]
    assert find_cycle({"e": {"a"}, "a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_find_cycle_accepts_an_acyclic_graph():
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a", "b"}}) is None
    assert find_cycle({}) is None


def test_collector_sees_type_checking_function_level_and_relative_imports():
    source = (
        "from __future__ import annotations\n"
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "import gradaccum.loss\n"
        "from . import helper\n"
        "from .sibling import Thing\n"
        "from .. import window\n"
        "from gradaccum import Accumulator\n"
        "if TYPE_CHECKING:\n"
        "    from gradaccum.pkg.runner import Run\n"
        "def late():\n"
        "    from gradaccum.pkg import other\n"
        "    import torch\n"
    )
    known = {
        "gradaccum",
        "gradaccum.loss",
        "gradaccum.window",
        "gradaccum.pkg",
        "gradaccum.pkg.helper",
        "gradaccum.pkg.sibling",
        "gradaccum.pkg.runner",
        "gradaccum.pkg.other",
        "gradaccum.pkg.me",
    }
    found = imported_modules("gradaccum.pkg.me", source, is_package=False, known=known)
    assert found == {
        "gradaccum",
        "gradaccum.loss",
        "gradaccum.window",
        "gradaccum.pkg.helper",
        "gradaccum.pkg.sibling",
        "gradaccum.pkg.runner",
        "gradaccum.pkg.other",
    }
    # In a package's __init__, `from . import x` is relative to the package itself.
    found = imported_modules(
        "gradaccum.pkg",
        "from . import runner\nfrom .missing import y\n",
        is_package=True,
        known=known,
    )
    assert found == {"gradaccum.pkg.runner", "gradaccum.pkg.missing"}
    # A cycle hidden under TYPE_CHECKING is a cycle.
    graph = {
        "gradaccum.pkg.me": {"gradaccum.pkg.runner"},
        "gradaccum.pkg.runner": imported_modules(
            "gradaccum.pkg.runner",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .me import X\n",
            is_package=False,
            known=known,
        ),
    }
    assert find_cycle(graph) == ["gradaccum.pkg.me", "gradaccum.pkg.runner", "gradaccum.pkg.me"]


# --- the package ---------------------------------------------------------------------------------


def test_the_graph_is_read_from_the_package():
    graph = import_graph()
    assert len(graph) >= 40
    # Known edges, one of each kind, so a broken collector cannot pass the checks below vacuously.
    assert "gradaccum.accumulator" in graph["gradaccum"]  # from gradaccum.x import name
    assert "gradaccum.experiments._resume" in graph["gradaccum.experiments.runner"]
    assert "gradaccum.experiments.base" in graph["gradaccum.experiments._resume"]  # TYPE_CHECKING


def test_every_import_of_the_package_names_one_of_its_modules():
    graph = import_graph()
    unknown = {m: sorted(t - set(graph)) for m, t in graph.items() if t - set(graph)}
    assert not unknown, f"imports of modules that do not exist: {unknown}"


def test_no_import_cycle_not_even_under_type_checking():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_core_never_imports_cli_or_experiments():
    graph = import_graph()
    offending = {
        module: sorted(t for t in targets if any(_in_layer(t, up) for up in UPPER_LAYERS))
        for module, targets in graph.items()
        if not any(_in_layer(module, up) for up in UPPER_LAYERS)
    }
    offending = {module: targets for module, targets in offending.items() if targets}
    assert not offending, f"core modules importing cli/experiments: {offending}"


def test_experiments_never_import_the_cli():
    graph = import_graph()
    offending = {
        module: sorted(t for t in targets if _in_layer(t, "gradaccum.cli"))
        for module, targets in graph.items()
        if _in_layer(module, "gradaccum.experiments")
    }
    offending = {module: targets for module, targets in offending.items() if targets}
    assert not offending, f"experiments importing the cli: {offending}"


def test_importing_gradaccum_loads_no_heavy_optional_dependency():
    code = (
        "import sys, gradaccum\n"
        f"heavy = {HEAVY!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]", f"`import gradaccum` loaded {result.stdout.strip()}"


# --- the public surface --------------------------------------------------------------------------


def test_public_surface_is_at_most_twenty_names():
    names = gradaccum.__all__
    assert len(names) <= 20, f"gradaccum.__all__ has {len(names)} names: {names}"
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", gradaccum.__all__)
def test_every_public_name_is_importable(name):
    module = importlib.import_module(PACKAGE)
    assert getattr(module, name) is not None
    namespace: dict[str, object] = {}
    exec(f"from gradaccum import {name}", namespace)  # the way users write it
    assert namespace[name] is getattr(module, name)


@pytest.mark.parametrize("name", ["measure_activation_bytes", "parse_bytes"])
def test_memory_helpers_are_public_in_gradaccum_memory_only(name):
    import gradaccum.memory

    assert name in gradaccum.memory.__all__
    assert callable(getattr(gradaccum.memory, name))
    assert name not in gradaccum.__all__


# --- the layout: module sizes, the command line's weight, no test hooks in the product ----------

SOURCE = Path(gradaccum.__file__).parent


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_every_module_is_at_most_400_lines():
    long = {str(p.relative_to(SOURCE)): _lines(p) for p in SOURCE.rglob("*.py") if _lines(p) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_the_command_line_is_at_most_1500_lines():
    total = sum(_lines(path) for path in (SOURCE / "cli").glob("*.py"))
    assert total <= 1500, f"src/gradaccum/cli/ has {total} lines"


def test_the_product_holds_no_test_hook():
    hooks = [p.name for p in SOURCE.rglob("*.py") if "GRADACCUM_TEST" in p.read_text()]
    assert not hooks, f"test hooks in {hooks}"


def test_experiments_use_only_the_public_engine_modules():
    graph = import_graph()
    private = {
        module: sorted(t for t in targets if t.count(".") and t.split(".")[1].startswith("_"))
        for module, targets in graph.items()
        if _in_layer(module, "gradaccum.experiments")
    }
    allowed = {"gradaccum._install"}  # the wording of install advice, not the engine
    offending = {m: [t for t in ts if t not in allowed] for m, ts in private.items()}
    offending = {m: ts for m, ts in offending.items() if ts}
    assert not offending, f"experiments importing private engine modules: {offending}"
