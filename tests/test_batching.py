"""Tests for gradaccum.batching: splitting nested batches into micro-batch views."""

from __future__ import annotations

import math
from collections import OrderedDict, namedtuple
from types import SimpleNamespace

import pytest
import torch

import gradaccum
from gradaccum import split_batch
from gradaccum.batching import batch_size, check_micro_batch_size, map_tensors, to_device

Pair = namedtuple("Pair", ["inputs", "meta"])


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
        ([], "holds no tensor"),
        ((torch.zeros(3, 2), torch.tensor(1.0)), "0-dim tensor"),
    ],
    ids=["empty-tensor", "empty-tuple", "no-tensor", "empty-list", "scalar-leaf"],
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
