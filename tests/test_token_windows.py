"""Windows of counted items: `Accumulator(accumulation_steps=Tokens(n))` with `micro_step()`.

A window closes at the first micro-batch that brings its count (the tokens a `LossSum` counts, or
the items of a plain mean) to at least `n`. Each step must equal the plain full-batch step over
exactly the micro-batches of its window (float64, rtol 1e-10), whatever the ragged token counts;
the negative control is the mean of per-micro-batch means. Mid-window resume is in
`test_state.py` (its "tokens" variants); ranks agreeing on when a window ends, in
`tests/distributed/test_uneven_windows.py`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gradaccum import Accumulator, LossSum, Tokens
from tests.models import (
    IGNORE_INDEX,
    concat_batches,
    make_model,
    token_batch,
    token_mean_loss,
    token_sum_loss,
)
from tests.reference import param_tensors, reference_step, relative_gap

EXACT = 1e-10
BUDGET = 28  # tokens per window


def _micro_batches(count: int = 13) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [token_batch(generator, 2 + i % 3, min_len=1) for i in range(count)]  # 4 to 27 each


def _counted(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())


def _windows(micro_batches: list[dict[str, torch.Tensor]], budget: int) -> list[list[int]]:
    """Which micro-batches each window holds, from the counts alone (no library code)."""
    windows: list[list[int]] = [[]]
    total = 0
    for index, batch in enumerate(micro_batches):
        windows[-1].append(index)
        total += _counted(batch)
        if total >= budget:
            windows.append([])
            total = 0
    return [window for window in windows if window]


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "40", None])
def test_tokens_must_be_a_positive_int_and_the_message_names_the_fix(bad: object) -> None:
    with pytest.raises(ValueError, match=r"Tokens\(count=.*positive int.*Tokens\(65536\)"):
        Tokens(bad)  # type: ignore[arg-type]


def test_each_window_closes_at_its_count_and_equals_the_full_batch_step() -> None:
    micro_batches = _micro_batches()
    windows = _windows(micro_batches, BUDGET)
    assert len(windows) >= 3
    assert len({len(w) for w in windows}) > 1
    model, reference = make_model("token"), make_model("token")
    acc = Accumulator(model, _sgd(model), accumulation_steps=Tokens(BUDGET))
    reference_optimizer = _sgd(reference)
    results = [acc.micro_step(batch, token_sum_loss) for batch in micro_batches]
    final = acc.flush()
    closed = [index for index, result in enumerate(results) if result.stepped]
    complete = [w for w in windows if sum(_counted(micro_batches[i]) for i in w) >= BUDGET]
    assert closed == [window[-1] for window in complete]
    assert len(complete) == len(windows) - 1  # the last window is partial: flush() steps it
    for window in windows:
        batch = concat_batches([micro_batches[i] for i in window])
        reference_step(reference, reference_optimizer, batch, token_sum_loss)
        closing = results[window[-1]] if window[-1] in closed else final
        assert closing.stepped
        assert closing.count == _counted(batch) >= 1
        assert closing.micro_batches == len(window)
    assert relative_gap(param_tensors(model), param_tensors(reference)) < EXACT


def test_negative_control_the_mean_of_micro_batch_means_is_far_from_the_window_step() -> None:
    micro_batches = _micro_batches()
    window = _windows(micro_batches, BUDGET)[0]
    model = make_model("token")
    means = [token_mean_loss(model, micro_batches[i]) for i in window]
    (sum(means) / len(means)).backward()
    wrong = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    exact = make_model("token")
    batch = concat_batches([micro_batches[i] for i in window])
    value = token_sum_loss(exact, batch)
    (value.value / value.count).backward()
    right = {n: p.grad for n, p in exact.named_parameters()}
    assert relative_gap(wrong, right) > 1e-3


def test_a_plain_mean_counts_items() -> None:
    """Micro-batches of 2 items and Tokens(5): windows of 3 micro-batches (6 items)."""
    generator = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randn(2, 5, generator=generator, dtype=torch.float64),
            torch.randn(2, 3, generator=generator, dtype=torch.float64),
        )
        for _ in range(6)
    ]
    model = make_model("mlp")
    twin = copy.deepcopy(model)
    acc = Accumulator(model, _sgd(model), accumulation_steps=Tokens(5))

    def mse(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    stepped = [acc.micro_step(batch, mse).stepped for batch in data]
    assert stepped == [False, False, True, False, False, True]
    optimizer = _sgd(twin)
    for start in (0, 3):
        x = torch.cat([b[0] for b in data[start : start + 3]])
        y = torch.cat([b[1] for b in data[start : start + 3]])
        reference_step(twin, optimizer, (x, y), mse)
    assert relative_gap(param_tensors(model), param_tensors(twin)) < EXACT


def test_micro_batches_that_count_nothing_keep_the_window_open() -> None:
    model = make_model("mlp")
    acc = Accumulator(model, _sgd(model), accumulation_steps=Tokens(1))
    x = torch.randn(3, 5, dtype=torch.float64)

    def nothing(m: torch.nn.Module, b: torch.Tensor) -> LossSum:
        return LossSum(m(b).sum() * 0, 0)

    assert not acc.micro_step(x, nothing).stepped
    assert not acc.micro_step(x, nothing).stepped
    result = acc.flush()  # a mean over no item: skipped, and counted as an empty window
    assert not result.stepped
    assert acc.empty_windows == 1


def _ce_and_rows(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> object:
    """Token CE plus a per-row auxiliary term: two counts, tokens and rows."""
    from gradaccum.loss import Term

    tokens = token_sum_loss(model, batch)
    aux = model(batch["tokens"]).pow(2).mean(dim=(1, 2)).sum()
    rows = batch["tokens"].shape[0]
    return LossSum.terms(ce=(tokens.value, tokens.count), aux=Term(aux, count=rows, weight=0.1))


def test_a_terms_loss_fills_the_budget_with_the_named_term_and_refuses_no_name() -> None:
    """With LossSum.terms the window counted its rows: Tokens(28) of tokens became 28 rows,
    about 6 times the window asked for, silently. `Tokens(n, term="ce")` closes the window
    where the same budget closes for a LossSum of those tokens; without `term` the first
    micro_step is refused, changing nothing."""
    micro_batches = _micro_batches()
    windows = _windows(micro_batches, BUDGET)
    model = make_model("token")
    acc = Accumulator(model, _sgd(model), accumulation_steps=Tokens(BUDGET, term="ce"))
    results = [acc.micro_step(batch, _ce_and_rows) for batch in micro_batches]
    closed = [index for index, result in enumerate(results) if result.stepped]
    complete = [w for w in windows if sum(_counted(micro_batches[i]) for i in w) >= BUDGET]
    assert closed == [window[-1] for window in complete]
    reference = make_model("token")
    reference_optimizer = _sgd(reference)
    for window in complete:  # each window: one plain step, each term over its own count
        batch = concat_batches([micro_batches[i] for i in window])
        tokens = token_sum_loss(reference, batch)
        aux = reference(batch["tokens"]).pow(2).mean(dim=(1, 2)).sum()
        reference_optimizer.zero_grad(set_to_none=True)
        (tokens.value / tokens.count + 0.1 * aux / batch["tokens"].shape[0]).backward()
        reference_optimizer.step()
    assert relative_gap(param_tensors(model), param_tensors(reference)) < EXACT

    unnamed = make_model("token")
    before = copy.deepcopy(unnamed.state_dict())
    acc = Accumulator(unnamed, _sgd(unnamed), accumulation_steps=Tokens(BUDGET))
    with pytest.raises(ValueError, match=r"must name the term.*Tokens\(65536, term='ce'\)"):
        acc.micro_step(micro_batches[0], _ce_and_rows)
    assert all(torch.equal(v, before[k]) for k, v in unnamed.state_dict().items())
    assert all(p.grad is None for p in unnamed.parameters())
    with pytest.raises(ValueError, match=r"term must be a term's name"):
        Tokens(BUDGET, term=3)  # type: ignore[arg-type]


def test_the_budget_term_keeps_saved_settings_compatible_and_is_part_of_them() -> None:
    """Saved states compare `repr(Tokens)`: without a term it is the text of before `term`
    existed, so older states still load; a state of another budget term is refused."""
    assert repr(Tokens(BUDGET)) == f"Tokens(count={BUDGET})"
    assert repr(Tokens(BUDGET, term="ce")) == f"Tokens(count={BUDGET}, term='ce')"
    model = make_model("token")
    acc = Accumulator(model, _sgd(model), accumulation_steps=Tokens(BUDGET, term="ce"))
    acc.micro_step(_micro_batches(1)[0], _ce_and_rows)
    state = acc.state_dict()
    other = make_model("token")
    with pytest.raises(ValueError, match="accumulation_steps"):
        Accumulator(other, _sgd(other), accumulation_steps=Tokens(BUDGET)).load_state_dict(state)
    resumed = Accumulator(other, _sgd(other), accumulation_steps=Tokens(BUDGET, term="ce"))
    resumed.load_state_dict(state)
    assert resumed.state_dict()["engine"]["window"]["micro_batches"] == 1
