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
