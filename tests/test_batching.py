"""Tests for gradaccum.batching: splitting nested batches into micro-batch views."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import gradaccum
from gradaccum import split_batch
from gradaccum.batching import (
    batch_size,
    check_batch_dim,
    check_micro_batch_size,
    map_tensors,
    slice_batch,
    to_device,
)

Pair = namedtuple("Pair", ["inputs", "meta"])
Config = namedtuple("Config", ["lr", "name"])


@pytest.mark.parametrize(
    ("items", "micro_batch_size", "sizes"),
    [
        (10, 3, [3, 3, 3, 1]),
        (10, 5, [5, 5]),
        (10, 10, [10]),
        (10, 64, [10]),
        (4, 1, [1, 1, 1, 1]),
        (1, 7, [1]),
    ],
)
def test_split_sizes_cover_the_batch_in_order(
    items: int, micro_batch_size: int, sizes: list[int]
) -> None:
    batch = torch.arange(items * 2, dtype=torch.float32).reshape(items, 2)
    micro_batches = split_batch(batch, micro_batch_size)
    assert [len(mb) for mb in micro_batches] == sizes
    assert len(micro_batches) == math.ceil(items / micro_batch_size)
    assert torch.equal(torch.cat(micro_batches), batch)


def test_split_makes_views_not_copies() -> None:
    batch = torch.arange(12.0).reshape(6, 2)
    micro_batches = split_batch(batch, 4)
    for start, mb in zip((0, 4), micro_batches, strict=True):
        assert mb.untyped_storage().data_ptr() == batch.untyped_storage().data_ptr()
        assert mb.data_ptr() == batch[start].data_ptr()
    micro_batches[1][0, 0] = -1.0  # writing through a view shows in the batch
    assert batch[4, 0] == -1.0


@pytest.mark.parametrize("dim", [0, 1])
def test_flat_batches_split_as_the_general_path_slices_them(dim: int) -> None:
    """A tensor, tuple, list or dict of tensors takes one `torch.split` per tensor: the same
    views, structure and types as the general path's per-range slices (a namedtuple, which
    takes the general path, is the reference)."""
    pair = namedtuple("pair", "x y")
    x, y = torch.arange(70.0).reshape(5, 7, 2), torch.arange(35).reshape(5, 7)
    x, y = (x, y) if dim == 0 else (x.transpose(0, 1), y.transpose(0, 1))
    reference = split_batch(pair(x, y), 2, batch_dim=dim)
    for batch in (x, (x, y), [x, y], {"x": x, "y": y}):
        parts = split_batch(batch, 2, batch_dim=dim)
        assert len(parts) == len(reference) == math.ceil(x.shape[dim] / 2)
        for part, expected in zip(parts, reference, strict=True):
            leaves = (
                [part]
                if isinstance(part, torch.Tensor)
                else list(part.values() if isinstance(part, dict) else part)
            )
            assert type(part) is type(batch)
            for leaf, want in zip(leaves, expected[: len(leaves)], strict=True):
                assert leaf.shape == want.shape
                assert leaf.stride() == want.stride()
                assert leaf.data_ptr() == want.data_ptr()  # views of the batch, not copies
                assert torch.equal(leaf, want)


def test_nested_batch_keeps_structure_and_non_tensor_leaves() -> None:
    ids = torch.arange(7)
    features = torch.randn(7, 3)
    mask = torch.ones(7, 5, dtype=torch.bool)
    tag = SimpleNamespace(split="train")  # an opaque leaf: handed over as the same object
    batch = {
        "pair": (features, "constant-string"),
        "named": Pair(inputs=[ids, mask], meta=42),
        "tag": tag,
        "ordered": OrderedDict(a=ids),
    }
    micro_batches = split_batch(batch, 3)
    assert len(micro_batches) == 3
    for index, mb in enumerate(micro_batches):
        rows = slice(3 * index, 3 * index + 3)
        assert type(mb) is dict
        assert type(mb["pair"]) is tuple
        assert type(mb["named"]) is Pair
        assert type(mb["named"].inputs) is list
        assert type(mb["ordered"]) is OrderedDict
        assert torch.equal(mb["pair"][0], features[rows])
        assert torch.equal(mb["named"].inputs[0], ids[rows])
        assert torch.equal(mb["named"].inputs[1], mask[rows])
        assert torch.equal(mb["ordered"]["a"], ids[rows])
        # Non-tensor leaves are handed over as they are: the same objects.
        assert mb["pair"][1] == "constant-string"
        assert mb["named"].meta == 42
        assert mb["tag"] is tag
        assert mb["pair"][1] is batch["pair"][1]


@pytest.mark.parametrize("bad", [0, -1, -8])
def test_non_positive_micro_batch_size_is_rejected(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"micro_batch_size={bad} must be a positive int"):
        split_batch(torch.zeros(4, 2), bad)


@pytest.mark.parametrize("bad", [2.5, 2.0, "4", None, True, torch.tensor(2)])
def test_non_int_micro_batch_size_is_rejected(bad: object) -> None:
    with pytest.raises((ValueError, TypeError), match="must be a positive int"):
        split_batch(torch.zeros(4, 2), bad)  # type: ignore[arg-type]


def test_check_micro_batch_size_names_the_argument() -> None:
    assert check_micro_batch_size(3) == 3
    with pytest.raises(ValueError, match="accumulation_steps=0 must be a positive int"):
        check_micro_batch_size(0, "accumulation_steps")


def test_leading_dimension_mismatch_names_both_tensors() -> None:
    batch = {"x": torch.zeros(4, 3), "y": torch.zeros(5)}
    with pytest.raises(ValueError, match="disagree on the leading dimension") as info:
        split_batch(batch, 2)
    message = str(info.value)
    assert "batch['x']: 4" in message
    assert "batch['y']: 5" in message


def test_nested_mismatch_path_is_precise() -> None:
    batch = (torch.zeros(3, 1), {"inner": [torch.zeros(3), torch.zeros(2)]})
    with pytest.raises(ValueError, match=r"batch\[1\]\['inner'\]\[1\]: 2"):
        split_batch(batch, 2)


@pytest.mark.parametrize(
    ("batch", "pattern"),
    [
        (torch.zeros(0, 3), "the batch is empty"),
        ((torch.zeros(0, 3), torch.zeros(0)), "the batch is empty"),
        ({"text": "hello", "n": 3}, "holds no tensor"),
        ([], "the batch is empty"),
        ({"text": []}, "the batch is empty"),
        ({"cfg": Config(0.1, "a"), "n": None}, "holds no tensor"),
        ((torch.zeros(3, 2), torch.tensor(1.0)), "0-dim tensor"),
    ],
    ids=[
        "empty-tensor",
        "empty-tuple",
        "no-tensor",
        "empty-list",
        "empty-per-item-list",
        "constants-only",
        "scalar-leaf",
    ],
)
def test_bad_batches_are_rejected_with_the_fix(batch: object, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        split_batch(batch, 2)


def test_batch_size_reads_the_shared_leading_dimension() -> None:
    assert batch_size(torch.zeros(6, 2)) == 6
    assert batch_size({"a": [torch.zeros(3)], "b": ("s", torch.zeros(3, 9))}) == 3


def test_map_tensors_and_to_device_keep_non_tensors() -> None:
    batch = Pair(inputs={"x": torch.ones(2, 2)}, meta="m")
    doubled = map_tensors(batch, lambda t: t * 2)
    assert type(doubled) is Pair
    assert doubled.meta == "m"
    assert torch.equal(doubled.inputs["x"], torch.full((2, 2), 2.0))
    moved = to_device(batch, torch.device("cpu"))
    assert type(moved) is Pair
    assert moved.inputs["x"].device.type == "cpu"


def test_step_hands_nested_micro_batches_with_non_tensor_leaves() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=2)
    scale = SimpleNamespace(factor=0.5)
    features = torch.randn(5, 3)
    targets = torch.randn(5, 1)
    batch = {"data": (features, targets), "named": Pair(inputs=targets, meta="m"), "cfg": scale}
    seen = []

    def loss_fn(m: torch.nn.Module, mb) -> torch.Tensor:
        seen.append(mb)
        x, y = mb["data"]
        assert mb["cfg"] is scale
        assert mb["named"].meta == "m"
        return torch.nn.functional.mse_loss(m(x), y) * mb["cfg"].factor

    result = acc.step(batch, loss_fn)
    assert result.micro_batches == 3
    assert [len(mb["data"][0]) for mb in seen] == [2, 2, 1]
    assert all(type(mb["named"]) is Pair for mb in seen)
    assert torch.equal(torch.cat([mb["data"][0] for mb in seen]), features)


# --- One rule per leaf: nothing is broadcast by accident ------------------------------------


def _texts(n: int) -> list[str]:
    return [f"item-{i}" for i in range(n)]


def test_per_item_strings_are_split_never_broadcast() -> None:
    """Negative control: the old code handed the whole list to every micro-batch."""
    texts = _texts(5)
    batch = {"input_ids": torch.arange(5), "texts": texts}
    micro_batches = split_batch(batch, 2)
    for mb in micro_batches:
        assert mb["texts"] is not texts  # the old, broadcast behaviour is gone...
        assert len(mb["texts"]) == len(mb["input_ids"])  # ...one text per item instead
        assert mb["texts"] == [texts[i] for i in mb["input_ids"].tolist()]
    assert [t for mb in micro_batches for t in mb["texts"]] == texts


@pytest.mark.parametrize(
    "per_item",
    [
        tuple(_texts(6)),  # e.g. `texts, labels = zip(*samples)` in a collate function
        [3, 1, 4, 1, 5, 9],
        [True, False, True, True, False, False],
        [{"id": i} for i in range(6)],  # dicts holding no tensor
        [[1, 2, 3], [4], [], [5, 6], [7], [8, 9]],  # ragged token ids
        [None, "a", 2, 3.0, (), {"k": [1]}],  # anything without a tensor inside
    ],
    ids=["tuple-of-str", "ints", "bools", "dicts", "ragged-lists", "mixed"],
)
def test_per_item_lists_are_split_along_their_length(per_item: list | tuple) -> None:
    batch = (torch.randn(6, 2), per_item)
    micro_batches = split_batch(batch, 4)
    assert [mb[1] for mb in micro_batches] == [per_item[:4], per_item[4:]]
    assert all(type(mb[1]) is type(per_item) for mb in micro_batches)
    assert micro_batches[0][1][0] is per_item[0]  # the entries themselves are not copied


def test_numpy_arrays_are_split_as_views_not_broadcast() -> None:
    weights = np.arange(12.0).reshape(6, 2)
    batch = {"x": torch.zeros(6, 3), "w": weights}
    micro_batches = split_batch(batch, 4)
    assert [mb["w"].shape for mb in micro_batches] == [(4, 2), (2, 2)]
    assert all(
        mb["w"] is not weights and np.shares_memory(mb["w"], weights) for mb in micro_batches
    )
    np.testing.assert_array_equal(np.concatenate([mb["w"] for mb in micro_batches]), weights)
    pair = split_batch((np.arange(5), np.ones((5, 1))), 2)  # arrays alone fix B too
    assert [len(mb[0]) for mb in pair] == [2, 2, 1]


def test_lists_holding_tensors_stay_containers() -> None:
    x, y = torch.randn(4, 2), torch.arange(4)
    batch = [x, [y, "tag"], {"inner": (y, _texts(4))}]
    (first, second) = split_batch(batch, 2)
    assert type(first) is list
    assert len(first) == 3
    assert torch.equal(second[0], x[2:])
    assert torch.equal(second[1][0], y[2:])
    assert second[1][1] == "tag"  # a constant inside a container is handed over whole
    assert second[2]["inner"][1] == ["item-2", "item-3"]  # a per-item list inside, split


def test_constants_are_handed_over_whole() -> None:
    marker = SimpleNamespace(mode="train")
    cfg = Config(lr=0.1, name="run")  # a named tuple is a record, never a per-item list
    settings = {"scale": 0.5, "tags": Config("a", "b")}
    batch = {
        "x": torch.zeros(5, 1),
        "s": "name",
        "i": 3,
        "f": 0.5,
        "b": True,
        "n": None,
        "o": marker,
        "cfg": cfg,
        "settings": settings,
        "r": range(2),
    }
    for mb in split_batch(batch, 2):
        for key in ("s", "i", "f", "b", "n", "o", "cfg", "settings", "r"):
            assert mb[key] is batch[key], key


def test_tuple_subclasses_are_records_and_list_subclasses_per_item() -> None:
    class Texts(list):
        pass

    x = torch.randn(4, 3)
    maxima = torch.max(x, dim=1)  # a struct sequence (a tuple subclass) of two tensors
    texts, shape = Texts(_texts(4)), x.shape
    batch = {"x": x, "shape": shape, "max": maxima, "texts": texts}
    first, second = split_batch(batch, 2)
    assert second["shape"] is shape  # a torch.Size is a record of constants, not per-item
    assert type(second["max"]) is type(maxima)
    assert torch.equal(second["max"].indices, maxima.indices[2:])
    assert type(first["texts"]) is Texts
    assert first["texts"] == texts[:2]


@pytest.mark.parametrize(
    ("batch", "names"),
    [
        ({"x": torch.zeros(4, 2), "texts": _texts(3)}, ["batch['texts']: 3 (list)"]),
        ({"x": torch.zeros(4, 2), "shape": (32, 32)}, ["batch['shape']: 2 (tuple)"]),
        ({"x": torch.zeros(4, 2), "extras": []}, ["batch['extras']: 0 (list)"]),
        ((torch.zeros(4), {"a": [torch.zeros(4), _texts(5)]}), ["batch[1]['a'][1]: 5 (list)"]),
        (Pair(torch.zeros(4), _texts(2)), ["batch.meta: 2 (list)"]),
        (
            {"x": np.zeros((4, 1)), "a": _texts(3), "b": [1, 2]},
            ["batch['a']: 3 (list)", "batch['b']: 2 (list)"],
        ),
    ],
    ids=["short-list", "constant-tuple", "empty-list", "nested", "named-field", "two-lists"],
)
def test_per_item_list_of_wrong_length_is_refused_naming_path_and_fix(
    batch: object, names: list[str]
) -> None:
    with pytest.raises(ValueError, match="must hold one entry per item, B=4") as info:
        split_batch(batch, 2)
    message = str(info.value)
    assert all(name in message for name in names), message
    assert ": 4" in message  # the tensor's size is named too
    assert "Make it a tensor" in message
    assert "named tuple" in message
    with pytest.raises(ValueError, match="must hold one entry per item"):
        batch_size(batch)


def test_the_fixes_the_batch_errors_name_work() -> None:
    """Each fix an error names, applied as written, makes the batch split. The per-item-list
    error once said to pass a constant "as a dict": a dict HOLDING the list still splits it."""
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="must hold one entry per item") as info:
        split_batch({"x": x, "classes": ["cat", "dog", "bird"]}, 2)
    message = str(info.value)
    assert "bind it to loss_fn (a closure or functools.partial)" in message
    assert "a named tuple or a dict of numbers and strings, which pass whole" in message
    for constant in (Config(0.1, "cat"), {"h": 3, "w": "dog"}):
        micro_batches = split_batch({"x": x, "classes": constant}, 2)
        assert [mb["classes"] for mb in micro_batches] == [constant, constant]
    # Negative control: the list inside a dict or a named tuple is still split item by item.
    for wrapped in ({"names": ["cat", "dog", "bird"]}, Config(["cat", "dog", "bird"], "n")):
        with pytest.raises(ValueError, match="must hold one entry per item"):
            split_batch({"x": x, "classes": wrapped}, 2)
    # A constant tensor of another size, or a 0-dim one: taken out of the batch.
    for batch in ({"x": x, "emb": torch.zeros(10, 2)}, {"x": x, "temperature": torch.tensor(2.0)}):
        with pytest.raises(ValueError, match="out of the batch and bind it to loss_fn"):
            split_batch(batch, 2)
    # Sequence-first: per-item (B,) labels need their items along dim 1, as the error says.
    seq, labels = torch.randn(5, 4, 3), torch.arange(4)
    with pytest.raises(ValueError, match=r"shape \(1, B\) with x\.reshape\(1, -1\)"):
        split_batch({"seq": seq, "y": labels}, 3, batch_dim=1)
    for given, read in ((labels.reshape(1, -1), lambda y: y[0].tolist()), (labels.tolist(), list)):
        micro_batches = split_batch({"seq": seq, "y": given}, 3, batch_dim=1)
        assert [read(mb["y"]) for mb in micro_batches] == [[0, 1, 2], [3]]
    # ... and nn.Transformer's (B, S) key padding mask goes in transposed, as the error says.
    padding = torch.arange(5)[None, :] >= torch.tensor([5, 2, 4, 1])[:, None]  # (B, S)
    with pytest.raises(ValueError, match=r"\(B, S\) key padding mask.*transposed \(x\.t\(\)\)"):
        split_batch({"seq": seq, "padding": padding}, 3, batch_dim=1)
    micro_batches = split_batch({"seq": seq, "padding": padding.t()}, 3, batch_dim=1)
    assert [mb["padding"].t().tolist() for mb in micro_batches] == [
        padding[:3].tolist(),
        padding[3:].tolist(),
    ]


def test_batch_without_tensors_takes_its_size_from_per_item_lists() -> None:
    """The tokenizer-in-the-loss workflow: the loss function turns raw text into tensors."""
    batch = {"text": _texts(5), "label": (0, 1, 0, 1, 1), "lang": "en"}
    assert batch_size(batch) == 5
    micro_batches = split_batch(batch, 2)
    assert [mb["text"] for mb in micro_batches] == [_texts(5)[:2], _texts(5)[2:4], ["item-4"]]
    assert [mb["label"] for mb in micro_batches] == [(0, 1), (0, 1), (1,)]
    assert all(mb["lang"] == "en" for mb in micro_batches)
    assert [len(mb) for mb in split_batch(_texts(3), 2)] == [2, 1]  # a bare list of items


def test_per_item_lists_that_disagree_name_every_path() -> None:
    with pytest.raises(ValueError, match="per-item lists disagree") as info:
        split_batch({"text": _texts(5), "label": [0, 1, 0]}, 2)
    assert "batch['text']: 5 (list)" in str(info.value)
    assert "batch['label']: 3 (list)" in str(info.value)


def test_numpy_and_tensor_mismatch_names_both() -> None:
    with pytest.raises(ValueError, match="disagree on the leading dimension") as info:
        split_batch({"x": torch.zeros(4, 2), "w": np.zeros(3)}, 2)
    assert "batch['x']: 4" in str(info.value)
    assert "batch['w']: 3" in str(info.value)
    with pytest.raises(ValueError, match=r"batch\['w'\] is a 0-dim array"):
        split_batch({"x": torch.zeros(4, 2), "w": np.array(1.0)}, 2)


def _offsets_batch(kind: Any, key: str = "cu_seq_lens_q") -> Any:
    """3 packed rows of 8 tokens holding 2 documents: their n + 1 = 3 offsets are as long as B."""
    ids = torch.arange(24).view(3, 8)
    return kind(input_ids=ids, labels=ids, **{key: torch.tensor([0, 10, 24], dtype=torch.int32)})


@pytest.mark.parametrize("kind", [dict, OrderedDict], ids=["dict", "mapping"])
def test_document_offsets_as_long_as_the_batch_are_refused_not_split_by_rows(kind: Any) -> None:
    """Before, `cu_seq_lens_q` of n + 1 = B entries was split with the rows, silently: a
    micro-batch of rows 0-1 got the offsets [0, 10] of 16 tokens, the next [24] alone."""
    for key in ("cu_seq_lens_q", "cu_seqlens"):
        with pytest.raises(ValueError, match="document offsets into the batch's flattened"):
            split_batch(_offsets_batch(kind, key), 2)
        with pytest.raises(ValueError, match="return_flash_attn_kwargs=False"):
            batch_size(_offsets_batch(kind, key))
    # Control: the same tensor under another name is read as one entry per row, and cut.
    assert split_batch(_offsets_batch(kind, "offsets"), 2)[1]["offsets"].tolist() == [24]
    model = torch.nn.Embedding(24, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    for acc in (
        gradaccum.Accumulator(model, optimizer, micro_batch_size=2),
        gradaccum.Accumulator(model, optimizer, accumulation_steps=2),
    ):
        run = acc.step if acc.micro_batch_size else acc.micro_step
        with pytest.raises(ValueError, match="document offsets"):
            run(_offsets_batch(kind), lambda m, b: m(b["input_ids"]).sum())
        assert torch.equal(model.weight, before)
        assert model.weight.grad is None


# --- batch_dim: sequence-first layouts --------------------------------------------------------


def test_seq_first_tensors_split_on_batch_dim_like_manual_slicing() -> None:
    seq, items, embed = 7, 5, 3
    source = torch.randn(seq, items, embed)
    mask = torch.ones(seq, items, dtype=torch.bool)
    batch = {"src": source, "mask": mask, "ids": _texts(items), "w": np.ones((seq, items))}
    assert batch_size(batch, batch_dim=1) == items
    micro_batches = split_batch(batch, 2, batch_dim=1)
    assert len(micro_batches) == 3
    for start, mb in zip(range(0, items, 2), micro_batches, strict=True):
        stop = min(start + 2, items)
        assert torch.equal(mb["src"], source[:, start:stop])
        assert torch.equal(mb["mask"], mask[:, start:stop])
        assert mb["src"].data_ptr() == source[:, start].data_ptr()  # a view
        assert mb["ids"] == _texts(items)[start:stop]  # lists: along their own length
        assert mb["w"].shape == (seq, stop - start)
        assert np.shares_memory(mb["w"], batch["w"])
    assert torch.equal(torch.cat([mb["src"] for mb in micro_batches], dim=1), source)


def test_batch_dim_applies_to_every_tensor() -> None:
    batch = (torch.zeros(7, 5, 3), torch.zeros(7, 4))  # dim 1 differs: 5 vs 4
    assert batch_size(batch) == 7
    with pytest.raises(ValueError, match=r"disagree on the batch dimension \(dim 1\)") as info:
        split_batch(batch, 2, batch_dim=1)
    assert "batch[0]: 5" in str(info.value)
    assert "batch[1]: 4" in str(info.value)


@pytest.mark.parametrize(
    ("batch", "path"),
    [
        ({"src": torch.zeros(7, 5, 3), "lengths": torch.zeros(5)}, r"batch\['lengths'\]"),
        (torch.zeros(5), "batch"),
        ((np.zeros((3, 5)), np.zeros(5)), r"batch\[1\]"),
    ],
)
def test_tensor_with_too_few_dims_for_batch_dim_is_refused(batch: object, path: str) -> None:
    with pytest.raises(ValueError, match=rf"{path} is a 1-dim (tensor|array).*batch_dim=1"):
        split_batch(batch, 2, batch_dim=1)


@pytest.mark.parametrize("bad", [-1, 1.0, True, "1", None])
def test_batch_dim_must_be_a_non_negative_int(bad: object) -> None:
    for call in (
        lambda: split_batch(torch.zeros(4, 4), 2, batch_dim=bad),  # type: ignore[arg-type]
        lambda: batch_size(torch.zeros(4, 4), batch_dim=bad),  # type: ignore[arg-type]
        lambda: slice_batch(torch.zeros(4, 4), 0, 1, batch_dim=bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError, match="must be a non-negative int"):
            call()
    with pytest.raises(ValueError, match=rf"batch_dim={bad!r} must be a non-negative int"):
        check_batch_dim(bad)
    assert check_batch_dim(1) == 1  # for Accumulator(batch_dim=...) to check it up front


# --- slice_batch ------------------------------------------------------------------------------


def test_slice_batch_returns_the_items_between_start_and_stop() -> None:
    x = torch.arange(12).reshape(6, 2)
    batch = {"x": x, "pair": (x[:, 0], "const"), "text": _texts(6), "w": np.arange(6)}
    part = slice_batch(batch, 2, 5)
    assert torch.equal(part["x"], x[2:5])
    assert part["x"].data_ptr() == x[2].data_ptr()
    assert torch.equal(part["pair"][0], x[2:5, 0])
    assert part["pair"][1] == "const"
    assert part["text"] == _texts(6)[2:5]
    np.testing.assert_array_equal(part["w"], [2, 3, 4])
    seq_first = torch.randn(3, 6, 2)
    assert torch.equal(slice_batch(seq_first, 1, 4, batch_dim=1), seq_first[:, 1:4])


def test_split_batch_equals_consecutive_slices() -> None:
    batch = {"x": torch.randn(7, 2), "t": _texts(7), "c": Config(1, "n")}
    for index, mb in enumerate(split_batch(batch, 3)):
        expected = slice_batch(batch, 3 * index, min(3 * index + 3, 7))
        assert torch.equal(mb["x"], expected["x"])
        assert mb["t"] == expected["t"]
        assert mb["c"] is expected["c"]


def test_zero_item_micro_batch_keeps_the_structure() -> None:
    cfg = Config(0.1, "run")
    batch = {"x": torch.randn(4, 3), "seq": torch.randn(4, 2), "t": tuple(_texts(4)), "cfg": cfg}
    empty = slice_batch(batch, 0, 0)
    assert empty["x"].shape == (0, 3)
    assert empty["seq"].shape == (0, 2)
    assert empty["t"] == ()
    assert empty["cfg"] is cfg
    assert slice_batch(empty, 0, 0)["t"] == ()  # still a consistent batch, of 0 items
    with pytest.raises(ValueError, match="the batch is empty"):
        batch_size(empty)
    seq_first = slice_batch({"src": torch.randn(7, 4, 2)}, 0, 0, batch_dim=1)
    assert seq_first["src"].shape == (7, 0, 2)


@pytest.mark.parametrize(("start", "stop"), [(-1, 2), (3, 2), (0, 5), (0, 2.0), (True, 2)])
def test_slice_batch_refuses_bounds_outside_the_batch(start: object, stop: object) -> None:
    with pytest.raises(ValueError, match=r"0 <= start <= stop <= B=4"):
        slice_batch(torch.zeros(4), start, stop)  # type: ignore[arg-type]


# --- to_device / map_tensors leave the other leaves alone ---------------------------------------


def test_to_device_and_map_tensors_leave_arrays_and_lists_alone() -> None:
    weights, texts = np.ones((3, 2)), _texts(3)
    batch = {"x": torch.ones(3, 2), "w": weights, "t": texts}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["w"] is weights
    assert moved["t"] is texts
    doubled = map_tensors(batch, lambda t: t * 2)
    assert doubled["w"] is weights
    assert doubled["t"] == texts  # rebuilt as today, entries untouched
    assert torch.equal(doubled["x"], torch.full((3, 2), 2.0))


@pytest.mark.parametrize("micro_batch_size", [1, 2, 3, 7])
def test_every_leaf_kind_reassembles_to_the_batch(micro_batch_size: int) -> None:
    items = 7
    batch = OrderedDict(
        x=torch.randn(items, 2),
        pair=(torch.arange(items), np.arange(items)),
        text=_texts(items),
        cfg=Config(0.1, "run"),
        name="train",
    )
    micro_batches = split_batch(batch, micro_batch_size)
    assert all(type(mb) is OrderedDict for mb in micro_batches)
    assert torch.equal(torch.cat([mb["x"] for mb in micro_batches]), batch["x"])
    assert torch.equal(torch.cat([mb["pair"][0] for mb in micro_batches]), batch["pair"][0])
    assert np.concatenate([mb["pair"][1] for mb in micro_batches]).tolist() == list(range(items))
    assert [t for mb in micro_batches for t in mb["text"]] == batch["text"]
    assert all(mb["cfg"] is batch["cfg"] and mb["name"] == "train" for mb in micro_batches)
    sizes = [batch_size(mb) for mb in micro_batches]
    assert sum(sizes) == items
    assert all(len(mb["text"]) == size for mb, size in zip(micro_batches, sizes, strict=True))


# --- Dataclasses, uncollated examples and objects: never broadcast --------------------------


@dataclasses.dataclass
class Features:
    x: torch.Tensor
    y: torch.Tensor
    tag: str = "train"


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenFeatures:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class DerivedFeatures:
    x: torch.Tensor
    y: torch.Tensor
    rows: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.rows = len(self.x)


class Holder:
    """A plain object with tensor attributes: gradaccum cannot know how to rebuild it."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


