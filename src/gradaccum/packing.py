"""Token-budget micro-batches: a window's sequences packed so no micro-batch exceeds N tokens.

A fixed micro-batch size either runs out of memory on the longest sequences or pads the short
ones. `pack_by_tokens` sorts the window's rows by length, longest first, and cuts the sorted rows
into runs whose cost, rows times the run's longest row, stays within `max_tokens` (next-fit
decreasing: a run is as long as the budget allows). Each micro-batch is then trimmed to its own
longest row. Every row lands in exactly one micro-batch, so with sums and counts the step is
still exactly the full-batch step; only the order of the rows changes.

Lengths are read from the nonzero entries of the batch's `attention_mask` (rows must be
right-padded, as Hugging Face pads for training; a packed row's mask may number its documents),
or, without one, taken as the full width. Trimming cuts only the tensors as wide as the mask
(dim 1), and never a scored label: a row reaches at least to its last label that is not -100 in
a tensor named `*labels` as wide as the mask. So labels on their own axis that are as wide by
chance (a seq2seq target, multi-label targets) and scored padding (labels copied from the input
ids) are kept whole, and counted in the budget. A row longer than the budget runs alone, with a
warning (`TokenBudgetWarning`): refusing it would stop a run over one outlier, and splitting a
sequence is not exact.

Example:
    >>> import torch
    >>> mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    >>> batch = {"input_ids": mask * 7, "attention_mask": mask}
    >>> [tuple(mb["input_ids"].shape) for mb in pack_by_tokens(batch, max_tokens=8)]
    [(2, 4), (2, 2)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gradaccum._records import (
    dataclass_entries,
    is_dataclass_instance,
    is_example_list,
)
from gradaccum._warnings import warn_user
from gradaccum.batching import batch_size, map_leaves, slice_batch, take_batch

__all__ = ["TokenBudgetWarning", "check_packable", "pack_by_tokens", "sequence_lengths"]

IGNORE_INDEX = -100  # a label that is not scored: past a row's end, trimming may drop it


class TokenBudgetWarning(UserWarning):
    """A row longer than the token budget runs alone in its micro-batch."""


def sequence_lengths(batch: Any) -> list[int]:
    """Each row's length, else the batch's widest 2-D tensor's width for every row.

    Without a 2-D `attention_mask`, rows of several sequences (`input_ids` of shape (rows,
    choices, seq): multiple choice) count every token of theirs, choices times seq.

    A row's length is its `attention_mask`'s nonzero entries (a packed row's mask may number its
    documents: 1, 1, 2, 2, 0), or more: up to its last scored label (not -100) in a tensor named
    `*labels` as wide as the mask, so that trimming never drops one.

    Raises:
        ValueError: If the attention mask is not right-padded (its nonzeros are not a prefix),
            or is an additive float mask (negative values where padded).
    """
    mask = _mask(batch)
    if mask is not None and mask.is_floating_point() and bool((mask < 0).any()):
        raise ValueError(
            "max_tokens reads each row's length from a 0/1 attention_mask, but this one holds "
            "negative values: an additive mask (0 attended, -inf or a large negative padded) "
            "would be read backwards. Pass the 0/1 mask as attention_mask and build the additive "
            "one inside loss_fn, e.g. (1.0 - mask) * torch.finfo(torch.float32).min."
        )
    if mask is not None:
        # Nonzero is attended, as transformers reads a 2-D mask: a packed row's mask may number
        # its documents (1, 1, 2, 2, 2, 0), and summing those numbers is no length.
        attended = mask != 0
        lengths = attended.sum(dim=1)
        positions = torch.arange(mask.shape[1], device=mask.device)
        if not bool(((positions[None, :] < lengths[:, None]) == attended).all()):
            raise ValueError(
                "max_tokens needs right-padded rows: each attention_mask row must be nonzero "
                "then zeros. Pad on the right (tokenizer.padding_side = 'right')."
            )
        for labels in _labels(batch, mask.shape):  # scored past the mask: kept, and counted
            scored = labels.ne(IGNORE_INDEX).reshape(*mask.shape, -1).any(dim=2)
            reach = torch.where(scored, positions + 1, 0).amax(dim=1)
            lengths = torch.maximum(lengths, reach.to(lengths.device))
        return [int(n) for n in lengths.tolist()]
    width = _full_width(batch)
    return [width] * batch_size(batch)


def pack_by_tokens(batch: Any, max_tokens: int) -> list[Any]:
    """Micro-batches of `batch` (batch-first), each at most `max_tokens` padded tokens.

    Args:
        batch: A batch-first nesting of tensors, arrays and per-item lists (see
            `gradaccum.batching`), with an `attention_mask` for per-row lengths.
        max_tokens: The budget: rows x the micro-batch's longest row, per micro-batch.

    Returns:
        The micro-batches, longest rows first, each trimmed to its longest row.

    Raises:
        ValueError: For a budget that is not a positive int, rows that are not right-padded, or
            extractive QA's `start_positions`/`end_positions` in a batch that would be trimmed.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(
            f"max_tokens={max_tokens!r} must be a positive int: the padded tokens (rows x "
            "longest row) one micro-batch may hold, e.g. max_tokens=8192."
        )
    lengths = sequence_lengths(batch)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep order
    runs: list[tuple[int, int]] = []  # (rows, width) of each micro-batch, in sorted order
    for index in order:
        width = max(lengths[index], 1)
        if runs and (runs[-1][0] + 1) * runs[-1][1] <= max_tokens:
            runs[-1] = (runs[-1][0] + 1, runs[-1][1])
        else:
            runs.append((1, width))
    too_long = [lengths[i] for i in order if lengths[i] > max_tokens]
    if too_long:
        warn_user(
            TokenBudgetWarning(
                f"{len(too_long)} rows are longer than max_tokens={max_tokens} (the longest: "
                f"{too_long[0]} tokens); each runs alone in its own micro-batch."
            )
        )
    mask = _mask(batch)  # without one, every row is as wide as the batch: nothing is trimmed
    full = _full_width(batch) if mask is None else mask.shape[1]
    _refuse_trimmed_spans(batch, sorted({w for _, w in runs if w < full}, reverse=True), full)
    ordered = take_batch(batch, order)  # every leaf the batching splits, by its rules
    micro_batches, start = [], 0
    for rows, width in runs:  # trimmed as read in the whole batch: what is split, by its rules
        trimmed = ordered if width >= full else map_leaves(ordered, _trimmer(full, width))
        micro_batches.append(slice_batch(trimmed, start, start + rows))
        start += rows
    return micro_batches


