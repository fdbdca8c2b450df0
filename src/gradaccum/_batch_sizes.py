"""The B of a batch from the sizes of its leaves, and the errors that name every path and size.

`gradaccum.batching` walks a batch once and records, for each leaf it will split (and each
tensor an object it cannot split holds), a path, a number of items and a kind. Here those sizes
must agree on one B, and a disagreement raises a ValueError that names every path and the fix.
A path is built as `(parent path, template, key)` and formatted only when a message needs it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "ARRAY_KINDS",
    "OBJECT",
    "Path",
    "Sizes",
    "agreed_size",
    "array_items",
    "check_batch_dim",
    "check_micro_batch_size",
    "check_not_empty",
    "is_offsets",
    "no_tensor_hint",
    "path_name",
    "refuse_objects",
]

Path = Any  # "batch", or (parent path, template, key): formatted only for an error message
Sizes = list[tuple[Path, int, str]]  # (path, number of items, kind) of every splittable leaf
ARRAY_KINDS = ("tensor", "array")
_LAYOUTS = (torch.strided, torch.sparse_coo)  # what splits: a view, or a copy of sparse rows
OBJECT = "object "  # the kind of a tensor an object holds: never split, so it must not be B


def array_items(array: Any, path: Path, dim: int, kind: str) -> int:
    """The items of a tensor or array along `dim`; raise if it has none or cannot be split."""
    if isinstance(array, torch.Tensor) and (array.is_nested or array.layout not in _LAYOUTS):
        layout = "nested" if array.is_nested else str(array.layout).removeprefix("torch.")
        raise TypeError(
            f"{path_name(path)} is a {layout} tensor, which cannot be split into micro-batches; "
            "pass a dense tensor (a nested one padded with .to_padded_tensor(0.0) and a mask) "
            "or a sparse COO one (.to_sparse_coo())."
        )
    if array.ndim <= dim:
        ones, per_item = "1, " * dim, ""
        if array.ndim == 1:  # e.g. (B,) labels of a (S, B, E) batch
            per_item = (
                f" A per-item {kind} (labels, lengths) needs its items along dim {dim} too: "
                f"give it shape ({ones}B) with x.reshape({ones}-1), or pass a list (x.tolist())."
            )
        elif not dim and not isinstance(path, str):  # `for x, y in dataset`: y a 0-dim label
            per_item = (
                " If the batch is one sample (a Dataset iterated without a DataLoader), batch "
                "it: iterate DataLoader(dataset, batch_size=...) instead."
            )
        raise ValueError(
            f"{path_name(path)} is a {array.ndim}-dim {kind}; every tensor and array in a batch "
            f"needs the batch dimension (batch_dim={dim}).{per_item} Pass per-batch constants "
            f"as Python numbers, or take the {kind} out of the batch and {_BIND}."
        )
    return int(array.shape[dim])


def path_name(path: Path) -> str:
    """Format a path built as (parent, template, key) only when a message needs it."""
    if isinstance(path, str):
        return path
    parent, template, key = path
    return f"{path_name(parent)}{template.format(key)}"


# A Hugging Face DataCollatorWithFlattening batch: one row of documents, plus flash-attention
# kwargs that describe the row (n + 1 document offsets), not items of a batch.
_FLATTENED_HINT = (
    " cu_seq_lens_q/_k and max_length_q/_k (a flattened batch's flash-attention kwargs) describe "
    "the whole row, not items: drop them (position_ids mark the same documents, for the model and "
    "for gradaccum.hf.causal_lm; DataCollatorWithFlattening(return_flash_attn_kwargs=False)) and "
    "give each flattened batch to micro_step()."
)


def agreed_size(sizes: Sizes, dim: int) -> int:
    """Return the B all leaves agree on, else raise naming every path and size."""
    held = [entry for entry in sizes if entry[2].startswith(OBJECT)]
    if held:
        sizes = [entry for entry in sizes if not entry[2].startswith(OBJECT)]
    size = sizes[0][1]
    refuse_offsets(sizes)
    if all(n == size for _, n, _ in sizes):
        refuse_objects(held, size)
        return size
    listing = ", ".join(
        f"{path_name(p)}: {n}" + ("" if k in ARRAY_KINDS else f" ({k})") for p, n, k in sizes
    )
    arrays = {n for _, n, k in sizes if k in ARRAY_KINDS}
    if len(arrays) > 1:
        where = "the leading dimension" if dim == 0 else f"the batch dimension (dim {dim})"
        first = ""
        if dim:  # nn.Transformer's padding masks are (B, S) in a sequence-first batch
            first = (
                f" A batch-first tensor, such as a (B, S) key padding mask, goes in with its "
                f"items at dim {dim}: transposed (x.t()), and back with .t() in loss_fn."
            )
        if any("cu_seq_lens" in path_name(p) for p, _, _ in sizes):
            first += _FLATTENED_HINT
        elif not dim:
            first += _RAGGED_HINT
        raise ValueError(
            f"batch tensors disagree on {where} ({listing}); every tensor and array must have "
            f"the same number of items along dim {dim}.{first} If one is the same for every "
            f"item (class embeddings, a class-by-class matrix), take it out of the batch and "
            f"{_BIND}."
        )
    if not arrays:
        raise ValueError(
            f"per-item lists disagree on the number of items ({listing}); with no tensor in the "
            f"batch, B is their common length. Give each one entry per item. {_CONSTANT}"
        )
    size = arrays.pop()
    wrong = " and ".join(path_name(p) for p, n, _ in sizes if n != size)
    raise ValueError(
        f"{wrong} must hold one entry per item, B={size} ({listing}): a list or tuple holding no "
        f"tensor is split item by item. Make it a tensor or give it {size} entries. {_CONSTANT}"
    )


def is_offsets(key: object) -> bool:
    """Whether a batch key names flash-attention document offsets (cu_seq_lens_q, cu_seqlens)."""
    return isinstance(key, str) and "cu_seq" in key


def refuse_offsets(sizes: Sizes) -> None:
    """Raise for document offsets at the batch's top level, even as long as its B by chance.

    `cu_seq_lens_q` holds n + 1 offsets into the batch's flattened tokens: no entry per item, so
    no split of it is right, and the whole of it describes no micro-batch but the whole batch.
    """
    found = [p for p, _, _ in sizes if type(p) is tuple and p[0] == "batch" and is_offsets(p[2])]
    if found:
        listing = ", ".join(f"{path_name(p)}: {n}" for p, n, _ in sizes)
        raise ValueError(
            f"{path_name(found[0])} holds document offsets into the batch's flattened tokens "
            f"({listing}), not one entry per item: a micro-batch of rows would get offsets cut "
            f"by rows, or the whole batch's.{_FLATTENED_HINT}"
        )


_BIND = "bind it to loss_fn (a closure or functools.partial)"
_RAGGED_HINT = (  # binding those to loss_fn would give every micro-batch the whole batch's
    " If one holds the items' sequences end to end (CTC's 1-D targets of "
    "sum(target_lengths) entries, nn.EmbeddingBag's 1-D input with offsets, a graph "
    "mini-batch's nodes, edge_index and batch vector), it cannot be cut by item: pad it to "
    "(B, max_len), which ctc_loss and nn.EmbeddingBag (padding_idx) take, or pass a list of B "
    "tensors (of per-graph dicts) and concatenate them in loss_fn (offsets: the cumulative sum "
    "of their lengths)."
)
_CONSTANT = (  # a dict or named tuple holding the list would still split it: not a fix
    "If it is the same for every item (class names, a shape), take it out of the batch and "
    f"{_BIND}, or pass its values as a named tuple or a dict of numbers and strings, which "
    "pass whole."
)


def refuse_objects(held: Sizes, size: int | None) -> None:
    """Raise if an object the batching cannot split holds tensors of B items (any, if None)."""
    wrong = [(p, k) for p, n, k in held if size is None or n == size]
    if wrong:
        named = ", ".join(f"{path_name(p)} ({k.removeprefix(OBJECT)} object)" for p, k in wrong)
        verb = "holds" if len(wrong) == 1 else "hold"
        owners = {p[0] for p, _ in wrong}  # a held tensor's path is (object's path, "{}", name)
        ragged = any(len({n for p, n, _ in held if p[0] == owner}) > 1 for owner in owners)
        raise TypeError(
            f"{named} {verb} the batch's items, but gradaccum cannot split that object or count "
            "its items, so step() would hand it whole to every micro-batch (counting each item "
            "many times) and micro_step() could not weigh it by its items. Make it a dataclass "
            "(split field by field), a dict or a named tuple, or pass "
            "its tensors in the batch itself; make a range, deque or array a list (list(x))."
            + (_RAGGED_OBJECT if ragged else "")
        )


# Split field by field, a graph batch's node rows and graph rows disagree: a list of one object
# per item is what splits it (`per_item` lists: `gradaccum.batching`), for step() and micro_step().
_RAGGED_OBJECT = (
    " Its tensors do not all hold one row per item (a graph batch: nodes and graphs, as in PyG's "
    "Batch): pass a list of one object per item instead (batch.to_data_list()), which is split "
    "item by item, and rebuild the micro-batch in loss_fn (Batch.from_data_list(micro_batch)"
    ".to(device): objects are passed as they are, not moved)."
)


def check_not_empty(size: int) -> None:
    """Raise if the batch holds no item."""
    if size == 0:
        raise ValueError("the batch is empty (0 items along the batch dimension); add items.")


def check_micro_batch_size(micro_batch_size: object, name: str = "micro_batch_size") -> int:
    """Return `micro_batch_size` if it is a positive int, else raise a ValueError naming the fix."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        unit = (
            "micro-batches per window" if name == "accumulation_steps" else "items per micro-batch"
        )
        raise ValueError(
            f"{name}={micro_batch_size!r} must be a positive int ({unit}), "
            f"got {type(micro_batch_size).__name__}: pass {name}={_whole(micro_batch_size)}."
        )
    if micro_batch_size <= 0:
        raise ValueError(f"{name}={micro_batch_size} must be a positive int, e.g. {name}=8.")
    return micro_batch_size


