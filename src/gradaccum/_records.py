"""Batch nodes beyond dicts, lists and tuples: dataclasses, uncollated examples, other objects.

`gradaccum.batching` asks three questions here, so that no batch-sized tensor is ever handed
whole to every micro-batch by accident:

- a dataclass instance is a record, like a named tuple: split field by field and rebuilt with
  its own type (`dataclass_entries`, `rebuild_dataclass`);
- a plain list of records of one structure (dicts with the same keys, or instances of one
  dataclass or named tuple, or plain `(x, label)` tuples with a Python label) is a list of
  uncollated examples, one per item (`is_example_list`);
- any other object is a constant, unless its attributes hold tensors or arrays: those are named
  by `object_arrays`, and the batching refuses the object if one of them has B items.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch

from gradaccum._batch_sizes import path_name

__all__ = [
    "SCALARS",
    "AmbiguousListError",
    "ambiguous_list",
    "ambiguous_list_error",
    "any_array",
    "collated_columns",
    "dataclass_entries",
    "is_dataclass_instance",
    "is_example_list",
    "is_record",
    "object_arrays",
    "per_item_list",
    "rebuild_dataclass",
    "rebuild_mapping",
    "rebuild_tuple",
]


SCALARS = (str, int, float, type(None))  # the usual constants, ruled out first
_SCALAR_TYPES = frozenset((str, int, float, bool, type(None)))


def is_dataclass_instance(node: object) -> bool:
    """Whether `node` is an instance (not the class) of a dataclass."""
    return dataclasses.is_dataclass(node) and not isinstance(node, type)


def dataclass_entries(node: Any) -> list[tuple[str, Any]]:
    """The `(name, value)` of every field of the dataclass instance `node`, in order."""
    return [(field.name, getattr(node, field.name)) for field in dataclasses.fields(node)]


def rebuild_dataclass(node: Any, values: dict[str, Any]) -> Any:
    """A copy of the dataclass instance `node` with its fields set to `values`.

    Fields taken by `__init__` are passed to it (`dataclasses.replace`, so `__post_init__` runs
    as for any instance); the others are set on the result where they were split. A dataclass
    that `replace` cannot rebuild (an `InitVar` without a default) is copied and its fields
    set, frozen or not.
    """
    init = {field.name for field in dataclasses.fields(node) if field.init}
    try:
        rebuilt = dataclasses.replace(node, **{k: v for k, v in values.items() if k in init})
    except (TypeError, ValueError):
        rebuilt, init = copy.copy(node), set()
    for name, value in values.items():
        if name not in init and value is not getattr(node, name):  # split: not recomputed
            object.__setattr__(rebuilt, name, value)  # frozen dataclasses too
    return rebuilt


def rebuild_mapping(
    node: Mapping[Any, Any], values: dict[Any, Any], rows: slice | None = None
) -> Any:
    """A mapping of `node`'s type holding `values` (a `defaultdict` keeps its default factory).

    A tokenizer's `BatchEncoding` keeps its per-row `encodings` (what `word_ids()` reads) for
    the rows the values hold: `rows` of them, all with None (the same rows, moved). Values
    whose rows were reordered or trimmed are given `rows=slice(0, 0)`: they keep none.
    """
    kind: Any = type(node)
    if kind is dict:
        return values
    if isinstance(node, collections.defaultdict):
        return kind(node.default_factory, values)
    try:
        rebuilt = kind(values)
    except TypeError as error:  # an `__init__` of its own, e.g. `Batch(x, y)`
        if not isinstance(node, MutableMapping):
            raise TypeError(
                f"gradaccum rebuilds each micro-batch's {kind.__name__} as "
                f"{kind.__name__}(dict_of_its_split_values), which raised: {error}. Give "
                f"{kind.__name__} an __init__ that takes a dict, as dict's does, or pass a dict."
            ) from error
        rebuilt = copy.copy(node)  # its attributes kept; its items replaced
        rebuilt.clear()
        rebuilt.update(values)
    # Read from the instance's own attributes: an attribute-access dict (`__getattr__ =
    # dict.__getitem__`) raises KeyError for a missing one, which getattr's default misses.
    encodings = _own_attribute(node, "_encodings")
    if isinstance(encodings, list) and _own_attribute(rebuilt, "_encodings", ()) is None:
        kept = encodings if rows is None else encodings[rows]
        if kept and (rows is None or rows.stop <= len(encodings)):
            rebuilt._encodings = kept
            rebuilt._n_sequences = _own_attribute(node, "_n_sequences")
    return rebuilt


def rebuild_tuple(node: tuple[Any, ...], values: list[Any]) -> Any:
    """A tuple of `node`'s type (a named tuple, `torch.Size`, a subclass) holding `values`."""
    kind: Any = type(node)
    try:
        return kind(*values) if hasattr(node, "_fields") else kind(values)
    except TypeError as error:  # a `__new__` of its own, e.g. `Pair(x, y)`
        how = "its fields" if hasattr(node, "_fields") else "one list"
        raise TypeError(
            f"gradaccum rebuilds each micro-batch's {kind.__name__} from {how} of its split "
            f"entries, which raised: {error}. Give {kind.__name__} a __new__ that takes "
            f"{how}, as {'namedtuple' if how == 'its fields' else 'tuple'}'s does, or pass a "
            "plain tuple or a dict."
        ) from error


