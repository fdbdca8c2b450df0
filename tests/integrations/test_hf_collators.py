"""Batches as transformers makes them: tokenizer and data-collator outputs (`BatchEncoding`).

A `BatchEncoding` is a `UserDict`, not a dict. Split, moved and packed by gradaccum, it must
give the full-batch step, and a fast tokenizer's output must keep, in each micro-batch, the
per-row `encodings` of its rows: `loss_fn` may read `batch.word_ids(i)` (word-level scoring of
sub-word tokens). Before, every micro-batch was rebuilt without them, and `word_ids()` raised
"not available when using Python based tokenizers" under gradaccum only.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.integrations._hf import import_transformers

transformers = import_transformers()
tokenizers = pytest.importorskip("tokenizers")

from gradaccum import Accumulator, hf, split_batch  # noqa: E402
from tests.reference import param_tensors, relative_gap  # noqa: E402

VOCAB = 40
TEXTS = ["w5 w6 w7", "w8", "w9 w10 w11 w12 w13", "w14 w15", "w16 w17 w18 w19", "w20", "w21 w22"]

transformers.logging.set_verbosity_error()


def _tokenizer() -> Any:
    """A word-level fast tokenizer built in memory (no download)."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    vocab.update({f"w{i}": i for i in range(5, VOCAB)})
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]"
    )


def _gpt2() -> Any:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


def _reference(model: Any, batch: Any) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)


def test_collator_batches_split_moved_and_packed_equal_the_full_batch_step() -> None:
    tokenizer = _tokenizer()
    collate = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    batch = collate([tokenizer(text) for text in TEXTS])
    assert isinstance(batch, transformers.BatchEncoding)
    assert not isinstance(batch, dict)
    model = _gpt2()

    reference = copy.deepcopy(model)
    _reference(reference, batch).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()

    for kwargs in ({}, {"max_tokens": 12}):
        ours = copy.deepcopy(model)
        acc = Accumulator(ours, torch.optim.SGD(ours.parameters(), lr=0.5), micro_batch_size=3)
        assert acc.step(batch, hf.causal_lm, **kwargs).micro_batches > 1
        assert relative_gap(param_tensors(ours), param_tensors(reference)) < 1e-10, kwargs


def test_micro_batches_of_a_tokenizer_output_keep_their_rows_word_ids() -> None:
    tokenizer = _tokenizer()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    rows = [batch.word_ids(i) for i in range(len(TEXTS))]

    parts = split_batch(batch, 3)
    assert [p.word_ids(i) for p in parts for i in range(len(p["input_ids"]))] == rows

    seen: list[list[int | None]] = []

    def word_level(model: torch.nn.Module, micro: Any) -> Any:
        seen.extend(micro.word_ids(i) for i in range(len(micro["input_ids"])))
        return hf.causal_lm(model, micro)

    model = _gpt2()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=3)
    assert acc.step(batch, word_level).micro_batches == 3  # was: ValueError from word_ids()
    assert seen == rows


def test_reordered_or_trimmed_micro_batches_keep_no_encodings() -> None:
    """Token budgets sort the rows: encodings kept as they were would name other rows' words."""
    tokenizer = _tokenizer()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model = _gpt2()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5))

    def word_level(model: torch.nn.Module, micro: Any) -> Any:
        micro.word_ids(0)
        return hf.causal_lm(model, micro)

    with pytest.raises(ValueError, match="word_ids"):
        acc.step(batch, word_level, max_tokens=12)
