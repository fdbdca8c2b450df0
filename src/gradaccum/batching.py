"""Splitting nested batches into micro-batches and moving them to the model's device.

A batch is a tensor, a numpy array, or any nesting of dicts, lists, tuples and dataclasses. Each
leaf follows one rule, so nothing is broadcast by accident:

===============================================  ==============================================
leaf                                             in the micro-batch of items [start, stop)
===============================================  ==============================================
tensor, numpy array, sparse COO tensor or        its slice along ``batch_dim`` (COO, SciPy: a
``scipy.sparse`` matrix                          copy, in its own format)
list or plain tuple holding no tensor or array   ``x[start:stop]``, one entry per item, so its
(strings, ints, dicts of them, token lists...)   length must be B (an empty one counts as 0)
list of dicts with the same keys, or of one      ``x[start:stop]``: uncollated examples, one per
dataclass or named tuple                         item (a plain tuple of them is a container)
list of alike tensors or arrays, same-length     ``x[start:stop]``: one entry per item (images
tuples or dicts sharing a key, or a nested       of varied sizes, ``collate_fn=list`` pairs,
tuple of those, read as a container disagreeing  torchvision's ``tuple(zip(*batch))``, target
with B, or beside as many records (targets)      dicts with a key for some images only)
``PackedSequence``                               its sequences [start, stop), packed anew
other list or plain tuple holding a tensor       a container: rebuilt, each entry by these rules
dict, named tuple, dataclass, tuple subclass     a record: rebuilt with its type, entry by entry
anything else: str, int, float, bool, None...    the same object, whole, in every micro-batch
===============================================  ==============================================

A container or record with nothing to split inside is a constant too. B is the shared size of
the tensors and arrays along ``batch_dim`` (or, with none, of the per-item lists); a disagreement
raises a ValueError naming every path and size. Another object whose attributes hold a tensor of
B items raises a TypeError (make it a dataclass or a dict); nested and sparse CSR tensors too.
A list of tensors of as many rows each reads both ways: beside one target dict per image it is
one image each, else fields of B rows (a `TensorDataset`'s columns, `[batch_x, batch_y, ...]`),
so a lone list of B token sequences of one length or B images of varied sizes is split along
their own first dimension: stack them, or pass a list of dicts. B tensors of different shapes
with B rows each (B clips of B channels) alone are refused naming both fixes. See
`gradaccum._readings`.
A constant of B items (B class names, a B x B matrix) looks per-item and is split: bind constants
to `loss_fn` (a closure, functools.partial). A list of L tuples of B strings each, the layout
`default_collate` makes of a per-sample list (5 captions per image), is read as L per-item
tuples when the batch cannot be read otherwise: with L == B it reads as B per-item tuples, each
micro-batch given whole caption columns; keep such lists per sample (a `collate_fn` that puts
`[s["captions"] for s in samples]` in the batch). Splitting makes views and walks the batch once;
`take_batch` and `map_leaves` reorder and map the leaves by the same rules (`gradaccum.packing`).

Example:
    >>> import torch
    >>> from gradaccum import split_batch
    >>> batch = {"x": torch.zeros(5, 3), "text": list("abcde"), "name": "train"}
    >>> [(len(mb["x"]), mb["text"], mb["name"]) for mb in split_batch(batch, 2)]
    [(2, ['a', 'b'], 'train'), (2, ['c', 'd'], 'train'), (1, ['e'], 'train')]
    >>> split_batch({"x": torch.zeros(4), "text": ["a", "b", "c"]}, 2)
    Traceback (most recent call last):
    ValueError: batch['text'] must hold one entry per item, B=4 (batch['x']: 4, ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from gradaccum._batch_sizes import (
    OBJECT,
    Path,
    Sizes,
    agreed_size,
    array_items,
    check_batch_dim,
    check_micro_batch_size,
    check_not_empty,
    no_tensor_hint,
    refuse_objects,
)
from gradaccum._device import map_tensors, on_device, to_device
from gradaccum._readings import (
    check_list,
    choose_reading,
    flat_tensors,
    packed_items,
    packed_leaf,
    plain,
)
from gradaccum._records import (
    SCALARS,
    any_array,
    collated_columns,
    dataclass_entries,
    is_dataclass_instance,
    is_example_list,
    is_record,
    object_arrays,
    per_item_list,
    rebuild_dataclass,
    rebuild_mapping,
    rebuild_tuple,
)
from gradaccum._sparse_rows import is_scipy_sparse, sparse_slicer, sparse_take, tensor_slicer

__all__ = [
    "batch_size",
    "map_tensors",
    "on_device",
    "slice_batch",
    "map_leaves",
    "split_batch",
    "take_batch",
    "to_device",
]

_Slicer = Callable[[int, int], Any]  # (start, stop) -> that node's items [start, stop)
_Hook = Callable[[Any], Any]  # a leaf -> the leaf its slicer is built over (`map_leaves`)


def split_batch(batch: Any, micro_batch_size: int, *, batch_dim: int = 0) -> list[Any]:
    """Split `batch` into micro-batches of `micro_batch_size` items, by the module's rules.

    Args:
        batch: A tensor, an array, or a nesting of dict/list/tuple (see the module's table).
        micro_batch_size: Items per micro-batch; the last one holds the remainder.
        batch_dim: The items' dimension in every tensor and array, e.g. 1 for `(S, B, E)`.

    Returns:
        `ceil(B / micro_batch_size)` micro-batches with the batch's structure.

    Raises:
        ValueError: If `micro_batch_size` is not a positive int, the batch is empty, or its
            tensors, arrays and per-item lists disagree on B.

    Example:
        >>> import torch
        >>> [t.tolist() for t in split_batch(torch.arange(5), 3)]
        [[0, 1, 2], [3, 4]]
        >>> [t.shape for t in split_batch(torch.zeros(7, 5, 2), 3, batch_dim=1)]
        [torch.Size([7, 3, 2]), torch.Size([7, 2, 2])]
    """
    check_micro_batch_size(micro_batch_size)
    if (split := _split_flat(batch, micro_batch_size, check_batch_dim(batch_dim))) is not None:
        return split
    slicer, size = _plan(batch, batch_dim)
    check_not_empty(size)
    step = micro_batch_size
    return [slicer(i, min(i + step, size)) for i in range(0, size, step)]


def _split_flat(batch: Any, step: int, dim: int) -> list[Any] | None:
    """A tensor, or a tuple, list or dict of them, split by one `torch.split` each."""
    if type(batch) is torch.Tensor:  # views, as slicing gives
        whole = plain(batch, dim) and batch.shape[dim] > 0
        return list(torch.split(batch, step, dim)) if whole else None
    if (flat := flat_tensors(batch, dim)) is None:
        return None
    columns = zip(*[torch.split(tensor, step, dim) for tensor in flat], strict=True)
    if type(batch) is dict:
        return [dict(zip(batch, parts, strict=True)) for parts in columns]
    return [type(batch)(parts) for parts in columns]


def slice_batch(batch: Any, start: int, stop: int, *, batch_dim: int = 0) -> Any:
    """Return the items `[start, stop)` of `batch`, by the rules of `split_batch`.

    `slice_batch(batch, 0, 0)` is the batch's zero-item micro-batch, with its structure.

    Args:
        batch: A tensor, an array, or a nesting of dict/list/tuple (see the module's table).
        start: First item, `0 <= start <= stop`.
        stop: One past the last item, `stop <= B`.
        batch_dim: The items' dimension in every tensor and array.

    Raises:
        ValueError: If the bounds are not ints within `[0, B]`, or the batch's leaves disagree
            on B.

    Example:
        >>> import torch
        >>> slice_batch((torch.arange(6), ["a", "b", "c", "d", "e", "f"]), 1, 3)
        (tensor([1, 2]), ['b', 'c'])
        >>> slice_batch({"x": torch.zeros(4, 2)}, 0, 0)["x"].shape
        torch.Size([0, 2])
    """
    slicer, size = _plan(batch, batch_dim)
    bounds_are_ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop))
    if not (bounds_are_ints and 0 <= start <= stop <= size):
        raise ValueError(
            f"slice_batch(start={start!r}, stop={stop!r}) needs ints with "
            f"0 <= start <= stop <= B={size}."
        )
    return slicer(start, stop)


def map_leaves(batch: Any, fn: Callable[[Any], Any], *, batch_dim: int = 0) -> Any:
    """`batch` rebuilt with `fn` applied to every leaf `split_batch` splits, read by its rules.

    The leaves are tensors and arrays, per-item lists and tuples, and lists of examples; the
    tensors inside a per-item list are not leaves. `fn` must keep each leaf's items.
    """
    slicer, size = _plan(batch, batch_dim, hook=fn)
    return slicer(0, size)


def take_batch(batch: Any, order: list[int], *, batch_dim: int = 0) -> Any:
    """`batch` with its items in `order` (a permutation of `range(B)`), by the same rules.

    `gradaccum.packing` sorts rows this way: every leaf `split_batch` splits is reordered.
    """

    def reorder(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor | np.ndarray):
            if leaf.shape[batch_dim] != len(order):  # a wrong batch: `agreed_size` raises
                return leaf
            if isinstance(leaf, np.ndarray):
                return np.take(leaf, order, axis=batch_dim)
            return leaf.index_select(batch_dim, torch.tensor(order, device=leaf.device))
        if is_scipy_sparse(leaf):
            return sparse_take(leaf, order, batch_dim)
        return type(leaf)([leaf[i] for i in order]) if len(leaf) == len(order) else leaf

    return map_leaves(batch, reorder, batch_dim=batch_dim)


def batch_size(batch: Any, *, batch_dim: int = 0, allow_empty: bool = False) -> int:
    """Return B, the number of items every tensor, array and per-item list of `batch` agrees on.

    Args:
        batch: A tensor, an array, or a nesting of dict/list/tuple (see the module's table).
        batch_dim: The items' dimension in every tensor and array.
        allow_empty: Return 0 for a batch of no items instead of raising.

    Returns:
        B, the number of items.

    Raises:
        ValueError: If the batch holds nothing to split, a tensor without `batch_dim`, leaves
            that disagree on B (the message names their paths), or zero items.

    Example:
        >>> import torch
        >>> batch_size((torch.zeros(4, 2), torch.zeros(4)))
        4
        >>> batch_size({"text": ["a", "b", "c"]}), batch_size(torch.zeros(9, 2), batch_dim=1)
        (3, 2)
    """
    _, size = _plan(batch, batch_dim, build=False)
    if not allow_empty:
        check_not_empty(size)
    return size


def _plan(
    batch: Any, batch_dim: int, build: bool = True, hook: _Hook | None = None
) -> tuple[_Slicer, int]:
    """Return the slicer of `batch` and its B, walking it once; raise naming what is wrong.

    With `build=False` (for `batch_size`) the slicer is a placeholder and no closure is made;
    with `hook`, the slicer is built over `hook(leaf)` for every leaf (`map_leaves`).
    """
    check_batch_dim(batch_dim)
    dense = hook is None and type(batch) is torch.Tensor and plain(batch, batch_dim)
    if dense and batch.shape[batch_dim]:
        return (tensor_slicer(batch, batch_dim) if build else _measured), batch.shape[batch_dim]
    flat = None if hook is not None else flat_tensors(batch, batch_dim)
    if flat is None:  # the general path: as it reads, else by the fallbacks of `_compile`
        return choose_reading(batch, lambda n, ask: _general(batch, batch_dim, build, n, hook, ask))
    size: int = flat[0].shape[batch_dim]
    if not build:
        return _measured, size
    return _container_slicer(batch, [tensor_slicer(t, batch_dim) for t in flat]), size


def _general(
    batch: Any, dim: int, build: bool, lists: int, hook: _Hook | None, ask: bool
) -> tuple[_Slicer, int]:
    sizes: Sizes = []
    slicer = _compile(batch, "batch", dim, sizes, build, lists, hook, ask)
    if slicer is None:
        refuse_objects(sizes, None)
        raise ValueError(
            f"the batch ({type(batch).__name__}) holds no tensor, array or per-item list; "
            "pass a tensor, or a dict/list/tuple of tensors that share the batch dimension."
            + no_tensor_hint(batch)
        )
    return slicer, agreed_size(sizes, dim)


def _compile(
    node: Any,
    path: Path,
    dim: int,
    sizes: Sizes,
    build: bool,
    tensor_lists: int = 0,
    hook: _Hook | None = None,
    ask: bool = False,
) -> _Slicer | None:
    """Return the slicer of `node` (None if it is a constant), recording its leaves' sizes.

    Fallbacks, tried only when the batch cannot be read otherwise: with `tensor_lists` >= 1,
    lists of alike tensors or of tuples (`per_item_list`) are one entry per item (images of
    varied sizes); with 2, a list of tuples of strings is columns (`collated_columns`). With
    `ask`, a list of same-shape tensors stops the walk (`choose_reading` weighs both readings).
    """
    if isinstance(node, SCALARS):
        return None
    if isinstance(node, torch.Tensor):
        sizes.append((path, array_items(node, path, dim, "tensor"), "tensor"))
        return tensor_slicer(_hooked(node, hook), dim) if build else _measured
    if is_scipy_sparse(node):  # split by rows, in its format; it was passed whole
        sizes.append((path, array_items(node, path, dim, "array"), "array"))
        return sparse_slicer(_hooked(node, hook), dim) if build else _measured
    if isinstance(node, np.ndarray):
        sizes.append((path, array_items(node, path, dim, "array"), "array"))
        if not build:
            return _measured
        node = _hooked(node, hook)
        lead = (slice(None),) * dim
        return lambda start, stop: node[tuple([*lead, slice(start, stop)])]
    if isinstance(node, Mapping):
        entries: Any = node.items()
        template = "[{!r}]"
    elif isinstance(node, PackedSequence):  # sequences, interleaved by time step: repacked
        sizes.append((path, packed_items(node), "tensor"))
        return packed_leaf(node, hook) if build else _measured
    elif isinstance(node, tuple) and hasattr(node, "_fields"):  # a named tuple is a record
        entries, template = zip(node._fields, node, strict=True), ".{}"
    elif tensor_lists > 1 and collated_columns(node):  # a container of per-item tuples
        entries, template = enumerate(node), "[{}]"
    elif is_example_list(node) or (tensor_lists and per_item_list(node, path != "batch")):
        sizes.append((path, len(node), "list of examples"))
        node = _hooked(node, hook)
        return lambda start, stop: node[start:stop]
    elif is_record(node) or (isinstance(node, (list, tuple)) and any_array(node)):
        if not tensor_lists:
            check_list(node, path, dim, ask)
        entries, template = enumerate(node), "[{}]"
    elif isinstance(node, (list, tuple)):  # per-item entries, however many (even none)
        sizes.append((path, len(node), type(node).__name__))
        kind, node = type(node), _hooked(node, hook)
        if kind is list or kind is tuple:
            return lambda start, stop: node[start:stop]
        return lambda start, stop: kind(node[start:stop])
    elif is_dataclass_instance(node):  # a record, like a named tuple
        entries, template = dataclass_entries(node), ".{}"
    else:  # a constant, unless it holds the batch's items (then refused by `agreed_size`)
        held = f"{OBJECT}{type(node).__name__}"
        sizes.extend(((path, "{}", name), n, held) for name, n in object_arrays(node, dim))
        return None
    children = [
        _compile(v, (path, template, k), dim, sizes, build, tensor_lists, hook, ask)
        for k, v in entries
    ]
    if all(child is None for child in children):
        return None
    return _container_slicer(node, children, rows=dim == 0 and hook is None) if build else _measured


def _container_slicer(node: Any, children: list[_Slicer | None], rows: bool = True) -> _Slicer:
    """Return a slicer rebuilding the container `node` from its entries' slicers.

    `rows`: its slices hold rows `start:stop` of dim 0 as they are (not reordered or trimmed).
    """
    kind = type(node)
    if isinstance(node, Mapping):
        keys, entries = list(node), _entries_slicer(list(node.values()), children)
        if kind is dict:
            return lambda start, stop: dict(zip(keys, entries(start, stop), strict=True))
        return lambda a, b: rebuild_mapping(
            node, dict(zip(keys, entries(a, b), strict=True)), slice(a, b) if rows else slice(0, 0)
        )
    if is_dataclass_instance(node):
        names, values = zip(*dataclass_entries(node), strict=True)
        fields = _entries_slicer(values, children)
        return lambda start, stop: rebuild_dataclass(
            node, dict(zip(names, fields(start, stop), strict=True))
        )
    entries = _entries_slicer(node, children)
    if kind is list:
        return entries
    if isinstance(node, tuple) and kind is not tuple:  # named tuples, torch.Size...
        return lambda start, stop: rebuild_tuple(node, entries(start, stop))
    return lambda start, stop: kind(entries(start, stop))


def _entries_slicer(values: Any, children: list[_Slicer | None]) -> _Slicer:
    """Return a slicer of the list of a container's entries; constants are kept as they are."""
    live = [child for child in children if child is not None]
    if len(live) == len(children):  # e.g. (inputs, targets): nothing constant
        return lambda start, stop: [child(start, stop) for child in live]
    pairs = list(zip(children, values, strict=True))
    return lambda start, stop: [v if child is None else child(start, stop) for child, v in pairs]


def _measured(start: int, stop: int) -> Any:
    raise AssertionError("a batch measured by batch_size has no slicer")


def _hooked(leaf: Any, hook: _Hook | None) -> Any:
    return leaf if hook is None else hook(leaf)
