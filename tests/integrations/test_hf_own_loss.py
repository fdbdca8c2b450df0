"""A transformers model whose own loss was replaced: `model.loss_function = my_loss`.

Given labels, a transformers model computes its loss with `self.loss_function`, which users set
for label smoothing or a z-loss (or override in a subclass). The `gradaccum.hf` helpers call
the model without labels and score its logits with plain cross-entropy: before, they trained on
that instead, silently (0.29 off the full-batch step of the user's loss on the tiny Llama, 0.5
on GPT-2). They now refuse such a model before anything changes, naming the loss_fn that keeps
the user's loss, which is exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.integrations._hf import import_transformers

transformers = import_transformers()

from gradaccum import Accumulator, LossSum, hf  # noqa: E402
from tests.integrations.test_hf import (  # noqa: E402
    EXACT,
    MICRO,
    _batches,
    _gpt2,
    _lm_batch,
    _model,
    _optimizer,
)
from tests.reference import finish_step, param_tensors, relative_gap  # noqa: E402
from tests.state import assert_bitwise, clone_state  # noqa: E402

transformers.logging.set_verbosity_error()


def smoothed(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    **kwargs: Any,
) -> torch.Tensor:
    """A user's loss_function: the causal-LM loss with label smoothing, as transformers' divides."""
    targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = F.cross_entropy(
        logits.reshape(-1, vocab_size),
        targets.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction="sum" if num_items_in_batch is not None else "mean",
        label_smoothing=0.2,
    )
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


class _SmoothedGPT2(transformers.GPT2LMHeadModel):  # type: ignore[misc]
    """The same loss as a subclass's `loss_function` property."""

    @property
    def loss_function(self) -> Any:
        return smoothed


def _replaced() -> torch.nn.Module:
    model = _gpt2()
    model.loss_function = smoothed
    return model


def _subclassed() -> torch.nn.Module:
    return _SmoothedGPT2(_gpt2().config)


def _keeps_the_users_loss(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> LossSum:
    """The recipe the refusal names."""
    return LossSum(model(**mb, num_items_in_batch=1).loss, (mb["labels"][..., 1:] != -100).sum())


def _reference(make: Any) -> dict[str, torch.Tensor]:
    model = _model(make)
    optimizer = _optimizer(model)
    for batch in _batches(_lm_batch):
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()  # the user's loss, a mean over the whole batch
        finish_step(model, optimizer, None, 0.5)
    return param_tensors(model)


def _ours(make: Any, loss_fn: Any) -> dict[str, torch.Tensor]:
    model = _model(make)
    acc = Accumulator(model, _optimizer(model), micro_batch_size=MICRO, max_grad_norm=0.5)
    for batch in _batches(_lm_batch):
        assert acc.step(batch, loss_fn).stepped
    return param_tensors(model)


@pytest.mark.parametrize("make", [_replaced, _subclassed], ids=["set", "subclass"])
def test_a_replaced_loss_function_is_refused_and_the_recipe_is_the_full_batch_step(
    make: Any,
) -> None:
    model = _model(make)
    acc = Accumulator(model, _optimizer(model), micro_batch_size=MICRO, max_grad_norm=0.5)
    before = clone_state(param_tensors(model))
    batch = _batches(_lm_batch)[0]
    with pytest.raises(ValueError, match=r"loss_function is replaced .*num_items_in_batch=1"):
        acc.step(batch, hf.causal_lm)
    assert_bitwise(param_tensors(model), before)
    assert all(p.grad is None for p in model.parameters())
    reference = _reference(make)
    assert relative_gap(_ours(make, _keeps_the_users_loss), reference) < EXACT
    # Negative control: the helpers' plain cross-entropy, what they trained on before.
    assert relative_gap(_ours(_gpt2, hf.causal_lm), reference) > 1e-2
    with torch.no_grad():  # a validation loss scores the token loss, as for PEFT's terms
        assert hf.causal_lm(model, batch).count > 0
