"""PEFT methods whose model adds a term of its own to the loss (AdaLoRA, Shadow) or has its own
loss (CPT).

A task-typed PEFT model (`get_peft_model` with a `task_type`) called with labels returns the
token loss plus, for AdaLoRA, `orth_reg_weight` times an orthogonal regularization of its
adapters, and for Shadow `auxiliary_loss_weight` times its shadow network's loss. The
`gradaccum.hf` helpers call the model without labels and score its logits: before, they trained
on the token loss alone, silently. They now refuse such a model before anything changes, naming
the weight; docs/losses.md's AdaLoRA block (run here as written) adds the term exactly and runs
AdaLoRA's rank allocation on the window's gradients.
"""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch

from tests.integrations._hf import import_transformers

transformers = import_transformers()
peft = pytest.importorskip("peft", reason="the [hf] extra is not installed")

from gradaccum import Accumulator, hf  # noqa: E402
from tests.integrations.test_hf import (  # noqa: E402
    EXACT,
    MICRO,
    STEPS,
    _batches,
    _llama,
    _lm_batch,
    _naive_causal,
    _reference_causal,
)
from tests.reference import finish_step, param_tensors, relative_gap  # noqa: E402
from tests.state import assert_bitwise, clone_state  # noqa: E402
from tests.test_docs_examples import python_block  # noqa: E402

transformers.logging.set_verbosity_error()


def _adalora(task_type: str | None = "CAUSAL_LM", weight: float = 0.5) -> Any:
    config = peft.AdaLoraConfig(
        task_type=task_type, init_r=4, target_r=2, tinit=1, tfinal=0, deltaT=1,
        total_step=STEPS, target_modules=["q_proj", "v_proj"], lora_alpha=8, lora_dropout=0.0,
        orth_reg_weight=weight,
    )  # fmt: skip
    return _wrapped(config)


def _shadow(weight: float = 0.05) -> Any:
    # Without its dropout (0.2 by default), whose masks differ per micro-batch.
    config = peft.ShadowConfig(
        task_type="CAUSAL_LM", auxiliary_loss_weight=weight, shadow_dropout=0.0
    )
    return _wrapped(config)


def _wrapped(config: Any) -> Any:
    torch.manual_seed(0)
    return peft.get_peft_model(_llama(), config).double().train()


def _optimizer(model: Any) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)


def _logits_loss(model: Any, batch: dict[str, torch.Tensor]) -> float:
    """The token loss of the model's logits (no labels given), a mean."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        scored = hf.loss_from_logits(logits, batch["labels"], "causal_lm")
    return float(scored.value) / int(scored.count)


TERMS = {"adalora": (_adalora, "orth_reg_weight"), "shadow": (_shadow, "auxiliary_loss_weight")}


@pytest.mark.parametrize("name", list(TERMS))
@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_a_peft_model_whose_own_loss_adds_a_term_is_refused_changing_nothing(
    name: str, drive: str
) -> None:
    make, field = TERMS[name]
    model = make()
    batch = _lm_batch(torch.Generator().manual_seed(1), 0)
    # The term is real: the model's own loss is the logits' token loss plus it.
    with torch.no_grad():
        own = float(model(**batch).loss)
    assert own - _logits_loss(model, batch) > 1e-3

    optimizer = _optimizer(model)
    acc = Accumulator(model, optimizer, micro_batch_size=MICRO, accumulation_steps=2)
    before = clone_state(param_tensors(model))
    run = acc.step if drive == "step" else acc.micro_step
    with pytest.raises(ValueError, match=rf"{field}=.*peft_config\['default'\]\.{field} = 0"):
        run(batch, hf.causal_lm)
    assert_bitwise(param_tensors(model), before)
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state
    # A validation loss under no_grad trains nothing: the token loss alone, not refused.
    with torch.no_grad():
        scored = hf.causal_lm(model, batch)
    assert float(scored.value) / int(scored.count) == pytest.approx(_logits_loss(model, batch))


def test_a_cpt_model_whose_own_loss_scores_its_own_labels_is_refused_changing_nothing() -> None:
    """CPT scores the labelled tokens of its context and of the input its `input_type_mask`
    marks, weighted: not the logits' every label, which the helper scored, silently."""
    config = peft.CPTConfig(
        task_type="CAUSAL_LM", cpt_token_ids=[5, 6, 7, 8], cpt_mask=[1, 1, 1, 1],
        cpt_tokens_type_mask=[1, 2, 3, 4],
    )  # fmt: skip
    model = _wrapped(config)
    batch = _lm_batch(torch.Generator().manual_seed(1), 0)
    batch["input_type_mask"] = batch["attention_mask"] * 4  # every input token a label
    with torch.no_grad():  # under no_grad (a validation loss) the helper scores the logits
        own = float(model(**batch).loss)
        scored = hf.causal_lm(model, batch)
    assert abs(own - float(scored.value) / int(scored.count)) > 1e-3  # its own is another one

    optimizer = _optimizer(model)
    acc = Accumulator(model, optimizer, micro_batch_size=MICRO)
    before = clone_state(param_tensors(model))
    with pytest.raises(ValueError, match=r"CPT PEFT model.*loss_fn of your own"):
        acc.step(batch, hf.causal_lm)
    assert_bitwise(param_tensors(model), before)
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state


