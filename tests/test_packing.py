"""Token-budget micro-batches (gradaccum.packing and `Accumulator.step(max_tokens=...)`).

The packing is checked row by row (each row exactly once, in a micro-batch within the budget,
trimmed to the micro-batch's longest row), and the step against a plain full-batch reference in
float64. The negative control averages the micro-batches' token means, which a token budget
makes visibly wrong: its micro-batches hold very different numbers of tokens.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from gradaccum import Accumulator, LossSum
from gradaccum.packing import TokenBudgetWarning, pack_by_tokens, sequence_lengths
from tests.models import IGNORE_INDEX, make_model, token_batch, token_sum_loss
from tests.reference import param_tensors, relative_gap

EXACT = 1e-10
LENGTHS = [12, 1, 3, 12, 2, 7, 5, 1, 9, 2, 4, 11]  # skewed, right-padded to 12


def _batch(seed: int, lengths: list[int] = LENGTHS) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    batch = token_batch(generator, len(lengths), seq_len=max(lengths))
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    batch["tokens"] = batch["tokens"].masked_fill(~mask, 0)
    batch["labels"] = torch.randint(0, 5, mask.shape, generator=generator).masked_fill(
        ~mask, IGNORE_INDEX
    )
    batch["attention_mask"] = mask.long()
    batch["row"] = list(range(len(lengths)))  # a per-item list: reordered with the rows
    return batch


def test_every_row_lands_once_within_the_budget_and_trimmed() -> None:
    batch = _batch(0)
    micro_batches = pack_by_tokens(batch, max_tokens=24)
    rows = [row for mb in micro_batches for row in mb["row"]]
    assert sorted(rows) == list(range(len(LENGTHS)))
    for mb in micro_batches:
        width = mb["tokens"].shape[1]
        assert width == max(LENGTHS[row] for row in mb["row"])  # its own longest row
        assert len(mb["row"]) * width <= 24
        for position, row in enumerate(mb["row"]):  # the right row, its tokens intact
            assert torch.equal(mb["tokens"][position], batch["tokens"][row, :width])
            assert torch.equal(mb["labels"][position], batch["labels"][row, :width])
    padded = sum(mb["tokens"].numel() for mb in micro_batches)
    assert padded < 0.7 * batch["tokens"].numel()  # the point: far less padding


def test_a_row_longer_than_the_budget_runs_alone_with_a_warning() -> None:
    with pytest.warns(TokenBudgetWarning, match="3 rows are longer than max_tokens=10"):
        micro_batches = pack_by_tokens(_batch(0), max_tokens=10)
    assert [len(mb["row"]) for mb in micro_batches[:3]] == [1, 1, 1]


def test_lengths_need_right_padding_and_errors_name_the_fix() -> None:
    batch = _batch(0)
    assert sequence_lengths(batch) == LENGTHS
    left = dict(batch, attention_mask=batch["attention_mask"].flip(1))
    with pytest.raises(ValueError, match="padding_side = 'right'"):
        pack_by_tokens(left, max_tokens=24)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="must be a positive int"):
            pack_by_tokens(batch, max_tokens=bad)  # type: ignore[arg-type]
    no_mask = {"tokens": torch.zeros(6, 4, dtype=torch.long)}
    assert [len(mb["tokens"]) for mb in pack_by_tokens(no_mask, max_tokens=8)] == [2, 2, 2]


def test_an_additive_float_mask_is_refused_naming_the_0_1_mask_and_nothing_changes() -> None:
    """An additive mask (0 attended, -inf padded) read as "nonzero is attended" was backwards:
    refused for its padding by luck; a batch of full rows read lengths of 0 (but for labels)."""
    batch = _batch(0)
    additive = (1.0 - batch["attention_mask"].double()) * torch.finfo(torch.float64).min
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model))
    before = param_tensors(model)
    for mask in (additive, torch.where(additive < 0, -torch.inf, 0.0)):
        with pytest.raises(ValueError, match=r"0/1 attention_mask.*build the additive"):
            acc.step(dict(batch, attention_mask=mask), token_sum_loss, max_tokens=24)
    assert relative_gap(param_tensors(model), before) == 0.0
    # Control: the same batch with its 0/1 mask as floats (no negative value) packs as before.
    floats = dict(batch, attention_mask=batch["attention_mask"].double())
    assert sequence_lengths(floats) == LENGTHS
    assert acc.step(floats, token_sum_loss, max_tokens=24).stepped


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _reference(batches: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    model = make_model("token")
    optimizer = _optimizer(model)
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = token_sum_loss(model, batch)
        (loss.value / loss.count).backward()
        optimizer.step()
    return param_tensors(model)


BATCHES = [_batch(seed) for seed in range(3)]


@pytest.mark.parametrize("max_tokens", [12, 24, 40, 200])
def test_token_budget_step_equals_the_full_batch_step(max_tokens: int) -> None:
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model))  # no micro_batch_size: the budget decides
    for batch in BATCHES:
        result = acc.step(batch, token_sum_loss, max_tokens=max_tokens)
        assert result.stepped
        assert result.count == int((batch["labels"] != IGNORE_INDEX).sum())
    assert relative_gap(param_tensors(model), _reference(BATCHES)) < EXACT


def test_negative_control_the_mean_of_micro_batch_token_means_is_not_exact() -> None:
    def token_mean(model: nn.Module, batch: dict[str, Any]) -> LossSum:
        loss = token_sum_loss(model, batch)
        return LossSum(loss.value / loss.count, 1)  # every micro-batch weighs the same

    model = make_model("token")
    acc = Accumulator(model, _optimizer(model))
    for batch in BATCHES:
        acc.step(batch, token_mean, max_tokens=24)
    assert relative_gap(param_tensors(model), _reference(BATCHES)) > 1e-3


def _numbered(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with a packed row's mask: its documents numbered 1, 2, 3 (axolotl's multipack)."""
    mask = batch["attention_mask"]
    documents = 1 + torch.arange(mask.shape[1])[None, :] // 4  # a new document every 4 tokens
    return dict(batch, attention_mask=mask * documents)