def _regression(items: int = 7) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(items, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(items, 1, generator=generator, dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1).double()
    return model, x, y


def _fields_mse(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    record = batch["features"]
    if isinstance(record, DerivedFeatures):
        assert record.rows == len(record.x)  # __post_init__ ran on the micro-batch's rows
    return torch.nn.functional.mse_loss(model(record.x), record.y)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


@pytest.mark.parametrize("kind", [Features, FrozenFeatures, DerivedFeatures])
@pytest.mark.parametrize("nest", ["dict", "tuple-in-dict"])
def test_dataclass_batches_are_split_field_by_field_like_named_tuples(
    kind: type, nest: str
) -> None:
    model, x, y = _regression()
    record = kind(x, y)
    batch = {"ids": torch.arange(7), "features": record}
    if nest == "tuple-in-dict":
        batch = {"ids": torch.arange(7), "features": record, "more": (record, "m")}
    micro_batches = split_batch(batch, 3)
    assert [type(mb["features"]) for mb in micro_batches] == [kind] * 3
    assert [len(mb["features"].x) for mb in micro_batches] == [3, 3, 1]
    assert torch.equal(torch.cat([mb["features"].y for mb in micro_batches]), y)
    if kind is Features:
        assert all(mb["features"].tag == "train" for mb in micro_batches)
    # One step equals the plain full-batch step; handing the record whole to every micro-batch
    # (the old behaviour, the negative control) counts every item three times over.
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    _fields_mse(reference, batch).backward()
    ref_opt.step()
    broadcast = copy.deepcopy(model)
    for _ in range(3):  # each micro-batch's mean over all 7 items, weighted by its 3 rows
        (_fields_mse(broadcast, batch) * 3 / 7).backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    result = gradaccum.Accumulator(model, optimizer, micro_batch_size=3).step(batch, _fields_mse)
    assert result.micro_batches == 3
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    full = copy.deepcopy(broadcast)
    full.zero_grad()
    _fields_mse(full, batch).backward()
    torch.testing.assert_close(broadcast.weight.grad, full.weight.grad * 9 / 7)  # 9/7 of it
    assert not torch.allclose(broadcast.weight.grad, full.weight.grad, rtol=1e-3)


def test_dataclass_tensors_are_moved_and_cast_like_any_leaf() -> None:
    record = FrozenFeatures(torch.ones(3, 2, dtype=torch.float32), torch.arange(3))
    doubled = map_tensors({"r": record}, lambda t: t * 2)["r"]
    assert type(doubled) is FrozenFeatures
    assert torch.equal(doubled.x, torch.full((3, 2), 2.0))
    assert type(to_device(record, torch.device("cpu"))) is FrozenFeatures
    model, x, y = _regression()
    batch = {"features": Features(x.float(), y.float())}  # check_equivalence casts to float64
    report = gradaccum.check_equivalence(model.float(), batch, _fields_mse, micro_batch_size=3)
    assert report.ok, report


@pytest.mark.parametrize("holder", ["object", "namespace", "whole-batch"])
def test_objects_holding_the_batch_are_refused_and_nothing_changes(holder: str) -> None:
    model, x, y = _regression()
    held = Holder(x, y) if holder != "namespace" else SimpleNamespace(x=x, y=y)
    batch = held if holder == "whole-batch" else {"ids": torch.arange(7), "features": held}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=3)
    acc.step({"features": Features(x, y)}, _fields_mse)  # optimizer state to protect
    model.weight.grad = torch.full_like(model.weight, 7.0)
    before = _state(model, optimizer)
    with pytest.raises(TypeError, match=r"\.x \(\w+ object\).*Make it a dataclass") as info:
        acc.step(batch, lambda m, b: _fields_mse(m, {"features": b.get("features", b)}))
    assert "every micro-batch" in str(info.value)
    after = _state(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    with pytest.raises(TypeError, match="Make it a dataclass"):
        split_batch(batch, 3)


class GraphBatch:
    """A PyG-like `Batch`: node rows, a node-to-graph vector and one label per graph."""

    def __init__(self, graphs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.x = torch.cat([x for x, _ in graphs])
        self.batch = torch.cat([torch.full((len(x),), i) for i, (x, _) in enumerate(graphs)])
        self.y = torch.stack([y for _, y in graphs])
        self.num_graphs = len(graphs)

    def to_data_list(self) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(x=self.x[self.batch == i], y=self.y[i]) for i in range(self.num_graphs)
        ]


def _graph_loss(model: torch.nn.Module, batch: object) -> torch.Tensor:
    """Graph regression: node outputs summed per graph; a list of graphs is collated here."""
    if isinstance(batch, list):  # the per-item list the refusal names, rebuilt in loss_fn
        batch = GraphBatch([(g.x, g.y) for g in batch])
    assert isinstance(batch, GraphBatch)
    pooled = torch.zeros(batch.num_graphs, 1, dtype=torch.float64)
    pooled = pooled.index_add(0, batch.batch, model(batch.x))
    return torch.nn.functional.mse_loss(pooled, batch.y)


def test_a_graph_batch_object_is_refused_naming_the_per_item_list_that_splits_it() -> None:
    """A graph batch (17 node rows, 7 graphs) was refused with fixes that fail for it: split
    field by field, as a dataclass or dict, its node and graph rows disagree. The refusal, by
    step() and micro_step() alike, changes nothing and names the list of one object per item;
    that list steps as the full batch does (the naive mean of micro-batch means does not)."""
    generator = torch.Generator().manual_seed(5)
    graphs = [
        (
            torch.randn(n, 4, generator=generator, dtype=torch.float64),
            torch.randn(1, generator=generator).double(),
        )
        for n in (2, 3, 1, 4, 2, 2, 3)
    ]
    model, _, _ = _regression()
    graph = GraphBatch(graphs)
    reference = copy.deepcopy(model)
    _graph_loss(reference, graph).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    naive = copy.deepcopy(model)
    for part in (graphs[0:3], graphs[3:6], graphs[6:]):
        (_graph_loss(naive, GraphBatch(part)) / 3).backward()
    torch.optim.SGD(naive.parameters(), lr=0.5).step()

    streamed = copy.deepcopy(model)
    stream = gradaccum.Accumulator(
        streamed, torch.optim.SGD(streamed.parameters(), lr=0.5), accumulation_steps=3
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=3)
    before = _state(model, optimizer)
    for call in (
        lambda: acc.step(graph, _graph_loss),
        lambda: stream.micro_step(graph, _graph_loss),
    ):
        with pytest.raises(TypeError, match=r"every micro-batch.*to_data_list\(\)") as info:
            call()
        assert "from_data_list" in str(info.value)
        assert all(torch.equal(a, b) for a, b in zip(_state(model, optimizer), before, strict=True))
    assert acc.step(graph.to_data_list(), _graph_loss).micro_batches == 3
    for part in (graphs[0:3], graphs[3:6], graphs[6:]):  # a loader of graph micro-batches
        stream.micro_step(GraphBatch(part).to_data_list(), _graph_loss)
    assert stream.flush().stepped is False  # the third micro-batch closed the window
    for got, want, bad, other in zip(
        model.parameters(),
        reference.parameters(),
        naive.parameters(),
        streamed.parameters(),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
        torch.testing.assert_close(other, want, rtol=1e-10, atol=0)
        assert not torch.allclose(bad, want, rtol=1e-10, atol=0)
    with pytest.raises(TypeError, match="Make it a dataclass") as plain:
        split_batch({"ids": torch.arange(7), "h": Holder(torch.zeros(7, 2), torch.zeros(7))}, 3)
    assert "to_data_list" not in str(plain.value)  # rows that agree: no graph-batch hint


@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_a_meta_tensor_in_the_batch_is_refused_naming_it_and_nothing_changes(drive: str) -> None:
    """A meta tensor (built under `with torch.device("meta")`) failed in the move to the model's
    device with torch's bare NotImplementedError "Cannot copy out of meta tensor; no data!"."""
    model, x, y = _regression()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=3, accumulation_steps=2)
    acc.step({"features": Features(x, y)}, _fields_mse)  # optimizer state to protect
    before = _state(model, optimizer)
    batch = {"features": Features(x, y), "mask": torch.ones(7, 5, device="meta")}
    run = acc.step if drive == "step" else acc.micro_step
    with pytest.raises(ValueError, match=r"meta tensor of shape \(3, 5\).*real device"):
        run(batch if drive == "step" else split_batch(batch, 3)[0], _fields_mse)
    assert all(torch.equal(a, b) for a, b in zip(_state(model, optimizer), before, strict=True))
    assert acc.step({"features": Features(x, y)}, _fields_mse).stepped  # the control: real data
    assert to_device(batch, torch.device("meta"))["mask"].is_meta  # meta to meta: no move needed


class SlottedHolder:
    """Like an attrs class (slots by default): no __dict__ to look into."""

    __slots__ = ("name", "x")

    def __init__(self, x: torch.Tensor, name: str) -> None:
        self.x, self.name = x, name


def test_slotted_objects_holding_the_batch_are_refused_too() -> None:
    with pytest.raises(TypeError, match=r"batch\['s'\]\.x \(SlottedHolder object\)"):
        split_batch({"a": torch.zeros(4), "s": SlottedHolder(torch.zeros(4, 2), "t")}, 2)
    constant = SlottedHolder(torch.ones(3), "t")  # 3 weights, not the batch's 4 items
    assert split_batch({"a": torch.zeros(4), "s": constant}, 2)[1]["s"] is constant


def test_sequences_of_b_entries_that_cannot_be_split_are_refused() -> None:
    """A range, deque or array of B entries went whole to every micro-batch: each micro-batch's
    loss saw all B indices (silently wrong). Refused naming the fix, changing nothing; one of
    another length is a constant."""
    import array
    import collections

    model, x, y = _regression()  # 7 items
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=3)
    before = _state(model, optimizer)

    def indexed_mse(m: torch.nn.Module, batch: dict) -> torch.Tensor:
        rows = torch.tensor(list(batch["rows"]))
        return torch.nn.functional.mse_loss(m(x[rows]), y[rows])

    for rows in (range(7), collections.deque(range(7)), array.array("i", range(7))):
        with pytest.raises(TypeError, match=r"batch\['rows'\] \(\w+ object\).*list\(x\)"):
            acc.step({"ids": torch.arange(7), "rows": rows}, indexed_mse)
        after = _state(model, optimizer)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # The named fix: a list is split item by item, and the step is the full-batch step.
    reference = copy.deepcopy(model)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert acc.step({"ids": torch.arange(7), "rows": list(range(7))}, indexed_mse).stepped
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    constant = range(3)  # 3 entries, not the batch's 7: passed whole
    assert split_batch({"ids": torch.arange(7), "c": constant}, 3)[2]["c"] is constant


class AttrDict(dict):
    """An attribute-access dict (EasyDict, `Box`-like): `batch.x`; a missing key is a KeyError."""

    __getattr__ = dict.__getitem__


class FieldsBatch(dict):
    """A dict subclass whose `__init__` takes fields, with an attribute of its own."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, split: str = "train") -> None:
        super().__init__(x=x, y=y)
        self.split = split


class ReadOnlyBatch(Mapping):
    """A read-only mapping built from fields: gradaccum cannot rebuild it from a dict."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._values = {"x": x, "y": y}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def _keys_mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


@pytest.mark.parametrize("kind", [AttrDict, FieldsBatch])
def test_dict_subclasses_with_their_own_getattr_or_init_split_keeping_their_type(
    kind: type,
) -> None:
    """An attribute-access dict crashed every split with `KeyError: '_encodings'` (the
    BatchEncoding lookup went through its `__getattr__`); a dict subclass whose `__init__` takes
    fields failed with its own `missing 1 required positional argument`. Both split as dicts do,
    keeping their type (and attributes), and step as the full batch does."""
    model, x, y = _regression()
    batch = kind(x=x, y=y) if kind is AttrDict else kind(x, y, "val")
    micro_batches = split_batch(batch, 3)
    assert [type(mb) for mb in micro_batches] == [kind] * 3
    assert [len(mb["x"]) for mb in micro_batches] == [3, 3, 1]
    if kind is FieldsBatch:
        assert micro_batches[2].split == "val"
        assert list(batch) == ["x", "y"]  # the batch itself untouched
        assert batch["x"] is x
    assert type(to_device(map_tensors(batch, lambda t: t + 0), torch.device("cpu"))) is kind
    reference = copy.deepcopy(model)
    _keys_mse(reference, {"x": x, "y": y}).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    gradaccum.Accumulator(model, optimizer, micro_batch_size=3).step(batch, _keys_mse)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_a_mapping_or_tuple_that_cannot_be_rebuilt_is_refused_naming_the_fix() -> None:
    """A read-only Mapping built from fields, and a tuple subclass whose `__new__` takes fields,
    failed with their own bare TypeError; refused naming what gradaccum calls and the fix."""
    model, x, y = _regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=3)
    before = _state(model, optimizer)
    with pytest.raises(TypeError, match=r"ReadOnlyBatch an __init__ that takes a dict"):
        acc.step(ReadOnlyBatch(x, y), _keys_mse)
    assert all(torch.equal(a, b) for a, b in zip(_state(model, optimizer), before, strict=True))
    assert acc.step(dict(ReadOnlyBatch(x, y)), _keys_mse).stepped  # the named fix
    with pytest.raises(TypeError, match=r"Give FieldPair a __new__ that takes one list"):
        split_batch({"pair": FieldPair(x, y)}, 3)
    assert type(map_tensors(torch.Size([2, 3]), lambda t: t)) is torch.Size  # records still