@pytest.mark.parametrize(
    "make",
    [lambda: _adalora(weight=0.0), lambda: _adalora(task_type=None), lambda: _shadow(0.0)],
    ids=["adalora-weight-0", "adalora-bare-peft-model", "shadow-weight-0"],
)
def test_without_the_term_the_helper_equals_the_full_batch_steps(make: Any) -> None:
    """A weight of 0 adds nothing; a bare `PeftModel` (no task type) skips the tuner's forward,
    so its own loss is the token loss: neither is refused."""
    batch = _lm_batch(torch.Generator().manual_seed(1), 0)
    with torch.no_grad():
        own = float(make()(**batch).loss)
    assert own == pytest.approx(_logits_loss(make(), batch), rel=1e-6)  # float32 logits

    def steps(loss_fn: Any) -> dict[str, torch.Tensor]:
        model = make()
        optimizer = _optimizer(model)
        acc = Accumulator(model, optimizer, micro_batch_size=MICRO, max_grad_norm=0.5)
        for batch in _batches(_lm_batch):
            if loss_fn is None:  # the plain full-batch step
                optimizer.zero_grad(set_to_none=True)
                _reference_causal(model, batch).backward()
                finish_step(model, optimizer, None, max_grad_norm=0.5)
            else:
                assert acc.step(batch, loss_fn).stepped
        return param_tensors(model)

    reference = steps(None)
    assert relative_gap(steps(hf.causal_lm), reference) < EXACT
    # Negative control: the count taken before the causal shift.
    assert relative_gap(steps(_naive_causal), reference) > 1e-3


def _docs_block(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """docs/losses.md's AdaLoRA block, run as written on `model` and `optimizer`."""
    block = textwrap.dedent(python_block("losses.md", "def orthogonality(model)"))
    scope: dict[str, Any] = {"model": model, "optimizer": optimizer, "torch": torch}
    block = block.replace("micro_batch_size=8", f"micro_batch_size={MICRO}")
    exec(compile(block, "docs/losses.md", "exec"), scope)
    return scope


def test_the_documented_adalora_loss_and_rank_allocation_equal_the_full_batch_steps() -> None:
    """The block's term is AdaLoRA's own (the model's loss, to its float32 rounding), and its
    steps, rank allocation included, are the plain loop's: one backward of the token mean plus
    the weighted term, the step, `update_and_allocate` on the gradients, then zero_grad."""
    reference_model = _adalora()
    optimizer = _optimizer(reference_model)
    scratch = _adalora()
    orthogonality = _docs_block(scratch, _optimizer(scratch))["orthogonality"]
    batches = _batches(_lm_batch)
    with torch.no_grad():
        own = float(reference_model(**batches[0]).loss)
        ours = _logits_loss(reference_model, batches[0]) + 0.5 * float(
            orthogonality(reference_model)
        )
    assert own == pytest.approx(ours, rel=1e-6)
    for step, batch in enumerate(batches):
        loss = _reference_causal(reference_model, batch) + 0.5 * orthogonality(reference_model)
        loss.backward()
        trainable = [p for p in reference_model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        reference_model.base_model.update_and_allocate(step)
        optimizer.zero_grad(set_to_none=True)
    reference = param_tensors(reference_model)

    def documented(drop_term: bool) -> dict[str, torch.Tensor]:
        model = _adalora()
        scope = _docs_block(model, _optimizer(model))
        if drop_term:
            scope["weight"] = 0.0  # the term left out: what the helpers trained on before
        for batch in batches:
            assert scope["acc"].step(batch, scope["loss_fn"]).stepped
        assert model.peft_config["default"].orth_reg_weight == 0.0
        return param_tensors(model)

    assert relative_gap(documented(drop_term=False), reference) < EXACT
    # Negative control: without the term the run leaves the reference.
    assert relative_gap(documented(drop_term=True), reference) > 1e-4
