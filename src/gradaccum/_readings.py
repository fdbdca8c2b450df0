"""Which reading of a batch `gradaccum.batching` splits by, when lists of tensors read two ways.

A list of tensors is first read as a container: each tensor split along `batch_dim`, `[x, y]`
as a DataLoader collates `(x, y)` samples. Read per item instead, it is one entry per item
(`collate_fn=list`: a list of B images or B token sequences). When the first reading fails (the
tensors disagree with the batch's B), the batching falls back to the second (`choose_reading`).

A list of 4 or more alike tensors of one shape, with nothing else in the batch to tell, reads
both ways, and they split differently: read as a container, B token sequences of length S were
taken for S rows of B tensors, and each micro-batch got a few tokens of every sequence, silently
inexact for any model that reads across tokens. Such a list is refused naming both fixes
(`same_shape_error`), unless the rest of the batch agrees with one reading only. Lists of 2 or
3 tensors are containers: `(x, y)` and `(anchor, positive, negative)` samples as collated.

A `PackedSequence` is split by sequence, each micro-batch repacked from its own sequences
(`packed_slicer`); its tensors describe time steps of all sequences interleaved, not items.
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
    is_example_list,
    per_item_list,
)

__all__ = [
    "MIN_ITEMS",
    "SameShapeList",
    "check_list",
    "choose_reading",
    "flat_tensors",
    "packed_items",
    "packed_leaf",
    "plain",
]

MIN_ITEMS = 4  # lists of fewer same-shape tensors are containers: (x, y), (anchor, pos, neg)
_Reading = tuple[Callable[[int, int], Any], int]


class SameShapeList(Exception):  # noqa: N818 - a signal, caught by `choose_reading`
    """Raised by the first reading at a list of same-shape tensors that also reads per item."""

    def __init__(self, node: Any, path: Path, dim: int) -> None:
        super().__init__(path_name(path))
        self.node, self.path, self.dim = node, path, dim


def plain(tensor: torch.Tensor, dim: int) -> bool:
    """Whether `tensor` is dense, not nested, and has `dim`: the fast path slices it as a view."""
    return tensor.layout is torch.strided and not tensor.is_nested and tensor.ndim > dim


def same_shape_list(node: Any, dim: int, nested: bool, least: int = MIN_ITEMS) -> bool:
    """Whether `node` is a list (nested: or tuple) of `least`+ alike tensors of one shape.

    That many items of one size, or that many fields of the same rows: it reads both ways.
    """
    arrays = (torch.Tensor, np.ndarray)  # numpy: waveforms of one length, as librosa loads them
    if len(node) < least or not isinstance(node[0], arrays) or node[0].ndim <= dim:
        return False
    shape = node[0].shape
    return per_item_list(node, nested) and all(entry.shape == shape for entry in node)


def check_list(node: Any, path: Path, dim: int, ask: bool) -> None:
    """Raise if the container `node` also reads as items (the first reading only).

    `AmbiguousListError` for B tensors of different shapes with B rows each; `SameShapeList`
    (if `ask`) for a `same_shape_list`, for `choose_reading` to weigh the two readings.
    """
    nested = path != "batch"
    if type(node) not in (list, tuple):
        return
    if ambiguous_list(node, dim, nested):
        raise ambiguous_list_error(node, path, dim, nested)
    if ask and same_shape_list(node, dim, nested, least=1):
        raise SameShapeList(node, path, dim)


def choose_reading(batch: Any, read: Callable[[int, bool], _Reading]) -> _Reading:
    """Return the reading of `batch`: `read(lists, ask)` is the batching's walk.

    `lists` 0 reads lists of tensors as containers, 1 and 2 are the fallbacks; `ask` makes the
    first reading stop at a list of same-shape tensors. If both readings then fit, the list is
    read per item beside a sequence of as many records (torchvision's `(images, targets)`: one
    target dict per image), as a container if it holds fewer than `MIN_ITEMS`, else refused.
    """
    try:
        return read(0, True)
    except SameShapeList as signal:
        found = signal
    except AmbiguousListError:  # both readings agree with B: no fallback
        raise
    except ValueError as error:
        return _fallbacks(read, error)
    try:
        rows = read(0, False)
    except AmbiguousListError:
        raise
    except ValueError as error:
        return _fallbacks(read, error)
    try:
        items = read(1, False)
    except ValueError:  # the rest of the batch agrees with the rows: a container
        return rows
    if _holds_records(batch, len(found.node)):
        return items
    if len(found.node) < MIN_ITEMS:  # (x, y), (anchor, positive, negative): fields
        return rows
    raise same_shape_error(found.node, found.path, found.dim, rows[1])


def _holds_records(node: Any, size: int, depth: int = 3) -> bool:
    """Whether `node` nests a list or tuple of `size` records of one structure (target dicts)."""
    if isinstance(node, Mapping):
        entries: Any = node.values()
    elif type(node) in (list, tuple):
        if len(node) == size and is_example_list(list(node)):
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


def same_shape_error(node: Any, path: Path, dim: int, rows: int) -> AmbiguousListError:
    """The refusal of a `same_shape_list` that reads both ways, naming both fixes."""
    name, size, shape = path_name(path), len(node), tuple(node[0].shape)
    container = "a dict" if path != "batch" else "a tuple or a dict"
    numpy = isinstance(node[0], np.ndarray)
    kind, stack = ("arrays", "np.stack") if numpy else ("tensors", "torch.stack")
    return AmbiguousListError(
        f"{name} is a {type(node).__name__} of {size} {kind} of one shape {shape}: it reads "
        f"as {size} items (one image or token sequence each, as collate_fn=list makes) and as "
        f"{size} {kind} of {rows} rows each along dim {dim}, which split differently (read as "
        "rows, every micro-batch would get a slice of each item: a few of its tokens or "
        f"channels). gradaccum does not guess: if they are the items, stack them into one "
        f"{kind[:-1]} ({stack}(x), a collate_fn that stacks) or pass a list of dicts; if they "
        f"are {size} {kind} of {rows} rows each, pass them in {container}."
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
    size = values[0].shape[dim]
    if len(values) == size and ambiguous_list(values, dim, False):
        return True
    return same_shape_list(values, dim, False)


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