def _own_attribute(node: object, name: str, default: Any = None) -> Any:
    """`node.<name>` from its instance `__dict__`, never through a `__getattr__` of its class."""
    try:
        attributes = object.__getattribute__(node, "__dict__")
    except AttributeError:  # a slotted class
        return default
    return attributes.get(name, default)


def is_example_list(node: Any) -> bool:
    """Whether `node` is a plain list of records of one structure: one uncollated example each.

    Dicts with the same keys, or instances of one dataclass or one named tuple, e.g.
    `[dataset[i] for i in indices]` or a DataLoader with `collate_fn=list`. Their tensors
    describe one example each, so the list is split item by item, never along their first
    dimension. A plain tuple of records stays a container.
    """
    if type(node) is not list or not node:
        return False
    first = node[0]
    if isinstance(first, Mapping):
        keys = first.keys()
        return all(isinstance(entry, Mapping) and entry.keys() == keys for entry in node)
    kind = type(first)
    if is_dataclass_instance(first) or (isinstance(first, tuple) and hasattr(first, "_fields")):
        return all(type(entry) is kind for entry in node)
    return _labelled_pairs(node)


def _labelled_pairs(node: list[Any]) -> bool:
    """Whether `node` is a list of `(image, label)` examples with Python labels.

    Plain tuples of one length, each holding an array and, at one place in every tuple, a
    number or string: what a `Dataset` returning Python labels gives with `collate_fn=list`.
    Read as a container, the arrays' own first dimension (an image's channels, a vector's
    features) passed for the batch's items: a count silently wrong.
    """
    size = len(node[0]) if type(node[0]) is tuple else 0
    if not size or any(type(entry) is not tuple or len(entry) != size for entry in node):
        return False
    if not all(any(isinstance(v, (torch.Tensor, np.ndarray)) for v in entry) for entry in node):
        return False
    labels = (int, float, str)
    return any(all(isinstance(entry[i], labels) for entry in node) for i in range(size))


def per_item_list(node: Any, nested: bool = True) -> bool:
    """A plain list of alike tensors or arrays, or of same-length tuples: per item, if need be.

    Asked only when a batch cannot be read with such lists as containers (their tensors'
    sizes disagree with the batch's B): images of different sizes, `[(x, y), ...]` examples.
    Alike tensors share ndim and dtype: `[x, y]` of 4 and 3 rows is a wrong batch, not 2
    items. Inside a container, a plain tuple of alike tensors or of uncollated examples is
    per item too: torchvision's detection `collate_fn`, `tuple(zip(*batch))`. Dicts are per
    item if they share a key, whatever else they hold: detection targets with `masks` for some
    images only (`[{"x": ...}, {"y": ...}]` shares none: a wrong batch).
    """
    kind = type(node)
    if kind is not list and not (kind is tuple and nested and node):
        return False
    if not node:
        return True
    first = node[0]
    array = type(first)  # a subclass too: torchvision's tv_tensors.Image, BoundingBoxes
    if isinstance(first, (torch.Tensor, np.ndarray)):  # numpy: waveforms as librosa loads them
        return all(
            type(e) is array and e.ndim == first.ndim and e.dtype == first.dtype for e in node
        )
    if isinstance(first, Mapping):  # per-item targets, an optional key in some (`masks`)
        return all(isinstance(e, Mapping) for e in node) and bool(_shared_keys(node))
    if kind is tuple:
        return is_example_list(list(node))
    size = len(first) if type(first) is tuple else -1
    return all(type(entry) is tuple and len(entry) == size for entry in node)


class AmbiguousListError(ValueError):
    """A list that reads both as B items and as a container of B-row tensors: refused."""


def ambiguous_list(node: Any, dim: int, nested: bool) -> bool:
    """Whether `node`, B alike tensors of different shapes with B rows each, reads two ways.

    Read as a container (the first reading), each is split along `dim`: right for fields of B
    rows, wrong for B items whose own first dimension happens to be B (2 stereo clips, 3 RGB
    images of varied sizes, 80 spectrograms of 80 mel bins): their channels went to the
    micro-batches, silently. Different shapes are what makes B items a list at all.
    """
    size = len(node) if type(node) in (list, tuple) else 0
    if size < 2 or not isinstance(node[0], (torch.Tensor, np.ndarray)):
        return False
    if not per_item_list(node, nested):  # alike: one type, ndim and dtype
        return False
    shapes = [tuple(entry.shape) for entry in node]
    return len(shapes[0]) > dim and all(s[dim] == size for s in shapes) and len(set(shapes)) > 1