class FieldPair(tuple):
    """A tuple subclass whose `__new__` takes its fields (not one iterable, as tuple's)."""

    def __new__(cls, x: torch.Tensor, y: torch.Tensor) -> FieldPair:
        return super().__new__(cls, (x, y))


def test_one_sample_given_as_a_micro_batch_is_refused_naming_the_dataloader() -> None:
    """`for x, y in dataset: acc.micro_step((x, y), loss_fn)`: the 0-dim label was refused as
    a per-batch constant ("pass it as a Python number"), advice that fits a temperature, not an
    unbatched sample. The message now names batching it too; nothing changes."""
    from torch.utils.data import DataLoader, TensorDataset

    model, x, _ = _regression()
    labels = torch.arange(7) % 2
    model = torch.nn.Linear(4, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(model, optimizer, accumulation_steps=2)
    dataset = TensorDataset(x, labels)

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    before = _state(model, optimizer)
    with pytest.raises(ValueError, match=r"batch\[1\] is a 0-dim tensor.*DataLoader\(dataset"):
        acc.micro_step(dataset[0], loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(_state(model, optimizer), before, strict=True))
    steps = [acc.micro_step(b, loss_fn).stepped for b in DataLoader(dataset, batch_size=3)]
    assert steps == [False, True, False]  # the named fix runs
    with pytest.raises(ValueError, match="0-dim tensor") as constant:
        split_batch({"x": x, "temperature": torch.tensor(2.0)}, 3)
    assert "DataLoader" in str(constant.value)  # a scalar in a dict may be a sample's too


def test_defaultdicts_are_rebuilt_with_their_default_factory() -> None:
    counts = defaultdict(int, {"x": torch.arange(5), "inner": defaultdict(list, {"y": _texts(5)})})
    first, _, last = split_batch(counts, 2)
    assert type(first) is defaultdict
    assert first.default_factory is int
    assert first["inner"].default_factory is list
    assert last["inner"]["y"] == ["item-4"]
    moved = to_device(map_tensors(counts, lambda t: t + 1), torch.device("cpu"))
    assert moved.default_factory is int
    assert torch.equal(moved["x"], torch.arange(1, 6))


def test_objects_holding_no_batch_sized_tensor_are_constants() -> None:
    weights = SimpleNamespace(class_weights=torch.ones(3), name="w")
    batch = {"x": torch.zeros(5, 2), "w": weights}
    assert all(mb["w"] is weights for mb in split_batch(batch, 2))
    # A tokenizer-like object is looked into cheaply (not its whole vocabulary), cycles too.
    loop: list = [1]
    loop.append(loop)
    tokenizer = SimpleNamespace(vocab={f"w{i}": i for i in range(100_000)}, loop=loop)
    assert split_batch({"x": torch.zeros(5, 2), "tok": tokenizer}, 2)[0]["tok"] is tokenizer


def _example_mse(model: torch.nn.Module, examples: list) -> torch.Tensor:
    x = torch.stack([example["x"] for example in examples])
    y = torch.stack([example["y"] for example in examples])
    return torch.nn.functional.mse_loss(model(x), y)


def test_uncollated_examples_are_split_one_example_per_item() -> None:
    """`[dataset[i] for i in ...]`: each dict is one item, never sliced along its own dim 0."""
    model, x, y = _regression()
    model = torch.nn.Linear(4, 4).double()
    y = y.expand(7, 4)
    examples = [{"x": x[i], "y": y[i]} for i in range(7)]  # every tensor has 4 rows
    micro_batches = split_batch(examples, 3)
    assert [len(mb) for mb in micro_batches] == [3, 3, 1]
    assert micro_batches[2][0] is examples[6]
    assert batch_size(examples) == 7
    # Negative control: read as a container, the examples' 4 features would be the items.
    sliced = [{k: v[:3] for k, v in example.items()} for example in examples]
    assert len(sliced) == 7
    assert len(sliced[0]["x"]) == 3
    named = [Pair(x[i], "m") for i in range(7)]
    assert [len(mb) for mb in split_batch(named, 4)] == [4, 3]
    reference = copy.deepcopy(model)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    accumulated = copy.deepcopy(model)
    gradaccum.accumulate_grad(accumulated, examples, _example_mse, micro_batch_size=3)
    for got, want in zip(accumulated.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=0)
    containers = (examples[0], examples[1])  # a plain tuple of dicts stays a container
    assert len(split_batch(containers, 3)[0][0]["x"]) == 3


def test_sparse_coo_tensors_split_by_rows_and_other_layouts_are_refused() -> None:
    dense = torch.arange(20.0).reshape(5, 4)
    batch = {"x": torch.zeros(5, 1), "s": dense.to_sparse()}
    parts = [mb["s"].to_dense() for mb in split_batch(batch, 2)]
    assert torch.equal(torch.cat(parts), dense)
    assert batch_size(dense.to_sparse()) == 5
    for bad, name in [(dense.to_sparse_csr(), "sparse_csr"), (_nested(), "nested")]:
        with pytest.raises(TypeError, match=f"batch\\['s'\\] is a {name} tensor.*dense"):
            split_batch({"x": torch.zeros(5, 1), "s": bad}, 2)


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():  # nested tensors are a prototype: torch says so
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(i + 1, 2) for i in range(5)])


