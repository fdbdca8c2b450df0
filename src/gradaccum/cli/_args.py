r"""Argument value types and error wording shared by the `gradaccum` commands.

The value types are for `argparse`'s `type=`: they raise `argparse.ArgumentTypeError`, whose
message argparse prints on one line after the option's name. The error helpers turn an exception
into one line for a `UsageError`.

Example:
    >>> positive_int("8"), non_negative_int("0"), positive_float("3e-4")
    (8, 0, 0.0003)
    >>> int_or_auto("auto"), byte_count(" 2GiB ")
    ('auto', '2GiB')
    >>> one_line(ValueError("two\n  lines"))
    'two lines'
    >>> error_summary(RuntimeError("first line\nsecond line"))
    'RuntimeError: first line'
    >>> import torch
    >>> before = torch.get_num_threads()
    >>> with torch_threads(1):
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch

from gradaccum.memory import parse_bytes

__all__ = [
    "add_threads_option",
    "byte_count",
    "error_summary",
    "first_line",
    "int_or_auto",
    "non_negative_int",
    "one_line",
    "positive_float",
    "positive_int",
    "torch_threads",
]


def _int_at_least(text: str, minimum: int, requirement: str) -> int:
    """`text` as an int >= `minimum`; otherwise an error saying it `requirement`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} {requirement}")
    return value


def positive_int(text: str) -> int:
    """Argparse type: an int >= 1.

    Raises:
        argparse.ArgumentTypeError: If `text` is not an integer, or is less than 1.
    """
    return _int_at_least(text, 1, "must be a positive integer")


def non_negative_int(text: str) -> int:
    """Argparse type: an int >= 0.

    Raises:
        argparse.ArgumentTypeError: If `text` is not an integer, or is negative.
    """
    return _int_at_least(text, 0, "must be >= 0")


def positive_float(text: str) -> float:
    """Argparse type: a finite float > 0.

    Raises:
        argparse.ArgumentTypeError: If `text` is not a number, or is not finite and positive.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def int_or_auto(text: str) -> int | str:
    """Argparse type: a positive int, or `"auto"`.

    Raises:
        argparse.ArgumentTypeError: If `text` is neither.
    """
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a positive integer nor 'auto'"
        ) from None


def byte_count(text: str) -> str:
    """Argparse type: a byte count that `gradaccum.memory.parse_bytes` accepts, kept as text.

    Returns:
        `text` without surrounding spaces (a `TrainConfig.memory_budget` is a string).

    Raises:
        argparse.ArgumentTypeError: If `parse_bytes` refuses `text`; the message is its reason.
    """
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is negative; give a size of more than 0 bytes, e.g. 512MiB or 2GiB"
        )
    try:
        parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip()


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """Add `--threads N` (torch intra-op threads, default 1) to `parser`."""
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="torch intra-op threads (default: 1; the models are tiny, and more threads on a "
        "shared CPU mostly add synchronization)",
    )


@contextlib.contextmanager
def torch_threads(count: int | None = None) -> Iterator[None]:
    """Run the block with `count` torch intra-op threads; restore the previous count after it.

    Every command that sets threads (`--threads`) runs inside this, so calling a command
    in-process (`gradaccum.cli.main([...])`) leaves the caller's thread count as it was, whether
    the command returns or raises.

    Args:
        count: Threads for the block; None keeps the current count (code in the block may still
            call `torch.set_num_threads`, and is undone all the same).
    """
    previous = torch.get_num_threads()
    try:
        if count is not None:
            torch.set_num_threads(count)
        yield
    finally:
        torch.set_num_threads(previous)


def first_line(error: BaseException) -> str:
    """The first non-blank line of `error`'s message, stripped; `""` if there is none."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else ""


def one_line(error: BaseException) -> str:
    """`error`'s whole message with its white space folded, or its type's name if it is empty.

    For errors of the library, whose message is the reason an input was refused.
    """
    return " ".join(str(error).split()) or type(error).__name__


def error_summary(error: BaseException) -> str:
    """`"<type>: <first line>"` of `error`, or its type's name if its message is empty.

    For errors raised by the user's own code, where the type says much of what went wrong and
    further lines are usually context.
    """
    text = first_line(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
