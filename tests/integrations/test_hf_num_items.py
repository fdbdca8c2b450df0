"""transformers' `num_items_in_batch` convention, as `Trainer` uses it, under gradaccum.

A transformers 5 model called with `num_items_in_batch=n` returns its token SUM divided by `n`,
the count of the whole window (Trainer's own accumulation). Returned from `loss_fn` as a plain
scalar it is read as a mean over the micro-batch's rows: the step is not the full-batch one (on
`k` equal micro-batches, `k` times too small). On rows without -100 labels (packed
pretraining rows) nothing warned of it; now a `CopiedLoopWarning` names the fix. The fixes (the
`gradaccum.hf` helpers, or the model's sum with its count) equal the plain full-batch step.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.integrations._hf import import_transformers

transformers = import_transformers()

from gradaccum import Accumulator, LossSum, hf  # noqa: E402
from gradaccum.loss import CopiedLoopWarning  # noqa: E402
from tests.integrations.test_hf import EXACT, VOCAB, _gpt2, _model  # noqa: E402
from tests.reference import param_tensors, relative_gap  # noqa: E402

ROWS, SEQ, MICRO = 8, 9, 4


def _batch() -> dict[str, torch.Tensor]:
    """Packed pretraining rows: every token scored, no -100 anywhere."""
    ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids.clone()}


WINDOW_TOKENS = ROWS * (SEQ - 1)  # what Trainer passes: the window's shifted labels


def _reference() -> dict[str, torch.Tensor]:
    model = _model(_gpt2)
    batch = _batch()
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten()).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return param_tensors(model)


def _ours(loss_fn: Callable[..., Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
    model = _model(_gpt2)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=MICRO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert acc.step(_batch(), loss_fn).stepped
    said = [str(w.message) for w in caught if issubclass(w.category, CopiedLoopWarning)]
    return param_tensors(model), said


def _trainer_int(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss: torch.Tensor = model(**batch, num_items_in_batch=WINDOW_TOKENS).loss
    return loss


def _trainer_tensor(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss: torch.Tensor = model(**batch, num_items_in_batch=torch.tensor(WINDOW_TOKENS)).loss
    return loss


def _sum_as_scalar(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss: torch.Tensor = model(**batch, num_items_in_batch=1).loss
    return loss


def _mean_with_count(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    """The documented fix without its `num_items_in_batch=1`: the model's MEAN as the sum."""
    return LossSum(model(**batch).loss, hf.causal_lm.items_counted(batch))


@pytest.mark.parametrize(
    ("loss_fn", "says"),
    [
        (_trainer_int, "num_items_in_batch"),
        (_trainer_tensor, "num_items_in_batch"),
        (_sum_as_scalar, "reduction='sum'"),
        (_mean_with_count, "value is a MEAN.*num_items_in_batch=1"),  # was silent
    ],
)
def test_the_models_num_items_loss_returned_plainly_warns_and_is_not_the_step(
    loss_fn: Callable[..., Any], says: str
) -> None:
    params, said = _ours(loss_fn)
    assert len(said) == 1, said
    assert re.search(says, said[0]), said[0]
    assert "LossSum" in said[0]
    assert relative_gap(params, _reference()) > 1e-2  # silently another step before the warning


def _models_sum_and_count(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    """docs/losses.md's recipe: the model's sum, and the shifted labels it scores."""
    scored = (batch["labels"][..., 1:] != -100).sum()
    return LossSum(model(**batch, num_items_in_batch=1).loss, scored)


def _micro_batch_token_mean(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`sum / n` with n the micro-batch's own count: a mean over it, no window count."""
    loss: torch.Tensor = model(**batch, num_items_in_batch=MICRO * (SEQ - 1)).loss
    return loss


@pytest.mark.parametrize(
    ("loss_fn", "tolerance"),
    [
        (hf.causal_lm, EXACT),
        (_models_sum_and_count, 1e-6),  # the model's own loss upcasts logits to float32 only
        (_micro_batch_token_mean, 1e-6),  # equal rows and counts: a row mean, exact
    ],
)
def test_the_fixes_and_a_micro_batch_mean_do_not_warn_and_equal_the_step(
    loss_fn: Callable[..., Any], tolerance: float
) -> None:
    params, said = _ours(loss_fn)
    assert not said
    assert relative_gap(params, _reference()) < tolerance


def _packed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows as packed ones: two documents each, position_ids back at 0 where one starts."""
    cuts = torch.randint(3, SEQ - 2, (ROWS,), generator=torch.Generator().manual_seed(4))
    columns = torch.arange(SEQ)
    positions = torch.where(columns < cuts[:, None], columns, columns - cuts[:, None])
    return {**batch, "position_ids": positions}


def test_the_models_sum_on_packed_rows_is_the_step_with_the_count_it_scores() -> None:
    """The model's own loss scores every shifted label, the target crossing into a packed
    document too (its label is not -100 there); `hf.causal_lm.items_counted`, which the recipe
    named before, leaves those out: one fewer per document start, 0.1 off the step, silently."""
    model = _model(_gpt2)
    model(**_packed(_batch())).loss.backward()  # the model's own loss, over the whole batch
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    reference = param_tensors(model)

    def run(loss_fn: Callable[..., Any]) -> dict[str, torch.Tensor]:
        model = _model(_gpt2)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=3)
        assert acc.step(_packed(_batch()), loss_fn).stepped
        return param_tensors(model)

    assert relative_gap(run(_models_sum_and_count), reference) < 1e-6  # float32 logits
    # Negative control: the count of the helpers, which drop the targets crossing documents.
    before = lambda model, mb: LossSum(  # noqa: E731
        model(**mb, num_items_in_batch=1).loss, hf.causal_lm.items_counted(mb)
    )
    assert relative_gap(run(before), reference) > 1e-2


def _own_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"][..., 1:] != -100).sum()


@pytest.mark.parametrize(
    "divisor",
    [_own_count, lambda batch: int(_own_count(batch)), lambda batch: WINDOW_TOKENS],
    ids=["own-count", "own-count-int", "window-count"],
)
def test_the_models_loss_divided_by_num_items_and_counted_again_warns(
    divisor: Callable[..., Any],
) -> None:
    """`LossSum(model(**mb, num_items_in_batch=n).loss, count)`: a sum divided by n, divided
    by the window's count again (0.96 off the step, silently): a mean that no graph node
    calls a mean, so the check for means did not see it."""

    def twice(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
        return LossSum(model(**batch, num_items_in_batch=divisor(batch)).loss, _own_count(batch))

    params, said = _ours(twice)
    assert len(said) == 1, said
    assert "SUM divided by" in said[0]
    assert "num_items_in_batch=1" in said[0]
    assert relative_gap(params, _reference()) > 1e-2
    params, said = _ours(_models_sum_and_count)  # control: num_items_in_batch=1, quiet
    assert not said
    assert relative_gap(params, _reference()) < 1e-6
