"""Which reading of a batch `gradaccum.batching` splits by, when lists of tensors read two ways.

A list of tensors is first read as a container: each tensor split along `batch_dim`, `[x, y]`
as a DataLoader collates `(x, y)` samples. Read per item instead, it is one entry per item
(`collate_fn=list`: a list of B images or B token sequences). When the first reading fails (the
tensors disagree with the batch's B), the batching falls back to the second (`choose_reading`).

A list of alike tensors with as many rows each reads both ways too. Beside a sequence of as
many records (one target dict per image, torchvision's `(images, targets)`) it is one per item.
Otherwise it is a container, as the API contract reads it ("all tensors share the leading
dimension B"): `(x, y)`, a `TensorDataset`'s columns, Time-Series-Library's `[batch_x, batch_y,
batch_x_mark, batch_y_mark]`, multimodal features, multi-crop views. Only B tensors of different
shapes with B rows each (B clips of B channels), alone, are refused (`ambiguous_list_error`).
A lone list of B token sequences of one length, or of B images of varied sizes, is read as
tensors of S rows too: stack them, or pass a list of dicts or `(items, targets)`.

A `PackedSequence` is split by sequence, each micro-batch repacked from its own sequences
(`packed_leaf`); its tensors describe time steps of all sequences interleaved, not items.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence, pack_sequence, unpack_sequence

from gradaccum._batch_sizes import Path, is_offsets, path_name
from gradaccum._records import (
    ambiguous_list,
    ambiguous_list_error,
    holds_array,
    is_example_list,
    per_item_list,
)

__all__ = [
    "TwoReadings",
    "check_list",
    "choose_reading",
    "flat_tensors",
    "packed_items",
    "packed_leaf",
    "plain",
]

_Reading = tuple[Callable[[int, int], Any], int]


class TwoReadings(Exception):  # noqa: N818 - a signal, caught by `choose_reading`
    """Raised by the first reading at a list of alike tensors that also reads per item."""

    def __init__(self, node: Any, path: Path, dim: int, refused: bool) -> None:
        super().__init__(path_name(path))
        self.node, self.path, self.dim, self.refused = node, path, dim, refused


def plain(tensor: torch.Tensor, dim: int) -> bool:
    """Whether `tensor` is dense, not nested, and has `dim`: the fast path slices it as a view."""
    return tensor.layout is torch.strided and not tensor.is_nested and tensor.ndim > dim


def two_ways(node: Any, dim: int, nested: bool) -> bool | None:
    """Whether a list (nested: or tuple) of alike tensors of as many rows each is refused.

    It reads both ways (True or False); None: one way only. Refused only when nothing else in
    the batch tells the readings apart and it is B tensors of different shapes with B rows each
    (`ambiguous_list`: B clips of B channels). Others are read as rows, the contract's reading:
    fields of one shape (a `TensorDataset`'s columns) or of many (`[batch_x, batch_y, ...]`).
    """
    arrays = (torch.Tensor, np.ndarray)  # numpy: waveforms as librosa loads them
    if not node or not isinstance(node[0], arrays) or node[0].ndim <= dim:
        return None
    rows = node[0].shape[dim]
    if not per_item_list(node, nested) or any(entry.shape[dim] != rows for entry in node):
        return None
    return len(node) == rows and ambiguous_list(node, dim, nested)


def check_list(node: Any, path: Path, dim: int, ask: bool) -> None:
    """With `ask` (the first reading), raise `TwoReadings` at a list that reads both ways.

    `choose_reading` then weighs the two readings of the batch.
    """
    if ask and type(node) in (list, tuple):
        refused = two_ways(node, dim, path != "batch")
        if refused is not None:
            raise TwoReadings(node, path, dim, refused)


def choose_reading(batch: Any, read: Callable[[int, bool], _Reading]) -> _Reading:
    """Return the reading of `batch`: `read(lists, ask)` is the batching's walk.

    `lists` 0 reads lists of tensors as containers, 1 and 2 are the fallbacks; `ask` makes the
    first reading stop at a list that reads both ways (`two_ways`). If both readings then fit,
    it is read per item beside a sequence of as many records (torchvision's `(images,
    targets)`: one target dict per image), else refused if `two_ways` says so (B clips of B
    channels), else as rows: the contract's fields sharing the leading dimension.
    """
    try:
        return read(0, True)
    except TwoReadings as signal:
        found = signal
    except ValueError as error:
        return _fallbacks(read, error)
    try:
        rows = read(0, False)
    except ValueError as error:
        return _fallbacks(read, error)
    try:
        items = read(1, False)
    except ValueError:  # the rest of the batch agrees with the rows: a container
        return rows
    if _holds_records(batch, len(found.node)):
        return items
    if found.refused:
        nested = found.path != "batch"
        raise ambiguous_list_error(found.node, found.path, found.dim, nested)
    return rows  # (x, y), (anchor, positive, negative): fields


def _holds_records(node: Any, size: int, depth: int = 3) -> bool:
    """Whether `node` nests a list or tuple of `size` records of one structure holding tensors.

    Detection targets, one dict of boxes and labels per image; not metadata of numbers and
    strings, which is per item beside fields of as many rows too (2 views of 2 rows).
    """
    if isinstance(node, Mapping):
        entries: Any = node.values()
    elif type(node) in (list, tuple):
        if len(node) == size and is_example_list(list(node)) and holds_array(node[0]):
            return True
        entries = node
    else:
        return False
    return depth > 0 and any(_holds_records(entry, size, depth - 1) for entry in entries)


def _fallbacks(read: Callable[[int, bool], _Reading], error: ValueError) -> _Reading:
    for lists in (1, 2):
        try:
            return read(lists, False)
        except ValueError:
            pass
    raise error from None


def flat_tensors(batch: Any, dim: int) -> list[torch.Tensor] | None:
    """The fast path: the entries of a tuple, list or dict of tensors that agree on B > 0."""
    kind = type(batch)
    if kind is dict:
        values = [] if any(map(is_offsets, batch)) else list(batch.values())  # refused
    elif kind is tuple or kind is list:
        values = batch
    else:
        return None
    if not values or not all(type(v) is torch.Tensor and plain(v, dim) for v in values):
        return None
    size = values[0].shape[dim]
    if kind is list and _two_ways(values, dim):
        return None  # B clips of B channels: the general path weighs both readings
    return values if size and all(v.shape[dim] == size for v in values) else None


def _two_ways(values: list[torch.Tensor], dim: int) -> bool:
    return bool(two_ways(values, dim, False))


def packed_items(node: PackedSequence) -> int:
    """The number of sequences a `PackedSequence` holds."""
    if node.sorted_indices is not None:
        return int(node.sorted_indices.numel())
    return int(node.batch_sizes[0]) if node.batch_sizes.numel() else 0


def packed_slicer(sequences: list[torch.Tensor], keep_sorted: bool) -> Callable[[int, int], Any]:
    """A slicer of sequences `[start, stop)` of a `PackedSequence`, each range packed anew.

    `sequences` are its `unpack_sequence`, in the order given to `pack_sequence`; a packing
    sorted by length (`keep_sorted`: `enforce_sorted=True`) stays sorted in any range of it.
    """

    def slicer(start: int, stop: int) -> Any:
        if start == stop:  # no sequence: an empty packing of the batch's features
            empty = sequences[0][:0] if sequences else torch.zeros(0)
            return PackedSequence(empty, torch.zeros(0, dtype=torch.int64), None, None)
        return pack_sequence(sequences[start:stop], enforce_sorted=keep_sorted)

    return slicer


def packed_leaf(node: PackedSequence, hook: Callable[[Any], Any] | None) -> Any:
    """The slicer of a `PackedSequence` (with `hook`, over its list of sequences)."""
    sequences = unpack_sequence(node)
    if hook is None:
        return packed_slicer(sequences, node.sorted_indices is None)
    return packed_slicer(hook(sequences), keep_sorted=False)  # `take_batch` reorders them