def test_a_mask_that_numbers_its_documents_gives_lengths_and_the_full_batch_step() -> None:
    """A right-padded mask numbering a packed row's documents (1, 1, 2, 2, 2, 0) was summed as
    lengths: past the row's width, so every such batch was refused as "not right-padded"."""
    batches = [_numbered(batch) for batch in BATCHES]
    assert int(batches[0]["attention_mask"].max()) == 3
    assert sequence_lengths(batches[0]) == LENGTHS
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model))
    for batch in batches:
        assert acc.step(batch, token_sum_loss, max_tokens=24).micro_batches > 1
    assert relative_gap(param_tensors(model), _reference(batches)) < EXACT
    # NEGATIVE CONTROL: a numbered mask padded on the left is still refused, naming the fix.
    left = dict(batches[0], attention_mask=batches[0]["attention_mask"].flip(1))
    with pytest.raises(ValueError, match="padding_side = 'right'"):
        acc.step(left, token_sum_loss, max_tokens=24)


def test_token_budget_refuses_what_it_cannot_pack_and_changes_nothing() -> None:
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), micro_batch_size=4, batch_dim=1)
    before = param_tensors(model)
    with pytest.raises(ValueError, match="batch_dim=0"):
        acc.step(BATCHES[0], token_sum_loss, max_tokens=24)
    assert relative_gap(param_tensors(model), before) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fitting budget warns about nothing
        Accumulator(model, _optimizer(model)).step(BATCHES[0], token_sum_loss, max_tokens=24)


@dataclasses.dataclass(frozen=True)
class Targets:
    """Labels kept in a dataclass: a record split (and reordered) field by field."""

    labels: torch.Tensor


def _record_loss(model: nn.Module, batch: dict[str, Any]) -> LossSum:
    for example, row in zip(batch["examples"], batch["row"], strict=True):
        assert example["row"] == row  # uncollated examples follow their rows
    return token_sum_loss(model, {"tokens": batch["tokens"], "labels": batch["targets"].labels})


