"""Which reading of a batch `gradaccum.batching` splits by, when lists of tensors read two ways.

A list of tensors is first read as a container: each tensor split along `batch_dim`, `[x, y]`
as a DataLoader collates `(x, y)` samples. Read per item instead, it is one entry per item
(`collate_fn=list`: a list of B images or B token sequences). When the first reading fails (the
tensors disagree with the batch's B), the batching falls back to the second (`choose_reading`).

A list of alike tensors with as many rows each reads both ways too, and they split differently:
read as a container, B token sequences of length S were taken for S rows of B tensors, and each
micro-batch got a few tokens of every sequence, silently inexact for any model that reads across
tokens. Beside a sequence of as many records (one target dict per image) it is one per item;
with nothing else in the batch to tell, 4 or more of one shape or of 3+ shapes (B images of
varied sizes), or B of B rows each, are refused naming both fixes (`two_readings_error`).
Others are containers: `(x, y)`, `(anchor, positive, negative)`, a multi-crop list of 2 sizes.

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
    AmbiguousListError,
    ambiguous_list,
    ambiguous_list_error,
    holds_array,
    is_example_list,
    per_item_list,
)

__all__ = [
    "MIN_ITEMS",
    "TwoReadings",
    "check_list",
    "choose_reading",
    "flat_tensors",
    "packed_items",
    "packed_leaf",
    "plain",
]

MIN_ITEMS = 4  # lists of fewer same-shape tensors are containers: (x, y), (anchor, pos, neg)
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

    It reads both ways (True or False); None: one way only. Refused when nothing else in the
    batch tells the readings apart: B of different shapes with B rows each (B clips of B
    channels), or `MIN_ITEMS` or more of one shape (token sequences of one length) or of 3 or
    more shapes (images of varied sizes; a multi-crop list of 2 sizes stays crops). Others
    are read as rows: fields, `(x, y)`.
    """
    arrays = (torch.Tensor, np.ndarray)  # numpy: waveforms as librosa loads them
    if not node or not isinstance(node[0], arrays) or node[0].ndim <= dim:
        return None
    rows = node[0].shape[dim]
    if not per_item_list(node, nested) or any(entry.shape[dim] != rows for entry in node):
        return None
    if len(node) == rows and ambiguous_list(node, dim, nested):
        return True
    shapes = len({tuple(entry.shape) for entry in node})
    return len(node) >= MIN_ITEMS and (shapes == 1 or shapes >= 3)


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
    targets)`: one target dict per image), else refused if `two_ways` says so, else as rows.
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
        raise two_readings_error(found.node, found.path, found.dim)
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


def two_readings_error(node: Any, path: Path, dim: int) -> AmbiguousListError:
    """The refusal of a list that reads both ways (`two_ways`), naming both fixes."""
    name, size, rows = path_name(path), len(node), int(node[0].shape[dim])
    nested = path != "batch"
    if rows == size and ambiguous_list(node, dim, nested):
        return ambiguous_list_error(node, path, dim, nested)
    container = "a dict" if nested else "a tuple or a dict"
    numpy = isinstance(node[0], np.ndarray)
    kind, stack = ("arrays", "np.stack") if numpy else ("tensors", "torch.stack")
    shapes = [tuple(entry.shape) for entry in node]
    if len(set(shapes)) == 1:
        what, items = f"of one shape {shapes[0]}", "one image or token sequence each"
        fix = f"stack them into one {kind[:-1]} ({stack}(x), a collate_fn that stacks)"
    else:
        what = f"of different shapes ({', '.join(map(str, shapes[:3]))}, ...)"
        items = "images or clips of varied sizes, one per item"
        fix = "pad them into one tensor with their sizes"
    return AmbiguousListError(
        f"{name} is a {type(node).__name__} of {size} {kind} {what}: it reads as {size} items "
        f"({items}, as collate_fn=list makes) and as {size} {kind} of {rows} rows each along "
        f"dim {dim}, which split differently (read as rows, every micro-batch would get a "
        "slice of each item: a few of its tokens or channels). gradaccum does not guess: if "
        f"they are the items, {fix} or pass a list of dicts ([{{'x': t}} for t in items]); "
        f"if they are {size} {kind} of {rows} rows each, pass them "
        f"in {container}."
    )


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
        return None  # the general path refuses it, or weighs both readings
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
