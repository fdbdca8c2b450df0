"""The `gradaccum` command line: one module per command, each with `add_parser` and `run`.

Exit codes: 0 success, 1 the command ran but its check failed, 2 bad usage or input (one line on
stderr), 130 interrupted.

Example:
    >>> from gradaccum.cli import main
    >>> main(["--version"])  # doctest: +SKIP
    gradaccum 0.1.0
    0
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn, TextIO

__all__ = ["COMMANDS", "UsageError", "main"]

COMMANDS = ("demo", "train", "compare", "check", "plan")  # each a module of this package

PROG = "gradaccum"


class UsageError(Exception):
    """Bad usage or input found by a command after parsing; `main` reports it and exits 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each command's sub-parser sets `args.run` to its module's `run`."""
    from gradaccum import __version__

    parser = _Parser(
        prog=PROG,
        description="Exact gradient accumulation for PyTorch: tools and demos.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", parser_class=_Parser
    )
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        module.add_parser(subparsers).set_defaults(run=module.run)
    return parser


def _refuse_unknown(parser: argparse.ArgumentParser, command: str | None, args: list[str]) -> None:
    """Exit 2 naming unknown `args`, the command's own --help and the closest option."""
    owner = parser._subparsers._group_actions[0].choices.get(command, parser)  # type: ignore
    options = [name for name in owner._option_string_actions if name.startswith("--")]
    flags = [arg.split("=")[0] for arg in args if arg.startswith("-")]
    close = [match for flag in flags for match in difflib.get_close_matches(flag, options, 1, 0.75)]
    hint = f"; did you mean {close[0]}?" if close else ""
    owner.error(f"unrecognized arguments: {' '.join(args)}{hint}")


def _join_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Write `--option -value` as `--option=-value` for the options that take a value.

    argparse reads a value that starts with "-" and is not a plain number (`-5MiB`, `-1e-3`) as
    another option and says "expected one argument"; joined, the value reaches the option's own
    check, which says what is wrong with it.
    """
    actions = dict(parser._option_string_actions)
    for sub in parser._subparsers._group_actions if parser._subparsers else ():
        for name, command in (getattr(sub, "choices", None) or {}).items():
            if name in argv:
                actions.update(command._option_string_actions)
    joined: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        action = actions.get(token)
        following = argv[index + 1] if index + 1 < len(argv) else None
        if (
            action is not None
            and action.nargs is None
            and token.startswith("--")
            and following is not None
            and following.startswith("-")
            and following not in actions
            and following != "--"
        ):
            joined.append(f"{token}={following}")
            index += 2
            continue
        joined.append(token)
        index += 1
    return joined


class _PipeSafe:
    """A stream whose reader may go away (`gradaccum train | head`): its output is then dropped.

    After a `BrokenPipeError` its descriptor points at /dev/null, so later writes and Python's
    flush at exit succeed: no traceback, and the run goes on.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _pipe_safe_output() -> Iterator[None]:
    """Make `sys.stdout` and `sys.stderr` pipe-safe (see `_PipeSafe`) for the block."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _PipeSafe(sys.stdout), _PipeSafe(sys.stderr)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on `argv` (default `sys.argv[1:]`) and return the exit code."""
    with _pipe_safe_output():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    argv = _join_dash_values(parser, list(sys.argv[1:] if argv is None else argv))
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            _refuse_unknown(parser, args.command, unknown)
    except SystemExit as exit_:  # argparse: --help, --version, or a usage error already printed
        return 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        names = ", ".join(COMMANDS)
        print(
            f"{PROG}: error: no command given; choose one of: {names} (see '{PROG} --help')",
            file=sys.stderr,
        )
        return 2
    from gradaccum._launch import refuse_several_processes
    from gradaccum._open_window import release_interrupted
    from gradaccum.experiments.folders import FolderError

    try:
        refuse_several_processes(f"{PROG} {args.command}", UsageError)  # torchrun: each alone
        return int(args.run(args))
    except (UsageError, FolderError) as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        release_interrupted(interrupt)  # its open window was left on purpose: no warning at exit
        return 130