def test_dataclasses_and_uncollated_examples_are_reordered_with_their_rows() -> None:
    batches = []
    for seed in range(3):
        batch = _batch(seed)
        batch["targets"] = Targets(batch.pop("labels"))
        batch["examples"] = [{"row": r, "id": torch.tensor(r)} for r in batch["row"]]
        batches.append(batch)
    for micro_batch in pack_by_tokens(batches[0], 24):
        rows = micro_batch["row"]
        assert [e["row"] for e in micro_batch["examples"]] == rows
        width = micro_batch["tokens"].shape[1]
        wanted = batches[0]["targets"].labels[rows, :width]
        assert torch.equal(micro_batch["targets"].labels, wanted)  # trimmed like the tokens
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model))
    for batch in batches:
        assert acc.step(batch, _record_loss, max_tokens=24).stepped
    plain = [
        {"tokens": b["tokens"], "labels": b["targets"].labels, "row": b["row"]} for b in batches
    ]
    assert relative_gap(param_tensors(model), _reference(plain)) < EXACT
    # Negative control: labels left in their original order (the dataclass not reordered)
    # pair each row's tokens with another row's labels.
    shuffled = [{**b, "labels": b["labels"].roll(1, dims=0)} for b in plain]
    assert relative_gap(_reference(shuffled), _reference(plain)) > 1e-3


# --- trimming never drops a scored label ------------------------------------------------------


def _target_loss(model: nn.Module, batch: dict[str, Any]) -> LossSum:
    """An encoder-decoder in miniature: the row's masked token logits, summed, score every
    position of `labels`, which lie on their own axis (their width and lengths are their own)."""
    logits = model(batch["tokens"]) * batch["attention_mask"][..., None]
    pooled = logits.sum(dim=1)  # (rows, classes): padding adds nothing
    labels = batch["labels"]
    scores = pooled[:, None, :].expand(-1, labels.shape[1], -1)
    value = nn.functional.cross_entropy(
        scores.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return LossSum(value, (labels != IGNORE_INDEX).sum())


def _target_batch(seed: int, width: int) -> dict[str, Any]:
    """`_batch` with targets of `width` columns whose lengths differ from the inputs' lengths."""
    generator = torch.Generator().manual_seed(100 + seed)
    batch = _batch(seed)
    lengths = torch.tensor(LENGTHS[::-1])[:, None] + (width - max(LENGTHS))
    labels = torch.randint(0, 5, (len(LENGTHS), width), generator=generator)
    batch["labels"] = labels.masked_fill(torch.arange(width)[None, :] >= lengths, IGNORE_INDEX)
    return batch


def _reference_with(loss_fn: Any, batches: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    model = make_model("token")
    optimizer = _optimizer(model)
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        (loss.value / loss.count).backward()
        optimizer.step()
    return param_tensors(model)


@pytest.mark.parametrize("width", [max(LENGTHS), max(LENGTHS) + 3])
def test_labels_on_their_own_axis_are_never_trimmed_to_the_inputs_rows(width: int) -> None:
    """Targets as wide as the attention mask by chance (a seq2seq batch padded to one width)
    were cut to each micro-batch's longest INPUT row, losing scored labels; wider ones were cut
    to the mask's rows while the inputs kept their full width."""
    batches = [_target_batch(seed, width) for seed in range(3)]
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model))
    for batch in batches:
        for micro_batch in pack_by_tokens(batch, max_tokens=24):
            assert micro_batch["tokens"].shape[1] == micro_batch["attention_mask"].shape[1]
        result = acc.step(batch, _target_loss, max_tokens=24)
        assert result.count == int((batch["labels"] != IGNORE_INDEX).sum())
    assert relative_gap(param_tensors(model), _reference_with(_target_loss, batches)) < EXACT
    # Negative control: the targets cut to the inputs' rows (what the trimming did) are far off.
    cut = [{**b, "labels": b["labels"][:, : max(LENGTHS)].clone()} for b in batches]
    for b in cut:
        b["labels"][b["attention_mask"] == 0] = IGNORE_INDEX
    gap = relative_gap(_reference_with(_target_loss, cut), _reference_with(_target_loss, batches))
    assert gap > 1e-3


