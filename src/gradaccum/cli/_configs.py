"""The configs `gradaccum compare` takes: `MxK` (micro-batches of M, K steps) or `B@Nt`.

`MxK` trains an effective batch of M*K items split into K micro-batches of M. `B@Nt` trains an
effective batch of B items packed by a token budget of N: rows sorted by length, then packed so
that no micro-batch holds more than N padded tokens (rows x its longest row); see
`gradaccum.packing.pack_by_tokens`. Both read back as a `ConfigSpec`.

Example:
    >>> parse_config("8x2")
    ConfigSpec(batch_size=16, micro_batch_size=8, max_tokens=None)
    >>> parse_config("64@2048t")
    ConfigSpec(batch_size=64, micro_batch_size=None, max_tokens=2048)
    >>> parse_config_label("8x2")
    (8, 2)
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from gradaccum.cli import UsageError

__all__ = ["ConfigSpec", "parse_config", "parse_config_label", "token_budget"]

_CONFIG_PATTERN = re.compile(r"(\d+)x(\d+)")
_BUDGET_PATTERN = re.compile(r"(\d+)@(\d+)t")
_HOW = (
    "write MICROxSTEPS, e.g. 8x2 (micro-batch 8, 2 accumulation steps, effective batch 16), or "
    "BATCH@TOKENSt, e.g. 64@2048t (batch 64 packed into micro-batches of at most 2048 tokens)"
)


@dataclass(frozen=True)
class ConfigSpec:
    """A compare config: the effective batch and how it is cut into micro-batches.

    Attributes:
        batch_size: The effective batch (items per optimizer step).
        micro_batch_size: Items per micro-batch (`MxK`), or None with a token budget.
        max_tokens: The token budget per micro-batch (`B@Nt`), or None.
    """

    batch_size: int
    micro_batch_size: int | None
    max_tokens: int | None


def parse_config_label(text: str) -> tuple[int, int]:
    """Read a compare config `"MxK"`: micro-batch size M and K accumulation steps.

    Args:
        text: The config as written on the command line, e.g. `"8x2"`.

    Returns:
        `(micro_batch_size, accumulation_steps)`; the effective batch is their product.

    Raises:
        UsageError: If `text` is not two positive integers joined by `x`.
    """
    match = _CONFIG_PATTERN.fullmatch(text)
    if match is None:
        raise UsageError(
            f"malformed config {text!r}: write MICROxSTEPS, e.g. 8x2 (micro-batch 8, "
            "2 accumulation steps, effective batch 16)"
        )
    micro, steps = int(match.group(1)), int(match.group(2))
    if micro < 1 or steps < 1:
        raise UsageError(
            f"malformed config {text!r}: micro-batch size and accumulation steps must be >= 1"
        )
    return micro, steps


def parse_config(text: str) -> ConfigSpec:
    """Read a compare config: `"MxK"` or `"B@Nt"` (batch B packed by N tokens).

    Raises:
        UsageError: If `text` is neither, or holds a zero; the message shows both forms.
    """
    budget = _BUDGET_PATTERN.fullmatch(text)
    if budget is not None:
        batch, tokens = int(budget.group(1)), int(budget.group(2))
        if batch < 1 or tokens < 1:
            raise UsageError(
                f"malformed config {text!r}: the batch and the token budget must be >= 1, "
                "e.g. 64@2048t"
            )
        return ConfigSpec(batch, None, tokens)
    if _CONFIG_PATTERN.fullmatch(text) is None:
        raise UsageError(f"malformed config {text!r}: {_HOW}")
    micro, steps = parse_config_label(text)
    return ConfigSpec(micro * steps, micro, None)


def token_budget(text: str) -> int:
    """Argparse type of `--max-tokens`: a positive int, the padded tokens per micro-batch.

    Raises:
        argparse.ArgumentTypeError: If `text` is not an integer >= 1.
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive integer: give the padded tokens (rows x longest row) "
            "one micro-batch may hold, e.g. --max-tokens 2048"
        )
    return value