def ambiguous_list_error(node: Any, path: Any, dim: int, nested: bool) -> AmbiguousListError:
    """The error naming both readings of an `ambiguous_list` and how to say which one is meant."""
    name = path_name(path)
    size, shapes = len(node), ", ".join(str(tuple(entry.shape)) for entry in node[:3])
    container = "a dict" if nested else "a tuple or a dict"
    return AmbiguousListError(
        f"{name} is a {type(node).__name__} of {size} tensors of different shapes ({shapes}"
        f"{', ...' if size > 3 else ''}), each with {size} entries along dim {dim}: it reads as "
        f"{size} items (clips or images of varied sizes, one per item) and as {size} tensors of "
        f"{size} rows each, which split differently (read as rows, each item's channels or mel "
        "bins would go to different micro-batches). gradaccum does not guess: if they are the "
        "items, pass a list of dicts ([{'audio': t} for t in clips]) or pad them into one "
        f"tensor with their lengths; if they are {size} tensors of {size} rows each, pass them "
        f"in {container}."
    )


def _shared_keys(dicts: Sequence[Mapping[Any, Any]]) -> set[Any]:
    """The keys every dict has: none for `[inputs, targets]`, a wrong batch, not 2 items."""
    keys = set(dicts[0])
    for entry in dicts[1:]:
        keys.intersection_update(entry)
    return keys


def object_arrays(node: object, dim: int) -> list[tuple[str, int]]:
    """The attributes of an object that hold tensors or arrays, and their sizes along `dim`.

    A sequence that is not a list or tuple (a range, a deque) is listed itself, with its
    length: one of B entries would reach every micro-batch whole, each entry many times.

    Looks at the object's `__dict__` and `__slots__` and the dicts, lists and tuples in them (two
    levels, 64 entries each: cheap for a tokenizer passed whole); an object without either (a
    number, a string, a C type) holds none. Tensors with
    no `dim` are not listed: they cannot hold the batch's items.
    """
    if isinstance(node, (type, torch.nn.Module)):
        return []
    if isinstance(node, Sequence) and not isinstance(node, (str, bytes, bytearray)):
        return [("", len(node))]
    attributes = dict(getattr(node, "__dict__", None) or {})
    for kind in type(node).__mro__:  # `__slots__` classes (attrs' default) hold no __dict__
        slots = getattr(kind, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(node, name):
                attributes[name] = getattr(node, name)
    return [
        (name, int(array.shape[dim]))
        for key, value in attributes.items()
        for name, array in _arrays(value, f".{key}")
        if array.ndim > dim
    ]


_LOOK = 64  # entries looked at in each container an object holds (a tokenizer's vocab: not all)


def _arrays(value: Any, name: str, depth: int = 2) -> Iterator[tuple[str, Any]]:
    """Tensors and arrays in `value`, through at most `depth` levels of dicts, lists, tuples."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        yield name, value
    elif depth and isinstance(value, Mapping):
        for key, entry in itertools.islice(value.items(), _LOOK):
            yield from _arrays(entry, f"{name}[{key!r}]", depth - 1)
    elif depth and isinstance(value, (list, tuple)):
        for index, entry in enumerate(value[:_LOOK]):
            yield from _arrays(entry, f"{name}[{index}]", depth - 1)


def is_record(node: Any) -> bool:
    """Whether `node` is a tuple subclass (torch.Size, a struct sequence...): never per-item."""
    return isinstance(node, tuple) and type(node) is not tuple


def holds_array(node: Any) -> bool:
    """Whether `node` is, or nests, a tensor or an array (then a list of it is a container)."""
    if isinstance(node, SCALARS):
        return False
    if isinstance(node, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(node, Mapping):
        return any(map(holds_array, node.values()))
    if isinstance(node, (list, tuple)):
        return any_array(node)
    return is_dataclass_instance(node) and any(holds_array(v) for _, v in dataclass_entries(node))


def any_array(entries: list[Any] | tuple[Any, ...]) -> bool:
    """Whether some entry holds a tensor or an array; a list of B strings is scanned in C."""
    return not _SCALAR_TYPES.issuperset(map(type, entries)) and any(map(holds_array, entries))


def collated_columns(node: Any) -> bool:
    """A plain list of plain tuples of one length holding no array: columns, if need be.

    `default_collate` turns a per-sample list of L strings into L tuples of B strings each
    (COCO's 5 captions per image): a container whose tuples are per item. Asked only when the
    batch cannot be read otherwise, since `[(a, b), ...]` is also B pairs, one per item.
    """
    if type(node) is not list or not node or type(node[0]) is not tuple:
        return False
    size = len(node[0])
    return all(type(e) is tuple and len(e) == size for e in node) and not any_array(node)