_SPANS = ("start_positions", "end_positions")  # extractive QA (`*ForQuestionAnswering`)


def _refuse_trimmed_spans(batch: Any, trimmed: list[int], full: int) -> None:
    """Raise for span positions under trimming: their softmax over positions counts the padding.

    A QA head scores every position, padding included, and its cross-entropy normalizes over
    them all: a row trimmed of padding is normalized over fewer logits than in the full batch
    (1.8e-2 off in two steps, silently), wherever its start and end lie.
    """
    spans = [key for key in _SPANS if isinstance(batch, Mapping) and key in batch]
    if trimmed and spans:
        raise ValueError(
            f"step(max_tokens=...) trims micro-batches to their longest row (widths "
            f"{', '.join(map(str, trimmed))}; the batch's is {full}), but the batch holds "
            f"{' and '.join(spans)} (extractive QA): the start and end cross-entropies normalize "
            "over every position, padding included, so a trimmed row's loss would not be the "
            "full batch's (nothing was changed). Use step(batch, loss_fn) with "
            "micro_batch_size= (rows are not trimmed: exact)."
        )


def _mask(batch: Any) -> torch.Tensor | None:
    """The batch's 2-D `attention_mask`, which gives the rows' lengths and the trimmed width."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    return mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None


def _labels(node: Any, shape: torch.Size, name: str = "") -> list[torch.Tensor]:
    """The tensors named `*labels` (keys and fields, at any depth) whose rows are `shape`."""
    if isinstance(node, torch.Tensor):
        wide = name.endswith("labels") and node.ndim >= 2 and node.shape[:2] == shape
        return [node] if wide else []
    if isinstance(node, Mapping):
        entries: Any = node.items()
    elif isinstance(node, tuple) and hasattr(node, "_fields"):
        entries = zip(node._fields, node, strict=True)
    elif is_dataclass_instance(node):
        entries = dataclass_entries(node)
    else:
        return []
    return [t for key, value in entries for t in _labels(value, shape, str(key))]


def _full_width(batch: Any) -> int:
    """The padded width: the largest dim 1 among the batch's 2-D-or-more tensors (1 if none).

    Rows of several sequences, `input_ids` of shape (rows, choices, seq) as a multiple-choice
    head takes them, count all their tokens: their dim 1 is the choices, and a budget read
    from it let micro-batches hold `seq` times more tokens than `max_tokens`.
    """
    widths = [t.shape[1] for t in _tensors(batch) if t.ndim >= 2]
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if isinstance(ids, torch.Tensor) and ids.ndim >= 3:
        widths.append(math.prod(ids.shape[1:]))
    return max(widths, default=1)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in _tensors(value)]
    if isinstance(batch, (list, tuple)) and not is_example_list(batch):
        return [t for value in batch for t in _tensors(value)]
    if is_dataclass_instance(batch):
        return [t for _, value in dataclass_entries(batch) for t in _tensors(value)]
    return []


def _trimmer(full: int, width: int) -> Callable[[Any], Any]:
    """Cut a leaf tensor whose dim 1 is the mask's width `full` to `width` (right padding)."""

    def trim(leaf: Any) -> Any:
        wide = isinstance(leaf, torch.Tensor) and leaf.ndim >= 2 and leaf.shape[1] == full
        return leaf[:, :width] if wide else leaf

    return trim


def check_packable(auto: bool, batch_dim: int, micro_batch_size: object) -> None:
    """Raise unless `Accumulator.step(max_tokens=...)` can pack this Accumulator's batches.

    Raises:
        ValueError: Under automatic sizing (it sizes micro-batches by memory, the budget by
            tokens), or for batches whose items are not at dim 0; nothing has changed.
    """
    if auto:
        raise ValueError(
            f"step(max_tokens=...) sizes micro-batches by a token budget, and micro_batch_size="
            f"{micro_batch_size!r} sizes them by memory: choose one. For token budgets, build the "
            "Accumulator without micro_batch_size (or with an int); for automatic sizing, call "
            "step() without max_tokens."
        )
    if batch_dim != 0:
        raise ValueError(
            f"step(max_tokens=...) packs the rows of batch-first batches, not batch_dim="
            f"{batch_dim}: pass the batch with its items at dim 0 (e.g. x.transpose(0, 1)) to an "
            "Accumulator with batch_dim=0, or split it with micro_batch_size instead."
        )