def _detection_loss(model: torch.nn.Module, batch: tuple) -> gradaccum.LossSum:
    """Per-image features pooled from images of different sizes, one target dict per image."""
    images, targets = batch
    features = torch.stack([image.mean(dim=(1, 2)) for image in images])
    scores = model(features)
    labels = torch.stack([target["label"] for target in targets])
    value = torch.nn.functional.cross_entropy(scores, labels, reduction="sum")
    return gradaccum.LossSum(value, len(labels))


def _detection_model_and_reference(
    images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]]
) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    """A float64 model, its copy after one plain full-batch SGD step, and the model's SGD."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3).double()
    reference = copy.deepcopy(model)
    loss = _detection_loss(reference, (images, targets))
    (loss.value / loss.count).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    return model, reference, torch.optim.SGD(model.parameters(), lr=0.5)


def test_lists_of_one_tensor_per_item_are_split_when_the_batch_says_so() -> None:
    """torchvision detection batches: `(list of B images of varied sizes, list of B dicts)`."""
    generator = torch.Generator().manual_seed(0)
    images = [torch.randn(3, 5 + i, 4 + 2 * i, generator=generator) for i in range(7)]
    images = [image.double() for image in images]
    targets = [{"label": torch.tensor(i % 3), "boxes": torch.rand(i + 1, 4)} for i in range(7)]
    batch = (images, targets)
    assert batch_size(batch) == 7  # not 3, the images' channels
    micro_batches = split_batch(batch, 3)
    assert [(len(mb[0]), len(mb[1])) for mb in micro_batches] == [(3, 3), (3, 3), (1, 1)]
    assert micro_batches[2][0][0] is images[6]
    assert batch_size({"images": images, "ids": torch.arange(7)}) == 7
    # Alone, the contract's reading: tensors sharing dim 0, cut along the channels (open item).
    assert batch_size(images) == 3
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3).double()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    loss = _detection_loss(reference, batch)
    (loss.value / loss.count).backward()
    ref_opt.step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    result = gradaccum.Accumulator(model, optimizer, micro_batch_size=3).step(
        batch, _detection_loss
    )
    assert (result.micro_batches, result.count) == (3, 7)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match="disagree on the leading dimension"):
        split_batch({"pair": [torch.zeros(4, 2), torch.zeros(3, 2)], "x": torch.zeros(4)}, 2)


@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_lists_of_numpy_waveforms_are_split_one_per_item(drive: str) -> None:
    """`{"audio": [B numpy waveforms of varied lengths], "y": (B, 1)}`, as librosa or soundfile
    load them: refused ("batch tensors disagree", listing every waveform) while a list of
    tensors of the same lengths was split one per item. Now alike; the step is exact. Arrays
    of other ndims or dtypes are no per-item list (`[x, y]` mismatched stays a wrong batch)."""
    rng = np.random.default_rng(0)
    waves = [rng.standard_normal((n, 4)) for n in (3, 6, 2, 5, 4, 6, 1)]
    model, _, y = _regression()
    batch = {"audio": waves, "y": y}
    assert batch_size(batch) == 7
    parts = split_batch(batch, 3)
    assert [len(mb["audio"]) for mb in parts] == [3, 3, 1]
    assert parts[2]["audio"][0] is waves[6]

    def loss_fn(m: torch.nn.Module, mb: dict) -> torch.Tensor:
        pooled = torch.stack([m(torch.as_tensor(w)).mean(0) for w in mb["audio"]])
        return torch.nn.functional.mse_loss(pooled, mb["y"])

    reference = copy.deepcopy(model)
    loss_fn(reference, batch).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if drive == "step":
        gradaccum.Accumulator(model, optimizer, micro_batch_size=3).step(batch, loss_fn)
    else:
        acc = gradaccum.Accumulator(model, optimizer, accumulation_steps=3)
        assert [acc.micro_step(mb, loss_fn).stepped for mb in parts] == [False, False, True]
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    mismatched = {"pair": [np.zeros((4, 2)), np.zeros(3, dtype=np.int64)], "x": np.zeros(4)}
    with pytest.raises(ValueError, match="disagree on the leading dimension"):
        split_batch(mismatched, 2)


def _clip_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """An audio classifier over clips of varied lengths: each clip's channels pooled over time."""
    clips = batch["audio"]
    clips = [clip["audio"] for clip in clips] if isinstance(clips[0], dict) else clips
    scores = model(torch.stack([clip.mean(dim=1) for clip in clips]))
    return torch.nn.functional.cross_entropy(scores, batch["y"])


