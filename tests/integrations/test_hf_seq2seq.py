"""gradaccum.hf.seq2seq on encoder-decoders without `prepare_decoder_input_ids_from_labels`.

Whisper, Speech2Text, M2M100/NLLB, Blenderbot and Moonshine make their decoder inputs inside
`forward`, shifting the labels right with `config.pad_token_id` and
`config.decoder_start_token_id`, and have no method to call for it. `hf.seq2seq` used to refuse
them, so the HF blog's Whisper batches (`input_features` and `labels` only) could not be used.
It now shifts the labels as those models do. Each test runs the steps of
`tests/integrations/test_hf.py` (float64, AdamW with clipping, 7 rows split 3 + 3 + 1 with
uneven label padding) against a plain full-batch reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.integrations._hf import import_transformers

transformers = import_transformers()

from gradaccum import Accumulator, hf  # noqa: E402
from gradaccum.loss import TokenMeanWarning  # noqa: E402
from tests.integrations.test_hf import (  # noqa: E402
    EXACT,
    MICRO,
    ROWS,
    STEPS,
    VOCAB,
    _gpt2,
    _lengths,
    _model,
    _optimizer,
    _padded,
)
from tests.reference import param_tensors, relative_gap  # noqa: E402
from tests.state import assert_bitwise, clone_state  # noqa: E402


def _whisper(**extra: Any) -> torch.nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=4, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_source_positions=4, max_target_positions=16, pad_token_id=1,
        bos_token_id=2, eos_token_id=3, decoder_start_token_id=2, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, **extra,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config)


def _m2m100() -> torch.nn.Module:
    config = transformers.M2M100Config(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2,
    )  # fmt: skip
    return transformers.M2M100ForConditionalGeneration(config)


def _labels(generator: torch.Generator, step: int) -> torch.Tensor:
    target, mask = _padded(generator, _lengths(step + 3)[::-1])
    return target.masked_fill(mask == 0, -100)


def _audio_batch(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    """What the HF blog's Whisper collator gives: log-mel features and padded labels."""
    features = torch.randn(ROWS, 4, 8, generator=generator, dtype=torch.float64)
    return {"input_features": features, "labels": _labels(generator, step)}


def _text_batch(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    ids, mask = _padded(generator, _lengths(step))
    return {"input_ids": ids, "attention_mask": mask, "labels": _labels(generator, step)}


CASES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[..., dict[str, torch.Tensor]]]] = {
    "whisper": (_whisper, _audio_batch),
    "m2m100": (_m2m100, _text_batch),
}


def _reference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The token mean over the whole batch; the model makes its decoder inputs from the labels."""
    logits = model(**batch).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def _batches(make_batch: Callable[..., dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [make_batch(generator, step) for step in range(STEPS)]


def _reference(name: str) -> dict[str, torch.Tensor]:
    make, make_batch = CASES[name]
    model = _model(make)
    optimizer = _optimizer(model)
    for batch in _batches(make_batch):
        optimizer.zero_grad(set_to_none=True)
        _reference_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.5)
        optimizer.step()
    return param_tensors(model)


def _ours(name: str, loss_fn: Any) -> dict[str, torch.Tensor]:
    make, make_batch = CASES[name]
    model = _model(make)
    acc = Accumulator(model, _optimizer(model), micro_batch_size=MICRO, max_grad_norm=0.5)
    for batch in _batches(make_batch):
        assert acc.step(batch, loss_fn).stepped
    return param_tensors(model)


@pytest.mark.parametrize("name", list(CASES))
def test_seq2seq_without_a_prepare_method_equals_the_full_batch_steps(name: str) -> None:
    assert not hasattr(CASES[name][0](), "prepare_decoder_input_ids_from_labels")
    assert relative_gap(_ours(name, hf.seq2seq), _reference(name)) < EXACT


def test_negative_control_the_models_own_mean_weighted_by_rows_is_not_exact() -> None:
    def model_mean(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss: torch.Tensor = model(**batch).loss
        return loss

    with pytest.warns(TokenMeanWarning):  # the labels hold -100
        ours = _ours("whisper", model_mean)
    assert relative_gap(ours, _reference("whisper")) > 1e-4


def test_decoder_inputs_are_the_models_own_shift() -> None:
    labels = torch.tensor([[5, 6, -100, -100], [7, 8, 9, 4]])
    model = _whisper()
    batch = {"input_features": torch.zeros(2, 4, 8), "labels": labels}
    seen: dict[str, torch.Tensor] = {}
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.update(kwargs), with_kwargs=True)
    hf.seq2seq(model, batch)
    expected = torch.tensor([[2, 5, 6, 1], [2, 7, 8, 9]])  # start token 2; -100 as pad 1
    assert torch.equal(seen["decoder_input_ids"], expected)
    assert "labels" not in seen


class _OwnEncoderDecoder(torch.nn.Module):
    """A model of the user's own: no config to read the decoder's start token from."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input_ids: torch.Tensor,
    ) -> torch.Tensor:
        mask = attention_mask[..., None].to(torch.float64)
        context = (self.embed(input_ids) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
        logits: torch.Tensor = self.head(self.embed(decoder_input_ids) + context)
        return logits


def test_without_the_token_ids_to_shift_with_it_is_refused_changing_nothing() -> None:
    torch.manual_seed(0)
    model = _OwnEncoderDecoder().double()
    optimizer = _optimizer(model)
    acc = Accumulator(model, optimizer, micro_batch_size=MICRO)
    batch = _text_batch(torch.Generator().manual_seed(0), 0)
    before = clone_state((param_tensors(model), optimizer.state_dict(), acc.state_dict()))
    with pytest.raises(ValueError, match="put 'decoder_input_ids'"):
        acc.step(batch, hf.seq2seq)
    assert_bitwise(before, (param_tensors(model), optimizer.state_dict(), acc.state_dict()))
    assert all(p.grad is None for p in model.parameters())
    # With the decoder's inputs in the batch, it runs.
    labels = batch["labels"]
    decoder_input_ids = F.pad(labels[:, :-1], (1, 0), value=0).clamp(min=0)
    assert acc.step({**batch, "decoder_input_ids": decoder_input_ids}, hf.seq2seq).stepped


@pytest.mark.parametrize("with_decoder_inputs", [False, True])
def test_a_decoder_only_model_is_refused_naming_causal_lm(with_decoder_inputs: bool) -> None:
    """GPT-2 ignores `decoder_input_ids`: scored without the shift, it would learn to copy its
    input. Was: the message asked for `decoder_input_ids`, and with them it trained so."""
    model = _model(_gpt2)
    optimizer = _optimizer(model)
    acc = Accumulator(model, optimizer, micro_batch_size=MICRO)
    batch = _text_batch(torch.Generator().manual_seed(0), 0)
    if with_decoder_inputs:
        batch["decoder_input_ids"] = batch["input_ids"]
    before = clone_state((param_tensors(model), optimizer.state_dict()))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel is none.*use gradaccum.hf.causal_lm"):
        acc.step(batch, hf.seq2seq)
    assert_bitwise(before, (param_tensors(model), optimizer.state_dict()))
