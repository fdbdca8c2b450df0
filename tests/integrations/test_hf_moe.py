"""Mixture-of-experts models whose own loss adds router losses (`output_router_logits=True`).

Given labels, Mixtral (and Qwen-MoE, OLMoE, Switch...) adds `router_aux_loss_coef * aux_loss` to
its token loss. The `gradaccum.hf` helpers score the logits alone, so they trained silently on
another objective than the model's (no load balancing). Per forward, the router loss is not
additive over micro-batches, so no helper can add it exactly: the helpers now refuse such a
model, naming both fixes, and changing nothing. Without router losses the helper equals the
full-batch step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.integrations._hf import import_transformers

transformers = import_transformers()

from gradaccum import Accumulator, LossSum, hf  # noqa: E402
from gradaccum.loss import Term  # noqa: E402
from tests.reference import param_tensors, relative_gap  # noqa: E402
from tests.state import assert_bitwise, clone_state  # noqa: E402

VOCAB, ROWS, SEQ = 40, 7, 8

transformers.logging.set_verbosity_error()


def _mixtral(router_losses: bool) -> Any:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=router_losses,
        router_aux_loss_coef=0.1, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)  # float32: its grouped experts take no double


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=generator)
    mask = (torch.arange(SEQ)[None, :] < torch.tensor([8, 3, 6, 2, 8, 5, 7])[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_a_model_whose_loss_adds_router_losses_is_refused_changing_nothing() -> None:
    model = _mixtral(router_losses=True)
    batch = _batch()
    assert model(**batch).aux_loss is not None  # the model's own loss adds 0.1 * aux_loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accumulator(model, optimizer, micro_batch_size=3)
    before = clone_state((param_tensors(model), optimizer.state_dict()))
    says = r"router losses \(aux_loss\).*output_router_logits = False.*LossSum.terms"
    with pytest.raises(ValueError, match=says):  # was: trained on the token loss alone
        acc.step(batch, hf.causal_lm)
    assert_bitwise(clone_state((param_tensors(model), optimizer.state_dict())), before)
    assert all(p.grad is None for p in model.parameters())


def test_the_loss_fn_the_error_names_runs_and_keeps_the_router_loss() -> None:
    model = _mixtral(router_losses=True)

    def with_router_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
        ce = hf.loss_from_logits(out.logits, batch["labels"], "causal_lm")
        aux = Term(out.aux_loss, count=1, weight=0.1)
        return LossSum.terms(ce=(ce.value, ce.count), aux=aux)

    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=3)
    result = acc.step(_batch(), with_router_loss)
    assert result.stepped
    assert set(result.terms) == {"ce", "aux"}


def test_without_router_losses_the_helper_equals_the_full_batch_step() -> None:
    model, batch = _mixtral(router_losses=False), _batch()
    reference = copy.deepcopy(model)
    logits = reference(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()

    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=3)
    assert acc.step(batch, hf.causal_lm).stepped
    assert relative_gap(param_tensors(model), param_tensors(reference)) < 1e-5  # float32
