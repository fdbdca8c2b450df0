"""The `gradaccum` command line.

Each command lives in its own module of this package, named in `COMMANDS`, and exposes two
functions:

- `add_parser(subparsers)`: registers its sub-parser (name, help, options);
- `run(args) -> int`: does the work and returns the exit code.

Exit codes: 0 success, 1 the command ran but its check failed, 2 bad usage or input (with a
one-line message on stderr), 130 interrupted.

Example:
    >>> from gradaccum.cli import main
    >>> main(["--version"])  # doctest: +SKIP
    gradaccum 0.1.0
    0
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["COMMANDS", "UsageError", "main"]

# Command name -> module in this package. Add "train", "compare", "check", "plan" here.
COMMANDS: dict[str, str] = {
    "demo": "demo",
    "train": "train",
    "compare": "compare",
    "check": "check",
    "plan": "plan",
}

PROG = "gradaccum"


class UsageError(Exception):
    """Bad usage or input found by a command after parsing; `main` reports it and exits 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with one sub-parser per command in `COMMANDS`.

    Returns:
        The parser; each command's sub-parser sets `args.run` to its module's `run`.
    """
    from gradaccum import __version__

    parser = _Parser(
        prog=PROG,
        description="Exact gradient accumulation for PyTorch: tools and demos.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", parser_class=_Parser
    )
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"{__name__}.{module_name}")
        sub = module.add_parser(subparsers)
        if sub.prog.split()[-1] != name:
            raise RuntimeError(f"command module {module_name!r} registered {sub.prog!r}")
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `gradaccum` command line.

    Args:
        argv: The arguments after the program name; `sys.argv[1:]` when None.

    Returns:
        The exit code: 0 success, 1 a failed check, 2 bad usage or input, 130 interrupted.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: --help, --version, or a usage error already printed
        if exit_.code is None:
            return 0
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        names = ", ".join(COMMANDS)
        print(
            f"{PROG}: error: no command given; choose one of: {names} (see '{PROG} --help')",
            file=sys.stderr,
        )
        return 2
    try:
        return int(args.run(args))
    except UsageError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