def _whole(value: object) -> str:
    """`value` as the positive int it stands for (numpy's 8, 8.0, tensor(8)), else an example."""
    if isinstance(value, bool):  # True is no size anyone meant
        return "8"
    try:
        number = float(value)  # type: ignore[arg-type]  # numpy, tensors: whatever converts
    except (TypeError, ValueError):
        return "8"
    return str(int(number)) if number.is_integer() and number > 0 else "8"


def check_batch_dim(batch_dim: object) -> int:
    """Return `batch_dim` if it is a non-negative int, else raise a ValueError naming the fix."""
    if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0:
        raise ValueError(
            f"batch_dim={batch_dim!r} must be a non-negative int: the items' dimension in "
            "every tensor and array, e.g. batch_dim=1 for sequence-first (S, B, ...) tensors."
        )
    return batch_dim


def no_tensor_hint(batch: object) -> str:
    """The fix for a batch that holds nothing to split, when it is a newcomer's known mistake.

    A function or a model passed as the batch is `step(loss_fn, batch)`, the arguments swapped; a
    DataLoader, generator or other iterator is the whole data, where one batch was meant.
    """
    if callable(batch) and not isinstance(batch, type):  # a function, or an nn.Module
        return (
            " It looks like the loss function or the model: the batch comes first, "
            "acc.step(batch, loss_fn) and acc.micro_step(micro_batch, loss_fn)."
        )
    if hasattr(batch, "__iter__") and not isinstance(batch, (str, bytes, dict, list, tuple)):
        return (
            f" A {type(batch).__name__} is the whole data, not one batch: iterate it, "
            "`for batch in loader: acc.step(batch, loss_fn)` (or acc.micro_step(batch, loss_fn) "
            "with Accumulator(..., accumulation_steps=N) when it yields micro-batches)."
        )
    return ""