@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_a_list_of_b_varied_clips_of_b_channels_each_is_refused_not_split_by_channel(
    drive: str,
) -> None:
    """3 clips of 3 channels (2 stereo clips, 3 RGB images, 80 spectrograms of 80 mel bins),
    each of its own length: the list read as a container of 3 tensors of 3 rows, and each
    micro-batch got every clip's first channel, silently. Both readings agree with B, so it is
    refused naming both fixes, changing nothing; as examples, the step is the full batch's."""
    generator = torch.Generator().manual_seed(0)
    clips = [torch.randn(3, n, generator=generator, dtype=torch.float64) for n in (5, 8, 6)]
    batch = {"audio": clips, "y": torch.tensor([0, 1, 1])}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2).double()
    reference = copy.deepcopy(model)
    _clip_loss(reference, batch).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9).step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    before = copy.deepcopy(model.state_dict())
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=1, accumulation_steps=3)
    for bad in (batch, {"audio": tuple(clips), "y": batch["y"]}):
        with pytest.raises(ValueError, match=r"reads as 3 items .* list of dicts .* in a dict"):
            acc.step(bad, _clip_loss) if drive == "step" else acc.micro_step(bad, _clip_loss)
    with pytest.raises(ValueError, match=r"reads as 3 items .* in a tuple or a dict"):
        split_batch(clips, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state
    examples = {"audio": [{"audio": clip} for clip in clips], "y": batch["y"]}
    if drive == "step":
        acc.step(examples, _clip_loss)
    else:
        assert [acc.micro_step(mb, _clip_loss).stepped for mb in split_batch(examples, 1)] == [
            False,
            False,
            True,
        ]
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    # Not ambiguous, read as before: fields of one shape (a siamese pair with B=2), a top-level
    # tuple, a list whose length is not its tensors' rows.
    assert [len(mb[0]) for mb in split_batch([torch.zeros(2, 5), torch.ones(2, 5)], 1)] == [1, 1]
    assert [mb[1].shape for mb in split_batch((torch.zeros(2, 5), torch.ones(2, 7)), 1)] == [
        (1, 7),
        (1, 7),
    ]
    assert batch_size({"audio": clips[:2], "y": torch.zeros(2)}) == 2


def test_torchvision_detection_collate_tuples_are_split_per_image() -> None:
    """torchvision's detection `collate_fn` is `tuple(zip(*batch))`: a tuple of B images and a
    tuple of B target dicts (with a 0-dim `image_id`). Once refused as a container whose
    tensors disagree; now one image and one target per item, and the step is exact."""
    generator = torch.Generator().manual_seed(0)
    images = tuple(torch.randn(3, 5 + i, 4 + 2 * i, generator=generator).double() for i in range(7))
    targets = tuple(
        {"label": torch.tensor(i % 3), "boxes": torch.rand(i + 1, 4), "image_id": torch.tensor(i)}
        for i in range(7)
    )
    batch = (images, targets)
    assert batch_size(batch) == 7
    micro_batches = split_batch(batch, 3)
    assert [(len(mb[0]), len(mb[1])) for mb in micro_batches] == [(3, 3), (3, 3), (1, 1)]
    assert type(micro_batches[0][0]) is tuple
    assert micro_batches[2][1][0] is targets[6]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3).double()
    reference = copy.deepcopy(model)
    loss = _detection_loss(reference, batch)
    (loss.value / loss.count).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    result = gradaccum.Accumulator(model, optimizer, micro_batch_size=3).step(
        batch, _detection_loss
    )
    assert (result.micro_batches, result.count) == (3, 7)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    # The batch itself is never a per-item tuple: (x, y) of 4 and 3 rows stays a wrong batch.
    with pytest.raises(ValueError, match="disagree on the leading dimension"):
        split_batch((torch.zeros(4, 2), torch.zeros(3, 2)), 2)


