r"""Value types for `argparse` and the one-line wording of errors, shared by the commands.

The types raise `argparse.ArgumentTypeError`, which argparse prints on one line after the option.

Example:
    >>> positive_int("8"), non_negative_int("0"), positive_float("3e-4"), int_or_auto("auto")
    (8, 0, 0.0003, 'auto')
    >>> byte_count(" 2GiB "), one_line(ValueError("two\n  lines"))
    ('2GiB', 'two lines')
    >>> error_summary(RuntimeError("first line\nsecond line"))
    'RuntimeError: first line'
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from gradaccum.memory import parse_bytes


def _int_at_least(text: str, minimum: int, requirement: str, below: float = math.inf) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not minimum <= value < below:
        raise argparse.ArgumentTypeError(f"{text!r} {requirement}")
    return value


def path(text: str) -> Path:
    """Argparse type of a path: "" is refused (an unset shell variable), not the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give a path (an unset variable?)")
    return Path(text)


def positive_int(text: str) -> int:
    """Argparse type: an int >= 1."""
    return _int_at_least(text, 1, "must be a positive integer")


def thread_count(text: str) -> int:
    """Argparse type of `--threads`: at most 4 per CPU this process may use."""
    # Thousands crashed OpenBLAS or libgomp; beyond the CPUs, threads only slow torch down.
    value, affinity = positive_int(text), getattr(os, "sched_getaffinity", None)  # not on macOS
    cpus = (len(affinity(0)) if affinity else os.cpu_count()) or 1
    if value > 4 * cpus:
        raise argparse.ArgumentTypeError(
            f"{text!r} is more than 4 threads per CPU: this process may use {cpus} CPU(s); give "
            f"at most {4 * cpus}, best {cpus} (threads beyond the CPUs only slow torch down)"
        )
    return value


def non_negative_int(text: str) -> int:
    """Argparse type: an int >= 0."""
    return _int_at_least(text, 0, "must be >= 0")


def seed(text: str) -> int:
    """Argparse type: 0 to 2**32 - 1 (more overflowed torch's generator, or the epoch order)."""
    return _int_at_least(text, 0, "is not a seed: give an integer from 0 to 4294967295", 2**32)


def positive_float(text: str) -> float:
    """Argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def int_or_auto(text: str) -> int | str:
    """Argparse type: a positive int, or `"auto"`."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a positive integer nor 'auto'"
        ) from None


def byte_count(text: str) -> str:
    """Argparse type: a byte count `gradaccum.memory.parse_bytes` accepts, kept as text."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is negative; give a size of more than 0 bytes, e.g. 512MiB or 2GiB"
        )
    try:
        parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return "".join(text.split())  # "2 GiB" -> "2GiB": one shell word in a printed command


@contextlib.contextmanager
def torch_threads(count: int | None = None) -> Iterator[None]:
    """Run the block with `count` torch threads (None: unchanged); restore the count after it.

    A command run in-process (`gradaccum.cli.main([...])`) so leaves the caller's thread count as
    it was, however it ends.
    """
    previous = torch.get_num_threads()
    try:
        if count is not None:
            torch.set_num_threads(count)
        yield
    finally:
        torch.set_num_threads(previous)


def one_line(error: BaseException) -> str:
    """`error`'s message with its white space folded (or its type's name if empty).

    For the library's errors, whose message is the reason an input was refused.
    """
    return " ".join(str(error).split()) or type(error).__name__


def error_summary(error: BaseException) -> str:
    """`"<type>: <first line>"`: for errors of the user's code, where the type says much."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