def test_targets_wider_than_the_mask_are_kept_whole() -> None:
    """Multi-label targets of shape (rows, 20) beside tokens of width 12: never trimmed."""
    batch = _batch(0)
    batch["labels"] = torch.randint(0, 2, (len(LENGTHS), 20)).double()
    (micro_batch,) = pack_by_tokens(batch, max_tokens=200)  # all rows fit in one
    assert micro_batch["labels"].shape == (len(LENGTHS), 20)  # was cut to 12 columns
    for micro_batch in pack_by_tokens(batch, max_tokens=24):
        assert micro_batch["labels"].shape[1] == 20
        assert micro_batch["tokens"].shape[1] == micro_batch["attention_mask"].sum(1).max()


def test_scored_padding_is_kept_and_counted_in_the_budget() -> None:
    """Labels copied from the tokens (padding scored, no -100): each row reaches the full
    width, so no micro-batch drops a label, and the budget counts what the rows really hold."""
    batches = []
    for seed in range(3):
        batch = _batch(seed)
        batch["labels"] = batch["tokens"] % 5  # padding holds label 0, scored
        batches.append(batch)
    assert sequence_lengths(batches[0]) == [max(LENGTHS)] * len(LENGTHS)
    for micro_batch in pack_by_tokens(batches[0], max_tokens=24):
        assert micro_batch["labels"].shape == (2, max(LENGTHS))  # 2 rows x 12 <= 24
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model))
    for batch in batches:
        assert acc.step(batch, token_sum_loss, max_tokens=24).count == batch["labels"].numel()
    assert relative_gap(param_tensors(model), _reference(batches)) < EXACT


def test_every_leaf_the_batching_splits_follows_its_row() -> None:
    """Rows are sorted by length: images of varied sizes (a list, one per item) and
    default_collate's caption columns (tuples of B strings) stayed in data order while the
    tokens were sorted, pairing each row with another row's image and captions; and an image
    as tall as the mask is wide was cut like a row of tokens. Only what is split is trimmed."""
    batch = _batch(0)
    rows = len(LENGTHS)
    width = max(LENGTHS)  # images as tall as the mask is wide: not the tokens' width, not cut
    batch["images"] = [torch.full((3, width, 1 + row % 4), float(row)) for row in range(rows)]
    batch["captions"] = [tuple(f"c{row}-{j}" for row in range(rows)) for j in range(2)]
    micro_batches = pack_by_tokens(batch, max_tokens=24)
    assert len(micro_batches) > 2
    for micro_batch in micro_batches:
        assert [int(image[0, 0, 0]) for image in micro_batch["images"]] == micro_batch["row"]
        assert all(image.shape[1] == width for image in micro_batch["images"])
        for j, column in enumerate(micro_batch["captions"]):
            assert list(column) == [f"c{row}-{j}" for row in micro_batch["row"]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"micro_batch_size": "auto", "memory_budget": "64MiB"},
            "micro_batch_size='auto' sizes them by memory: choose one. For token budgets, build "
            "the Accumulator without micro_batch_size",
        ),
        (
            {"micro_batch_size": "largest", "memory_budget": "64MiB"},
            "micro_batch_size='largest' sizes them by memory",
        ),
        ({"batch_dim": 1}, "packs the rows of batch-first batches, not batch_dim=1"),
    ],
)
def test_a_token_budget_it_cannot_pack_is_refused_naming_the_fix(kwargs, message) -> None:
    """Before, one message for both cases ("needs batch_dim=0 and no 'auto' sizing") named
    neither which setting was wrong nor what to build instead."""
    model = make_model("token")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, **kwargs)
    before = [p.detach().clone() for p in model.parameters()]
    batch = token_batch(torch.Generator().manual_seed(0), 8)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        acc.step(batch, token_sum_loss, max_tokens=64)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert optimizer.state == {}
    assert all(p.grad is None for p in model.parameters())
    # NEGATIVE CONTROL: an Accumulator built for token budgets packs the same batch.
    plain = Accumulator(model, optimizer)
    assert plain.step(batch, token_sum_loss, max_tokens=64).stepped