@pytest.mark.parametrize("layout", ["tuple", "list", "dict of lists"])
def test_target_dicts_with_an_optional_key_are_split_per_image(layout: str) -> None:
    """Detection targets with `masks` for some images only: the dicts' keys differ, so they were
    read as a container and refused ("batch tensors disagree on the leading dimension", listing
    every box). They are one target per image, as when their keys agree; the step is exact. Dicts
    that share no key (`[inputs, targets]` of 4 and 3 rows) stay a wrong batch."""
    generator = torch.Generator().manual_seed(1)
    images = [torch.randn(3, 5 + i, 4, generator=generator).double() for i in range(7)]
    targets = [
        {"label": torch.tensor(i % 3), "boxes": torch.rand(i + 1, 4, generator=generator)}
        for i in range(7)
    ]
    for i in (1, 4):  # instance masks for two images only
        targets[i]["masks"] = torch.ones(i + 1, 5 + i, 4)
    batch: Any = {
        "tuple": (tuple(images), tuple(targets)),
        "list": (images, targets),
        "dict of lists": {"images": images, "targets": targets},
    }[layout]
    assert batch_size(batch) == 7
    micro_batches = split_batch(batch, 3)
    parts = [mb["targets"] if layout == "dict of lists" else mb[1] for mb in micro_batches]
    assert [len(part) for part in parts] == [3, 3, 1]
    assert parts[1][1] is targets[4]  # whole, with its masks

    def loss_fn(model: torch.nn.Module, mb: Any) -> gradaccum.LossSum:
        pair = (mb["images"], mb["targets"]) if isinstance(mb, dict) else mb
        return _detection_loss(model, pair)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3).double()
    reference = copy.deepcopy(model)
    loss = loss_fn(reference, batch)
    (loss.value / loss.count).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    result = gradaccum.Accumulator(model, optimizer, micro_batch_size=3).step(batch, loss_fn)
    assert (result.micro_batches, result.count) == (3, 7)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match="disagree on the leading dimension"):
        split_batch([{"x": torch.zeros(4, 2)}, {"y": torch.zeros(3, 2)}], 2)


def test_a_default_collate_pair_of_mismatched_tensors_is_refused() -> None:
    """`default_collate` makes `[x, y]` lists: x of 4 rows and y of 3 (a user's bug) were read
    as 2 items, one tensor each, and the loss saw `[x]` alone. Entries that are not alike (other
    ndim or dtype) are never one per item: the batch is refused naming both sizes."""
    for batch in (
        [torch.zeros(4, 2), torch.zeros(3, dtype=torch.long)],
        [torch.zeros(4, 2), torch.zeros(3)],
        [torch.zeros(4, 2), torch.zeros(3, 2, dtype=torch.float16)],
    ):
        with pytest.raises(ValueError, match=r"disagree.*batch\[0\]: 4, batch\[1\]: 3"):
            split_batch(batch, 1)
    # Negative control: alike tensors of varied sizes are still one per item (images).
    images = [torch.zeros(2 + i, 5) for i in range(3)]
    assert [len(mb) for mb in split_batch(images, 2)] == [2, 1]


def test_default_collate_columns_of_a_per_sample_list_are_split_per_item() -> None:
    """`default_collate` turns a per-sample list of L strings (5 captions per image) into L
    tuples of B strings: refused before as a per-item list of L entries. Each micro-batch is
    now what collating its own samples gives."""
    samples = [
        {"x": torch.full((2,), float(i)), "captions": [f"c{i}-{j}" for j in range(3)]}
        for i in range(5)
    ]
    batch = next(iter(torch.utils.data.DataLoader(samples, batch_size=5)))
    assert len(batch["captions"]) == 3  # L tuples of B
    assert batch_size(batch) == 5
    for start, micro_batch in zip((0, 2, 4), split_batch(batch, 2), strict=True):
        own = next(iter(torch.utils.data.DataLoader(samples[start : start + 2], batch_size=2)))
        assert micro_batch["captions"] == own["captions"]
        assert torch.equal(micro_batch["x"], own["x"])
    # Negative control: B pairs of strings (what collate_fn=list makes) are still one per item.
    pairs = {"x": torch.zeros(3, 2), "pairs": [("a", "b"), ("c", "d"), ("e", "f")]}
    assert [mb["pairs"] for mb in split_batch(pairs, 2)] == [[("a", "b"), ("c", "d")], [("e", "f")]]


def test_default_collate_columns_as_long_as_the_batch_need_the_documented_collate_fn() -> None:
    """README and `gradaccum.batching`: L tuples of B strings with L == B (4 answer choices in a
    batch of 4) cannot be told from B per-item tuples, and read so: each micro-batch gets whole
    columns (the documented limitation, pinned here). The documented fix, gathering the field per
    sample in the collate_fn, splits each item's own choices."""
    samples = [
        {"x": torch.full((2,), float(i)), "choices": [f"q{i}-{j}" for j in range(4)]}
        for i in range(4)
    ]
    collated = torch.utils.data.default_collate(samples)
    first = split_batch(collated, 2)[0]
    assert first["choices"] == [("q0-0", "q1-0", "q2-0", "q3-0"), ("q0-1", "q1-1", "q2-1", "q3-1")]

    def collate(batch: list[dict]) -> dict:
        collated = torch.utils.data.default_collate([{"x": s["x"]} for s in batch])
        return {**collated, "choices": [s["choices"] for s in batch]}

    gathered = next(iter(torch.utils.data.DataLoader(samples, batch_size=4, collate_fn=collate)))
    for start, micro_batch in zip((0, 2), split_batch(gathered, 2), strict=True):
        assert micro_batch["choices"] == [s["choices"] for s in samples[start : start + 2]]
        assert micro_batch["x"][:, 0].tolist() == [start, start + 1]


def test_uncollated_tuples_from_a_tensor_dataset_are_split_per_example() -> None:
    """`DataLoader(TensorDataset(x, y), collate_fn=list)`: a list of `(x_i, y_i)` pairs."""
    model, x, _ = _regression()
    labels = torch.tensor([0, 1, 0, 0, 1, 1, 0])
    dataset = torch.utils.data.TensorDataset(x, labels)
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=7, collate_fn=list)))
    assert batch_size(batch) == 7
    assert [len(mb) for mb in split_batch(batch, 3)] == [3, 3, 1]
    model = torch.nn.Linear(4, 2).double()

    def loss_fn(m: torch.nn.Module, examples: list) -> torch.Tensor:
        inputs = torch.stack([example[0] for example in examples])
        targets = torch.stack([example[1] for example in examples])
        return torch.nn.functional.cross_entropy(m(inputs), targets)

    reference = copy.deepcopy(model)
    loss_fn(reference, batch).backward()
    gradaccum.accumulate_grad(model, batch, loss_fn, micro_batch_size=3)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=0)
    # Negative control: a plain pair with a 0-dim tensor is still refused (not read per item).
    with pytest.raises(ValueError, match="0-dim tensor"):
        split_batch((torch.zeros(3, 2), torch.tensor(1.0)), 2)


def test_uncollated_pairs_with_python_labels_are_examples_not_a_container() -> None:
    """`collate_fn=list` over a Dataset returning `(tensor, int)` (torchvision's convention):
    the pairs were read as a container, and every tensor's own first dimension (5 features)
    as the batch's items, whatever the micro-batch held: micro_step counted 5 items for a
    loader's last batch of 2, so the window's mean was weighted wrongly, silently."""
    generator = torch.Generator().manual_seed(4)
    examples = [(torch.randn(5, generator=generator, dtype=torch.float64), i % 3) for i in range(8)]
    loader = torch.utils.data.DataLoader(examples, batch_size=3, collate_fn=list)  # 3, 3, 2
    assert [batch_size(mb) for mb in loader] == [3, 3, 2]
    assert batch_size([(torch.zeros(3, 4, 4), "cat")]) == 1  # one image, a string label
    assert [len(mb) for mb in split_batch(next(iter(loader)), 2)] == [2, 1]

    def loss_fn(model: torch.nn.Module, pairs: list) -> torch.Tensor:
        inputs = torch.stack([x for x, _ in pairs])
        return torch.nn.functional.cross_entropy(model(inputs), torch.tensor([y for _, y in pairs]))

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    reference = copy.deepcopy(model)
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=1.0), accumulation_steps=3
    )
    results = [acc.micro_step(mb, loss_fn) for mb in loader]
    assert results[-1].stepped
    assert results[-1].count == 8
    loss_fn(reference, examples).backward()
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    # Negative control: each micro-batch's mean weighted by 5 (the old count) is another step.
    means = [loss_fn(copy.deepcopy(reference), mb) for mb in loader]
    full = loss_fn(reference, examples)
    assert abs(float(sum(means) / 3) - float(full)) > 1e-3


