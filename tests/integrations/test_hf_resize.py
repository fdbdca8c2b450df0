"""`resize_token_embeddings` after the optimizer and the Accumulator were built.

transformers resizes the input embedding in place (`weight.data` swapped for a larger tensor:
the same parameter, a new shape) and replaces an untied output embedding by a new parameter.
The optimizer's state (Adam's moments) and an open window's gradients keep the old shape, so
the optimizer used to fail halfway through its step (a `PartialStepError`, the embedding
already decayed), a streamed micro-batch failed in its backward with a bare size mismatch, and
a replaced `lm_head` the optimizer does not hold silently stopped training. Each is now refused
before anything changes, naming the fix. A resize that a plain loop takes (tied embeddings, no
optimizer state yet) still gives the full-batch step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.integrations._hf import import_transformers

transformers = import_transformers()

from gradaccum import Accumulator, hf, load_checkpoint, save_checkpoint  # noqa: E402
from tests.reference import param_tensors, relative_gap  # noqa: E402
from tests.state import assert_bitwise, clone_state  # noqa: E402

VOCAB, NEW_VOCAB, ROWS, SEQ = 40, 48, 7, 10

transformers.logging.set_verbosity_error()


def _gpt2() -> Any:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


MODELS = {"gpt2-tied": _gpt2, "llama-untied": _llama}


def _model(name: str) -> Any:
    torch.manual_seed(0)
    return MODELS[name]().double().train()


def _batch(vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (ROWS, SEQ), generator=generator)
    lengths = torch.tensor([SEQ, 3, 8, 2, SEQ, 5, 7])
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _resize(model: Any) -> None:
    torch.manual_seed(5)  # the new rows are drawn at random: the same in every run
    model.resize_token_embeddings(NEW_VOCAB)


def _state(model: Any, optimizer: torch.optim.Optimizer) -> Any:
    grads = {n: p.grad for n, p in model.named_parameters()}
    return clone_state((param_tensors(model), grads, optimizer.state_dict()))


def _reference_causal(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_resize_after_a_step_is_refused_before_the_optimizer_changing_nothing(name: str) -> None:
    model = _model(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    acc = Accumulator(model, optimizer, micro_batch_size=3, max_grad_norm=1.0)
    assert acc.step(_batch(), hf.causal_lm).stepped
    _resize(model)
    before = _state(model, optimizer)
    with pytest.raises(ValueError, match=r"changed shape.*optimizer holds state.*Resize"):
        acc.step(_batch(NEW_VOCAB), hf.causal_lm)
    assert_bitwise(_state(model, optimizer), before)  # was: the embedding decayed, then a crash


@pytest.mark.parametrize("name", list(MODELS))
def test_a_resize_in_the_middle_of_a_window_is_refused_naming_it(name: str) -> None:
    model = _model(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    first = {k: v[:3] for k, v in _batch().items()}
    acc.micro_step(first, hf.causal_lm)
    _resize(model)
    second = {k: v[3:] for k, v in _batch(NEW_VOCAB).items()}
    resized = r"(wte|embed_tokens).weight \(\(40, 16\) -> \(48, 16\)\) changed shape in the middle"
    with pytest.raises(ValueError, match=resized):
        acc.micro_step(second, hf.causal_lm)  # was: a bare size mismatch from the backward
    assert all(p.grad is None for p in model.parameters())  # the window was discarded


def test_an_untied_output_embedding_replaced_by_the_resize_is_refused() -> None:
    model = _model("llama-untied")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accumulator(model, optimizer, micro_batch_size=3)
    _resize(model)  # no optimizer state yet, but a new lm_head.weight the optimizer lacks
    before = _state(model, optimizer)
    with pytest.raises(ValueError, match=r"replaced others \(lm_head.weight\).*would not train"):
        acc.step(_batch(NEW_VOCAB), hf.causal_lm)  # was: lm_head silently never stepped
    assert_bitwise(_state(model, optimizer), before)


def test_a_resize_a_plain_loop_takes_still_equals_the_full_batch_step() -> None:
    """Tied embeddings, no optimizer state yet: the same parameter, resized, trains exactly."""
    model = _model("gpt2-tied")
    reference = copy.deepcopy(model)
    batch = _batch(NEW_VOCAB)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    acc = Accumulator(model, optimizer, micro_batch_size=3, max_grad_norm=1.0)
    _resize(model)
    for _ in range(2):
        assert acc.step(batch, hf.causal_lm).stepped

    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    _resize(reference)
    for _ in range(2):
        plain.zero_grad(set_to_none=True)
        _reference_causal(reference, batch).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        plain.step()
    assert model.transformer.wte.weight.shape == (NEW_VOCAB, 16)
    assert relative_gap(param_tensors(model), param_tensors(reference)) < 1e-10


def test_a_checkpoint_of_the_resized_model_loads_and_the_run_goes_on_exactly(tmp_path) -> None:
    """The refusal does not block the way back: a checkpoint saved after the resize replaces
    the optimizer's old-shape state, and the run then steps as the run that saved it."""
    batch, path = _batch(NEW_VOCAB), tmp_path / "resized.pt"
    saved = _model("gpt2-tied")
    _resize(saved)
    optimizer = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    acc = Accumulator(saved, optimizer, micro_batch_size=3)
    acc.step(batch, hf.causal_lm)
    save_checkpoint(path, model=saved, optimizer=optimizer, accumulator=acc)
    acc.step(batch, hf.causal_lm)

    model = _model("gpt2-tied")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    resumed = Accumulator(model, optimizer, micro_batch_size=3)
    resumed.step(_batch(), hf.causal_lm)  # Adam's moments of the old shape
    _resize(model)
    with pytest.raises(ValueError, match="optimizer holds state"):
        resumed.step(batch, hf.causal_lm)
    load_checkpoint(path, model=model, optimizer=optimizer, accumulator=resumed)
    assert resumed.step(batch, hf.causal_lm).stepped
    assert relative_gap(param_tensors(model), param_tensors(saved)) < 1e-12
