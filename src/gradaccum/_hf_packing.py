"""Packed rows for `gradaccum.hf.causal_lm`: where documents start, and the targets that remain.

A row holding several documents marks where each starts: `position_ids` back at 0, or
`cu_seq_lens_q` (the flattened flash-attention offsets). The position before a start belongs to
the previous document, so predicting the next document's first token from it is no target.
A label there that is not the token there (`DataCollatorWithFlattening(separator_id=eos)`)
is a separator the data asks that position to predict: the model's own loss scores it, and so
does the helper.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["document_starts", "packing_of", "shifted"]

IGNORE_INDEX = -100


def packing_of(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `batch` that mark its documents, as `document_starts` takes them."""
    return {
        "position_ids": batch.get("position_ids"),
        "cu_seq_lens": batch.get("cu_seq_lens_q"),
        "attention_mask": batch.get("attention_mask"),
        "input_ids": batch.get("input_ids"),
    }


def shifted(labels: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """The target of each position: the next label, -100 past a row's end or a document's."""
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    if starts is None:
        return targets
    # Position j predicts token j + 1: not when j + 1 opens the next document.
    crosses = F.pad(starts[..., 1:], (0, 1), value=False)
    return targets.masked_fill(crosses, IGNORE_INDEX)


def document_starts(
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    attention_mask: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A bool mask shaped like `labels`: True where a packed row starts a new document.

    A position 0 whose previous position is padding (`attention_mask` 0) starts no new
    document: it is a left-padded row's first token, which the model predicts and scores. With
    `input_ids`, a start whose label is a token other than the one there is a separator target
    (the previous document's end), not a document's first token, so it is kept.

    Raises:
        ValueError: For `cu_seq_lens` that are not offsets of these labels' tokens.
    """
    starts = _starts(labels, position_ids, cu_seq_lens, attention_mask)
    if starts is None or not isinstance(input_ids, torch.Tensor):
        return starts
    if input_ids.shape != labels.shape:
        return starts
    token = input_ids.to(labels.device)
    return starts & ((labels == token) | (labels == IGNORE_INDEX))


def _starts(
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor | None:
    if position_ids is not None:
        starts = (position_ids.to(labels.device) == 0).expand_as(labels)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == labels.shape:
            after_token = F.pad(attention_mask.to(labels.device) != 0, (1, 0), value=True)
            starts = starts & after_token[..., :-1]
        return starts
    if cu_seq_lens is not None:
        bounds = cu_seq_lens.flatten().long()
        flat = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
        if len(bounds) < 2 or bounds[0] or bounds[-1] != len(flat) or (bounds.diff() < 0).any():
            raise ValueError(
                f"cu_seq_lens={bounds.tolist()} are no document offsets of these {len(flat)} "
                f"tokens (0 first, ascending, {len(flat)} last): pass this micro-batch's own, or "
                "position_ids (0 where a document starts), which split with their rows."
            )
        flat[bounds[:-1].to(labels.device)] = True
        return flat.view_as(labels)
    return None