def test_a_list_of_images_alone_is_a_container_and_as_examples_is_per_image() -> None:
    """docs/vision.md: a bare list of ragged images reads as the contract says, tensors sharing
    the leading dimension (split along the channels, B=3: an open item, not refused, as fields
    of varied shapes read the same way); with targets, or as `[{"image": ...}]` examples, it
    splits image by image. A multi-crop list (2 sizes) and 3 fields of other shapes too."""
    images = [torch.zeros(3, 4 + i, 5) for i in range(5)]
    targets = [{"labels": torch.tensor([i])} for i in range(5)]
    bare = split_batch(images, 2)
    assert [micro[0].shape[0] for micro in bare] == [2, 1]  # channels, not images
    examples = split_batch([{"image": image} for image in images], 2)
    assert [len(micro) for micro in examples] == [2, 2, 1]
    assert examples[2][0]["image"] is images[4]
    paired = split_batch((images, targets), 2)
    assert [len(micro[0]) for micro in paired] == [2, 2, 1]
    crops = [torch.zeros(6, 3, 8, 8)] * 2 + [torch.zeros(6, 3, 4, 4)] * 6  # SwAV: 2 + 6
    assert [len(micro) for micro in split_batch(crops, 4)] == [8, 8]  # 8 crops of 4, 2 rows
    assert batch_size([torch.zeros(6, 5), torch.zeros(6, 1), torch.zeros(6, 2)]) == 6


def test_a_flat_embedding_bag_batch_is_refused_naming_the_list_recipe_which_is_exact() -> None:
    """nn.EmbeddingBag's 1-D input with offsets (and a PyG-style graph batch) holds the items end
    to end: the refusal named CTC only. It names offsets and graphs now, and the list of B
    tensors it names, concatenated in loss_fn, is the full-batch step."""
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4, 2, 5, 3, 2]
    bags = [torch.randint(0, 20, (n,), generator=generator) for n in lengths]
    y = torch.randn(7, generator=generator, dtype=torch.float64)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    with pytest.raises(ValueError, match=r"nn.EmbeddingBag's 1-D input with offsets") as raised:
        split_batch({"input": torch.cat(bags), "offsets": offsets, "y": y}, 3)
    assert "a graph mini-batch's nodes" in str(raised.value)
    torch.manual_seed(0)
    bag, head = torch.nn.EmbeddingBag(20, 4).double(), torch.nn.Linear(4, 1).double()
    model = torch.nn.ModuleDict({"bag": bag, "head": head})

    def loss_fn(m: torch.nn.Module, b: dict) -> torch.Tensor:
        sizes = torch.tensor([len(t) for t in b["bags"]])
        starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
        pooled = m["bag"](torch.cat(b["bags"]), starts)
        return torch.nn.functional.mse_loss(m["head"](pooled).squeeze(-1), b["y"])

    full = copy.deepcopy(model)
    loss_fn(full, {"bags": bags, "y": y}).backward()
    gradaccum.accumulate_grad(model, {"bags": bags, "y": y}, loss_fn, micro_batch_size=3)
    for mine, reference in zip(model.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-10, atol=0)


def test_scipy_sparse_features_and_targets_are_split_by_rows_and_exact() -> None:
    """scikit-learn's sparse features and multi-label targets (`scipy.sparse`) were constants:
    every micro-batch got all B rows, and the forward failed with a shape error far from the
    cause (or, with every leaf sparse, ran the whole batch per micro-batch). They are split by
    rows in their own format (columns with batch_dim=1, reordered by take_batch), and the step
    is the full batch's."""
    sparse = pytest.importorskip("scipy.sparse")
    x = sparse.random(11, 6, density=0.4, format="csr", random_state=0)
    y = sparse.random(11, 3, density=0.4, format="coo", random_state=1)
    y.data[:] = 1.0
    ids = list(range(11))
    parts = split_batch({"x": x, "y": y, "ids": ids}, 4)
    assert [(p["x"].shape, p["y"].shape, p["y"].format) for p in parts] == [
        ((4, 6), (4, 3), "coo"),
        ((4, 6), (4, 3), "coo"),
        ((3, 6), (3, 3), "coo"),
    ]
    assert (sparse.vstack([p["x"] for p in parts]) != x).nnz == 0
    columns = split_batch(x.T.tocsc(), 4, batch_dim=1)
    assert [c.shape for c in columns] == [(6, 4), (6, 4), (6, 3)]
    assert (gradaccum.batching.take_batch(x, [2, 0, 1, *range(3, 11)])[0] != x[2]).nnz == 0
    with pytest.raises(ValueError, match=r"batch\['y'\]: 5"):
        split_batch({"x": x, "y": y.tocsr()[:5]}, 4)

    def dense(matrix: Any) -> torch.Tensor:
        return torch.from_numpy(matrix.toarray())

    def loss_fn(m: torch.nn.Module, b: dict) -> torch.Tensor:
        return torch.nn.functional.binary_cross_entropy_with_logits(m(dense(b["x"])), dense(b["y"]))

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).double()
    full = copy.deepcopy(model)
    loss_fn(full, {"x": x, "y": y}).backward()
    gradaccum.accumulate_grad(model, {"x": x, "y": y}, loss_fn, micro_batch_size=4)
    for mine, reference in zip(model.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-10, atol=0)


# Lists of same-shape tensors and packed sequences (thirteenth round)


class _TokenLM(torch.nn.Module):
    """Reads across its tokens (a GRU): a micro-batch given a slice of every sequence differs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 4)
        self.rnn = torch.nn.GRU(4, 4, batch_first=True)
        self.out = torch.nn.Linear(4, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.embed(ids))[0])


def _lm_loss(model: torch.nn.Module, ids: Any) -> gradaccum.LossSum:
    ids = torch.stack(ids) if isinstance(ids, list) else ids
    logits = model(ids[:, :-1])
    targets = ids[:, 1:]
    value = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="sum"
    )
    return gradaccum.LossSum(value, targets.numel())


def _token_model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _TokenLM().double()


@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_same_shape_token_sequences_alone_read_as_fields_and_stacked_are_exact(drive: str) -> None:
    """`collate_fn=list` over sequences of one length: B tensors of shape (S,), which a
    `TensorDataset`'s columns also are. Alone, they read as the contract says, S rows of B
    fields, so every micro-batch gets a few tokens of every sequence (an open item, documented:
    refusing it refused every 4-column TensorDataset). Stacked, or beside a tensor that pins B,
    they read per sequence, and the step is the full batch's (float64, rtol 1e-10)."""
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 20, (10,), generator=generator) for _ in range(6)]
    model = _token_model()
    reference = copy.deepcopy(model)
    full = _lm_loss(reference, sequences)
    (full.value / full.count).backward()
    grads = [p.grad.clone() for p in reference.parameters()]  # type: ignore[union-attr]
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    # The contract's reading of the lone list: 10 rows, 2 tokens of each sequence per 2 rows.
    assert batch_size(sequences) == 10
    assert [mb[0].shape for mb in split_batch(sequences, 2)] == [(2,)] * 5
    wrong = _token_model()
    parts = [_lm_loss(wrong, [s[a : a + 2] for s in sequences]) for a in range(0, 10, 2)]
    for part in parts:
        (part.value / sum(int(p.count) for p in parts)).backward()
    gap = max(
        float((p.grad - g).abs().max())  # type: ignore[operator]
        for p, g in zip(wrong.parameters(), grads, strict=True)
    )
    assert gap > 1e-3  # why the docs say to stack them

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=2, accumulation_steps=3)
    stacked = torch.stack(sequences)
    if drive == "step":
        acc.step(stacked, _lm_loss)
    else:
        results = [acc.micro_step(mb, _lm_loss).stepped for mb in split_batch(stacked, 2)]
        assert results == [False, False, True]
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    # The rest of the batch pins one reading: per-item ids with 6 labels, rows with 10.
    assert batch_size({"ids": sequences, "y": torch.zeros(6)}) == 6
    assert batch_size({"ids": sequences, "mask": torch.zeros(10)}) == 10
    # Lists of 2 or 3 same-shape tensors are (x, y) and (anchor, positive, negative).
    pair = [torch.zeros(6, 5), torch.ones(6, 5)]
    assert [mb[0].shape for mb in split_batch(pair, 4)] == [(4, 5), (2, 5)]
    assert batch_size([torch.zeros(6, 5)] * 3) == 6


def _loaded(*columns: torch.Tensor) -> list[torch.Tensor]:
    """The batch a DataLoader over `TensorDataset(*columns)` yields: a list (default_collate)."""
    dataset = torch.utils.data.TensorDataset(*columns)
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=len(columns[0]))))
    assert type(batch) is list
    return batch


class _FieldsModel(torch.nn.Module):
    """One small model for the four lone-list batches of shared rows below."""

    def __init__(self) -> None:
        super().__init__()
        self.users = torch.nn.Embedding(20, 4)
        self.items = torch.nn.Embedding(20, 4)
        self.ts = torch.nn.Linear(1, 1)
        self.series = torch.nn.Linear(7, 7)
        self.marks = torch.nn.Linear(4, 7)
        self.features = torch.nn.Linear(48, 16)
        self.fusion = torch.nn.Linear(128 + 512 + 768, 16)


def _fields_loss(model: _FieldsModel, batch: list[torch.Tensor]) -> torch.Tensor:
    """A mean over rows of each layout; uses every field, so a wrong reading fails or drifts."""
    mse = torch.nn.functional.mse_loss
    if batch[0].dtype == torch.int64:  # users, items, labels, timestamps
        users, items, labels, ts = batch
        score = (model.users(users) * model.items(items)).sum(-1)
        score = score + model.ts(ts.double()[:, None] / 100).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(score, labels.double())
    if batch[0].ndim == 3:  # Time-Series-Library: batch_x, batch_y, batch_x_mark, batch_y_mark
        x, y, x_mark, y_mark = batch
        encoded = model.series(x) + model.marks(x_mark)
        decoded = encoded.mean(1, keepdim=True) + model.marks(y_mark)
        return mse(decoded[:, -48:], y[:, -48:])
    if batch[0].shape[1] == 16:  # 4 feature columns of one width: 3 inputs and a target
        return mse(model.features(torch.cat(batch[:3], dim=1)), batch[3])
    audio, video, text, target = batch  # multimodal features of varied widths
    return mse(model.fusion(torch.cat([audio, video, text], dim=1)), target)


def _fields_batch(layout: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    if layout == "tensordataset_int64":
        columns = [torch.randint(0, 20, (10,), generator=generator) for _ in range(2)]
        labels = torch.randint(0, 2, (10,), generator=generator)
        ts = torch.randint(0, 1000, (10,), generator=generator)
        return _loaded(*columns, labels, ts)
    if layout == "same_width_features":
        return _loaded(*(randn(10, 16) for _ in range(4)))
    if layout == "tslib":
        return _loaded(randn(10, 96, 7), randn(10, 144, 7), randn(10, 96, 4), randn(10, 144, 4))
    return _loaded(randn(10, 128), randn(10, 512), randn(10, 768), randn(10, 16))


@pytest.mark.parametrize(
    "layout", ["tslib", "tensordataset_int64", "same_width_features", "multimodal"]
)
def test_a_lone_list_of_fields_sharing_rows_steps_as_the_full_batch(layout: str) -> None:
    """`DataLoader(TensorDataset(users, items, labels, ts))` yields a list of 4 int64 tensors
    of shape (B,); 4 feature columns of one width, (B, 16) each; Time-Series-Library's
    `[batch_x (B,96,7), batch_y (B,144,7), batch_x_mark (B,96,4), batch_y_mark (B,144,4)]`;
    multimodal `[audio (B,128), video (B,512), text (B,768), target (B,16)]`. All are lists
    whose tensors share dim 0, fields of B rows by the API contract: they were refused as
    ambiguous (4+ of one shape, or of 3+ shapes). Read as fields, a ragged step (4 + 4 + 2
    rows) is the full-batch step (float64, rtol 1e-10); numpy columns read alike."""
    batch = _fields_batch(layout)
    assert batch_size(batch) == 10
    assert [mb[3].shape[0] for mb in split_batch(batch, 4)] == [4, 4, 2]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _FieldsModel().double()
    reference = copy.deepcopy(model)
    _fields_loss(reference, batch).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = acc.step(batch, _fields_loss)
    assert (result.micro_batches, result.count) == (3, 10)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    assert batch_size([entry.numpy() for entry in batch]) == 10


def _packed_loss(model: torch.nn.Module, packed: Any) -> torch.Tensor:
    return model(packed)[1][-1].pow(2).sum(-1).mean()


@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_packed_sequences_split_by_sequence_and_step_as_the_full_batch(
    enforce_sorted: bool,
) -> None:
    """A `PackedSequence` (a collate_fn that packs) was refused with a message about tensors
    disagreeing on the leading dimension (its data, batch_sizes and indices), naming no fix.
    Now each micro-batch is its own sequences packed anew: step() and micro_step() equal the
    full-batch step (float64, rtol 1e-10), take_batch reorders them, and no pair warning."""
    from torch.nn.utils.rnn import pack_sequence, unpack_sequence

    generator = torch.Generator().manual_seed(0)
    lengths = (6, 5, 3, 3, 2) if enforce_sorted else (3, 5, 2, 4, 6)
    sequences = [torch.randn(n, 3, generator=generator, dtype=torch.float64) for n in lengths]
    packed = pack_sequence(sequences, enforce_sorted=enforce_sorted)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.GRU(3, 4).double()
    reference = copy.deepcopy(model)
    _packed_loss(reference, packed).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert batch_size(packed) == 5
    parts = [unpack_sequence(mb["x"]) for mb in split_batch({"x": packed}, 2)]
    assert [len(p) for p in parts] == [2, 2, 1]
    rejoined = [sequence for part in parts for sequence in part]
    assert all(torch.equal(a, b) for a, b in zip(rejoined, sequences, strict=True))
    taken = gradaccum.batching.take_batch({"x": packed, "i": torch.arange(5)}, [4, 0, 3, 1, 2])
    assert [len(s) for s in unpack_sequence(taken["x"])] == [lengths[i] for i in (4, 0, 3, 1, 2)]
    for drive in ("step", "micro_step"):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)
        acc = gradaccum.Accumulator(trained, optimizer, micro_batch_size=2, accumulation_steps=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no preference-pairs false alarm
            if drive == "step":
                assert acc.step(packed, _packed_loss).count == 5
            else:
                ragged = (sequences[:4], sequences[4:])  # a loader's ragged last batch
                for chunk in ragged:
                    packed_chunk = pack_sequence(chunk, enforce_sorted=False)
                    result = acc.micro_step(packed_chunk, _packed_loss)
                assert result.stepped
                assert result.count == 5
        for got, want in zip(trained.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    moved = to_device(packed, torch.device("cpu"))
    assert type(moved).__name__ == "PackedSequence"
    assert moved.batch_sizes.device.type == "cpu"


def _resized_detection_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """A mean over images: micro_step() weighs each micro-batch by the images it holds."""
    images, targets = batch
    scores = model(torch.stack([image.mean(dim=(1, 2)) for image in images]))
    labels = torch.stack([target["labels"][0] for target in targets])
    return torch.nn.functional.cross_entropy(scores, labels)


@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_detection_tuples_of_resized_images_with_as_many_boxes_are_split_per_image(
    drive: str,
) -> None:
    """torchvision's `tuple(zip(*batch))` of images resized to one size, each with 3 boxes:
    the images read as 3 rows (their channels) and the targets as 3 rows (their boxes), so B
    was 3 for 6 images. micro_step() weighed a mean over 4 images and one over 2 alike (6e-2
    off under SGD, silently), and step() cut channels. The target dicts, one per image, tell
    the reading: one image each, exact (float64, rtol 1e-10). Numpy lists are read alike."""
    generator = torch.Generator().manual_seed(0)
    images = tuple(torch.randn(3, 8, 8, generator=generator, dtype=torch.float64) for _ in range(6))
    targets = tuple(
        {"boxes": torch.rand(3, 4, generator=generator), "labels": torch.tensor([i % 3] * 3)}
        for i in range(6)
    )
    batch = (images, targets)
    assert batch_size(batch) == 6
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 3).double()
    reference = copy.deepcopy(model)
    _resized_detection_loss(reference, batch).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    # Negative control: the micro-batches of 4 and 2 images weighed alike, as B was 3 for both.
    wrong = copy.deepcopy(model)
    for part in ((images[:4], targets[:4]), (images[4:], targets[4:])):
        (_resized_detection_loss(wrong, part) / 2).backward()
    torch.optim.SGD(wrong.parameters(), lr=0.5).step()
    pairs = zip(wrong.parameters(), reference.parameters(), strict=True)
    gap = max(float((a - b).detach().abs().max()) for a, b in pairs)
    assert gap > 1e-3
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=2, accumulation_steps=2)
    if drive == "step":
        assert acc.step(batch, _resized_detection_loss).micro_batches == 3
    else:
        acc.micro_step((images[:4], targets[:4]), _resized_detection_loss)
        assert acc.micro_step((images[4:], targets[4:]), _resized_detection_loss).count == 6
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    # Metadata of numbers beside 2 views of 2 rows tells nothing: the views stay fields.
    views = {"views": [torch.zeros(2, 3, 4), torch.ones(2, 3, 4)], "meta": [{"id": 1}, {"id": 2}]}
    assert [mb["views"][1].shape[0] for mb in split_batch(views, 1)] == [1, 1]
    waves = [np.zeros(16) for _ in range(6)]
    assert batch_size(waves) == 16  # alone, fields of 16 rows as a list of tensors reads
    assert batch_size({"wav": waves, "y": torch.zeros(6)}) == 6


class _TVImage(torch.Tensor):
    """A tensor subclass, as torchvision's `tv_tensors.Image` and `BoundingBoxes` are."""


def test_lists_of_tensor_subclasses_are_per_item_like_plain_tensors() -> None:
    """torchvision's v2 transforms return `tv_tensors.Image` and `BoundingBoxes`: tensor
    subclasses. A list of them was never one entry per item, so a detection batch of images of
    varied sizes was refused with a wrong fix ('batch[1] must hold one entry per item, B=3 ...
    Make it a tensor': the images' channels taken for B) and `{"images": ..., "y": ...}` as
    tensors that disagree. They read as plain tensors now: one per item, the step exact."""
    generator = torch.Generator().manual_seed(0)
    images = [
        torch.randn(3, 5 + i, 4 + 2 * i, generator=generator, dtype=torch.float64).as_subclass(
            _TVImage
        )
        for i in range(5)
    ]
    targets = [
        {"label": torch.tensor(i % 3), "boxes": torch.rand(i + 1, 4).as_subclass(_TVImage)}
        for i in range(5)
    ]
    for batch in ((images, targets), (tuple(images), tuple(targets))):
        assert batch_size(batch) == 5
        assert [len(mb[0]) for mb in split_batch(batch, 2)] == [2, 2, 1]
    assert batch_size({"images": images, "y": torch.zeros(5)}) == 5
    model, reference, optimizer = _detection_model_and_reference(images, targets)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=2)
    assert acc.step((images, targets), _detection_loss).micro_batches == 3
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_a_detection_batch_of_3_rgb_images_with_their_targets_is_split_per_image() -> None:
    """3 RGB images of varied sizes read as 3 items and as 3 tensors of 3 rows: refused, even
    beside their 3 target dicts, so an epoch whose last batch held 3 images (or micro_step()
    micro-batches of 3) stopped with an error. One target dict per image tells the reading:
    one image each, and the window (micro-batches of 4 and 3 images) is the full batch's."""
    generator = torch.Generator().manual_seed(0)
    images = [
        torch.randn(3, 5 + i, 4 + 2 * i, generator=generator, dtype=torch.float64) for i in range(7)
    ]
    targets = [{"label": torch.tensor(i % 3), "boxes": torch.rand(i + 1, 4)} for i in range(7)]
    for layout in (list, tuple):
        assert batch_size((layout(images[4:]), layout(targets[4:]))) == 3
    with pytest.raises(ValueError, match=r"reads as 3 items"):
        batch_size({"images": images[4:], "y": torch.zeros(3)})  # a tensor tells nothing
    model, reference, optimizer = _detection_model_and_reference(images, targets)
    acc = gradaccum.Accumulator(model, optimizer, accumulation_steps=2)
    acc.micro_step((images[:4], targets[:4]), _detection_loss)
    result = acc.micro_step((images[4:], targets[4:]), _detection_loss)
    assert (result.stepped, result.count) == (True, 7)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
