"""Tests for gradaccum.hf on real Hugging Face architectures built from tiny configs.

Each exactness test runs three AdamW steps with clipping, in float64, on ragged micro-batches
(7 items split 3 + 3 + 1) with uneven padding, and compares the parameters with a full-batch
reference written plainly: one forward over the whole batch, the loss computed the textbook way
(causal LM: slice the logits and labels by one), one backward, clip, step. The negative controls
are what users write today: the model's own `outputs.loss` (a token mean) weighted by rows, and
a causal-LM count taken before the shift.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.integrations._hf import import_transformers

transformers = import_transformers()

import gradaccum  # noqa: E402
from gradaccum import Accumulator, LossSum, hf  # noqa: E402
from gradaccum.loss import TokenMeanWarning  # noqa: E402
from tests.reference import param_tensors, relative_gap  # noqa: E402

VOCAB = 40
ROWS, SEQ, MICRO = 7, 10, 3
STEPS = 3
EXACT = 1e-10

transformers.logging.set_verbosity_error()


# --- tiny models from configs (no download) --------------------------------------------------


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama_config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def _llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(_llama_config())


def _lora_llama() -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
    )
    return peft.get_peft_model(_llama(), config)


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _bart() -> torch.nn.Module:
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def _roberta_tokens() -> torch.nn.Module:
    config = transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=40, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=1, num_labels=5,
    )  # fmt: skip
    return transformers.RobertaForTokenClassification(config)


def _bert_config(**extra: Any) -> Any:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **extra,
    )  # fmt: skip


def _bert_mlm() -> torch.nn.Module:
    return transformers.BertForMaskedLM(_bert_config())


def _bert_tokens() -> torch.nn.Module:
    return transformers.BertForTokenClassification(_bert_config(num_labels=5))


def _bert_sequence() -> torch.nn.Module:
    return transformers.BertForSequenceClassification(_bert_config(num_labels=3))


def _vit() -> torch.nn.Module:
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


# --- batches ---------------------------------------------------------------------------------


def _padded(generator: torch.Generator, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask, right-padded with 0 to SEQ."""
    ids = torch.randint(2, VOCAB, (len(lengths), SEQ), generator=generator)
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def _lengths(step: int) -> list[int]:
    """Uneven padding, and a short row where micro-batches hold few scored tokens."""
    base = [SEQ, 3, 8, 2, SEQ, 5, 7]
    return base[step:] + base[:step]


def _lm_batch(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    ids, mask = _padded(generator, _lengths(step))
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _left_padded_lm_batch(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    """Left padding with the position ids a left-padded row needs (0 at its first token)."""
    batch = _lm_batch(generator, step)
    mask = batch["attention_mask"].flip(1)
    ids, labels = batch["input_ids"].flip(1), batch["labels"].flip(1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}


def _mlm_batch(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    ids, mask = _padded(generator, _lengths(step))
    chosen = (torch.rand(ids.shape, generator=generator) < 0.4) & (mask == 1)
    chosen[:, 0] = True  # every row scores at least one token
    labels = ids.masked_fill(~chosen, -100)
    return {"input_ids": ids.masked_fill(chosen, 1), "attention_mask": mask, "labels": labels}


def _seq2seq_batch(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    ids, mask = _padded(generator, _lengths(step))
    target, target_mask = _padded(generator, _lengths(step + 3)[::-1])
    labels = target.masked_fill(target_mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _token_batch(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    ids, mask = _padded(generator, _lengths(step))
    tags = torch.randint(0, 5, ids.shape, generator=generator)
    return {"input_ids": ids, "attention_mask": mask, "labels": tags.masked_fill(mask == 0, -100)}


def _sequence_batch(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    ids, mask = _padded(generator, _lengths(step))
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.randint(0, 3, (ROWS,), generator=generator),
    }


def _image_batch(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    pixels = torch.randn(ROWS, 3, 8, 8, generator=generator, dtype=torch.float64)
    return {"pixel_values": pixels, "labels": torch.randint(0, 3, (ROWS,), generator=generator)}


# --- plain full-batch references (no gradaccum) ----------------------------------------------


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}


def _reference_causal(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Textbook next-token loss: logits[:, :-1] predict labels[:, 1:], mean over scored ones."""
    logits = model(**_inputs(batch)).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def _reference_aligned(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token loss where logits and labels line up (masked LM, tagging, classification)."""
    if "decoder_input_ids" not in batch and model.config.is_encoder_decoder:
        logits = model(**batch).logits  # the model makes its decoder inputs from the labels
    else:
        logits = model(**_inputs(batch)).logits
    labels = batch["labels"]
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)


def _model_mean(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What users return today: the model's own loss, a mean over its micro-batch."""
    loss: torch.Tensor = model(**batch).loss
    return loss


def _naive_causal(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    """The causal-LM helper with the count taken before the shift (the README's old count)."""
    scored = hf.causal_lm(model, batch)
    return LossSum(scored.value, (batch["labels"] != -100).sum())


# --- the runs ---------------------------------------------------------------------------------

Case = tuple[Callable[[], torch.nn.Module], Callable[..., dict[str, torch.Tensor]], Any, Any]

CASES: dict[str, Case] = {
    "gpt2-causal_lm": (_gpt2, _lm_batch, hf.causal_lm, _reference_causal),
    "llama-causal_lm": (_llama, _lm_batch, hf.causal_lm, _reference_causal),
    "lora-llama-causal_lm": (_lora_llama, _lm_batch, hf.causal_lm, _reference_causal),
    "gpt2-left-padded-causal_lm": (_gpt2, _left_padded_lm_batch, hf.causal_lm, _reference_causal),
    "t5-seq2seq": (_t5, _seq2seq_batch, hf.seq2seq, _reference_aligned),
    "bart-seq2seq": (_bart, _seq2seq_batch, hf.seq2seq, _reference_aligned),
    "bert-masked_lm": (_bert_mlm, _mlm_batch, hf.masked_lm, _reference_aligned),
    "bert-token_classification": (
        _bert_tokens,
        _token_batch,
        hf.token_classification,
        _reference_aligned,
    ),
    "roberta-token_classification": (
        _roberta_tokens,
        _token_batch,
        hf.token_classification,
        _reference_aligned,
    ),
    "bert-classification": (_bert_sequence, _sequence_batch, hf.classification, _reference_aligned),
    "vit-classification": (_vit, _image_batch, hf.classification, _reference_aligned),
}


def _model(make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model in float64, training mode, with its attention key biases frozen.

    A key bias adds the same number to every score of a query, which softmax ignores: its
    gradient is zero in exact arithmetic and rounding noise in practice, and AdamW turns that
    noise into a step of random sign. Such a parameter has no update to compare, so it is frozen
    (GPT-2's fused query-key-value bias keeps real gradients in its other parts).
    """
    torch.manual_seed(0)
    model = make().double()
    for name, param in model.named_parameters():
        if name.endswith(("key.bias", "k_proj.bias")):
            param.requires_grad_(False)
    model.train()
    return model


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)


def _batches(make_batch: Callable[..., dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [make_batch(generator, step) for step in range(STEPS)]


def _run_reference(case: Case) -> dict[str, torch.Tensor]:
    make, make_batch, _, reference_loss = case
    model = _model(make)
    optimizer = _optimizer(model)
    for batch in _batches(make_batch):
        optimizer.zero_grad(set_to_none=True)
        reference_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.5)
        optimizer.step()
    return param_tensors(model)


def _run_ours(case: Case, loss_fn: Any) -> dict[str, torch.Tensor]:
    make, make_batch, _, _ = case
    model = _model(make)
    acc = Accumulator(model, _optimizer(model), micro_batch_size=MICRO, max_grad_norm=0.5)
    for batch in _batches(make_batch):
        assert acc.step(batch, loss_fn).stepped
    return param_tensors(model)


_REFERENCES: dict[str, dict[str, torch.Tensor]] = {}


def _reference(name: str) -> dict[str, torch.Tensor]:
    if name not in _REFERENCES:
        _REFERENCES[name] = _run_reference(CASES[name])
    return _REFERENCES[name]


@pytest.mark.parametrize("name", list(CASES))
def test_helper_equals_the_full_batch_steps(name: str) -> None:
    case = CASES[name]
    gap = relative_gap(_run_ours(case, case[2]), _reference(name))
    assert gap < EXACT, f"{name}: helper is {gap:.1e} from the full-batch reference"


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("vit")])
def test_negative_control_the_models_own_mean_weighted_by_rows_is_not_exact(name: str) -> None:
    """`outputs.loss` is a mean over the micro-batch's scored tokens (or labelled rows): read as
    a mean over rows, it is far from the reference, and the library warns about it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TokenMeanWarning)
        gap = relative_gap(_run_ours(CASES[name], _model_mean), _reference(name))
    if name == "bert-classification":
        assert gap < EXACT  # every row labelled: a mean over rows IS the right weight
    else:
        assert gap > 1e-4, f"{name}: the row-weighted model mean is only {gap:.1e} off"


def _gradients(case: Case, loss_fn: Any, micro: int | None) -> dict[str, torch.Tensor]:
    """The first batch's gradient: by `gradaccum.accumulate_grad`, or plainly (`micro=None`)."""
    make, make_batch, _, reference_loss = case
    model = _model(make)
    batch = _batches(make_batch)[0]
    if micro is None:
        reference_loss(model, batch).backward()
    else:
        gradaccum.accumulate_grad(model, batch, loss_fn, micro_batch_size=micro)
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(CASES))
def test_helper_gradient_equals_the_full_batch_gradient(name: str) -> None:
    """The gradient itself, which AdamW and clipping would hide a constant factor of."""
    case = CASES[name]
    gap = relative_gap(_gradients(case, case[2], MICRO), _gradients(case, None, None))
    assert gap < EXACT, f"{name}: gradient is {gap:.1e} from the full-batch gradient"


@pytest.mark.parametrize("name", [n for n in CASES if n.endswith("causal_lm")])
def test_negative_control_counting_labels_before_the_shift_is_not_exact(name: str) -> None:
    """`(labels != -100).sum()` counts one token per row the shifted labels do not score."""
    case = CASES[name]
    gap = relative_gap(_gradients(case, _naive_causal, MICRO), _gradients(case, None, None))
    assert gap > 1e-2, f"{name}: the unshifted count is only {gap:.1e} off"


def test_negative_control_dividing_by_accumulation_steps_is_not_exact_on_images() -> None:
    """ViT labels every row, so the row weight is right; the blog posts' `loss / steps` on the
    ragged 3 + 3 + 1 split is not."""
    make, make_batch, _, _ = CASES["vit-classification"]
    model = _model(make)
    optimizer = _optimizer(model)
    for batch in _batches(make_batch):
        optimizer.zero_grad(set_to_none=True)
        pieces = [{k: v[i : i + MICRO] for k, v in batch.items()} for i in range(0, ROWS, MICRO)]
        for piece in pieces:
            (model(**piece).loss / len(pieces)).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
        optimizer.step()
    gap = relative_gap(param_tensors(model), _reference("vit-classification"))
    assert gap > 1e-4


def test_helpers_count_what_the_models_own_loss_counts() -> None:
    """Against each model's own full-batch `outputs.loss` (computed in float32 by the model)."""
    generator = torch.Generator().manual_seed(3)
    for name, (make, make_batch, helper, _) in CASES.items():
        model = _model(make)
        batch = make_batch(generator, 0)
        ours = helper(model, batch)
        with torch.no_grad():
            theirs = float(model(**batch).loss)
        assert float(ours.value) / int(ours.count) == pytest.approx(theirs, rel=1e-6), name


def test_lora_trains_only_the_adapters() -> None:
    model = _model(_lora_llama)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    acc = Accumulator(model, _optimizer(model), micro_batch_size=MICRO)
    acc.step(_lm_batch(torch.Generator().manual_seed(0), 0), hf.causal_lm)
    assert frozen
    assert all(
        torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad
    )
    assert all(p.grad is None for p in model.parameters())


# --- packed sequences ---------------------------------------------------------------------------


def _documents(generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(2, VOCAB, (n,), generator=generator) for n in (5, 3, 6, 4, 2, 6)]


def _packed(documents: list[torch.Tensor], rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Rows of concatenated documents with `position_ids` restarting at 0, padded to equal
    length; the labels are the tokens themselves (nothing marks the boundaries)."""
    width = max(sum(len(documents[i]) for i in row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            doc = documents[i]
            ids[r, start : start + len(doc)] = doc
            labels[r, start : start + len(doc)] = doc
            positions[r, start : start + len(doc)] = torch.arange(len(doc))
            start += len(doc)
        positions[r, start:] = torch.arange(width - start)  # padding: its own "document"
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _separate(documents: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    width = max(len(d) for d in documents)
    ids = torch.zeros(len(documents), width, dtype=torch.long)
    mask = torch.zeros(len(documents), width, dtype=torch.long)
    for r, doc in enumerate(documents):
        ids[r, : len(doc)], mask[r, : len(doc)] = doc, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _grads_after(model: torch.nn.Module, batch: Any, loss_fn: Any, micro: int) -> dict[str, Any]:
    model = copy.deepcopy(model)
    gradaccum.accumulate_grad(model, batch, loss_fn, micro_batch_size=micro)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_rows_equal_the_documents_run_one_by_one() -> None:
    """Six documents packed three rows deep give the gradient of the same documents run as
    separate padded rows: no token is predicted across a boundary, and (the model's part) no
    token attends across one."""
    model = _model(_llama)
    documents = _documents(torch.Generator().manual_seed(5))
    packed = _packed(documents, [[0, 1], [2, 3, 4], [5]])
    separate = _grads_after(model, _separate(documents), hf.causal_lm, micro=4)
    assert relative_gap(_grads_after(model, packed, hf.causal_lm, micro=2), separate) < EXACT

    # Negative control: the same packed rows, the model isolating the documents, but the loss
    # predicting each document's first token from the previous document's last one.
    def unaware(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> LossSum:
        logits = m(**{k: v for k, v in b.items() if k != "labels"}, use_cache=False).logits
        return hf.loss_from_logits(logits, b["labels"], "causal_lm")

    assert relative_gap(_grads_after(model, packed, unaware, micro=2), separate) > 1e-2


def test_packed_rows_attend_across_documents_when_the_model_keeps_a_cache() -> None:
    """Why `causal_lm` passes `use_cache=False`: transformers builds the block-diagonal mask of
    a packed row only without a cache, and a causal LM keeps one by default."""
    model = _model(_llama)
    documents = _documents(torch.Generator().manual_seed(5))
    packed = _packed(documents, [[0, 1]])
    inputs = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]}
    with torch.no_grad():
        alone = model(input_ids=documents[1][None], use_cache=False).logits[0]
        isolated = model(**inputs, use_cache=False).logits[0, 5:8]
        default = model(**inputs).logits[0, 5:8]
    torch.testing.assert_close(isolated, alone, rtol=1e-12, atol=1e-12)
    assert float((default - alone).abs().max()) > 1e-3


def test_flattened_rows_with_cu_seq_lens_count_each_document_alone() -> None:
    """One flattened row with `cu_seq_lens_q` (the flash-attention form): the targets that
    would cross a boundary are not scored."""
    logits = torch.randn(1, 9, VOCAB, dtype=torch.float64)
    labels = torch.randint(2, VOCAB, (1, 9))
    bounds = torch.tensor([0, 4, 9], dtype=torch.int32)
    ours = hf.loss_from_logits(logits, labels, hf.Task.CAUSAL_LM, cu_seq_lens=bounds)
    expected = sum(
        F.cross_entropy(logits[0, a : b - 1], labels[0, a + 1 : b], reduction="sum")
        for a, b in ((0, 4), (4, 9))
    )
    assert int(ours.count) == 3 + 4
    torch.testing.assert_close(ours.value, expected, rtol=1e-12, atol=0)


def test_cu_seq_lens_that_are_not_the_tokens_offsets_are_refused() -> None:
    """Offsets of other tokens (the whole batch's beside a micro-batch's logits, offsets cut
    by rows) were read as they were: [0, 3] on 6 tokens counted 5 targets, silently."""
    logits = torch.randn(1, 6, VOCAB, dtype=torch.float64)
    labels = torch.randint(2, VOCAB, (1, 6))
    ours = hf.loss_from_logits(logits, labels, "causal_lm", cu_seq_lens=torch.tensor([0, 3, 6]))
    assert int(ours.count) == 2 + 2  # control: the offsets of these 6 tokens
    for bounds in ([0, 3], [0, 3, 9], [1, 3, 6], [0, 4, 3, 6], [6]):
        with pytest.raises(ValueError, match="no document offsets of these 6 tokens"):
            hf.loss_from_logits(logits, labels, "causal_lm", cu_seq_lens=torch.tensor(bounds))
    batch = {"input_ids": labels, "labels": labels, "cu_seq_lens_q": torch.tensor([0, 3])}
    with pytest.raises(ValueError, match="no document offsets"):
        hf.causal_lm.items_counted(batch)


# --- errors ----------------------------------------------------------------------------------


def test_errors_name_the_fix() -> None:
    model = _model(_bert_mlm)
    with pytest.raises(ValueError, match="no 'labels' tensor"):
        hf.masked_lm(model, {"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(TypeError, match="mapping of the model's keyword inputs"):
        hf.masked_lm(model, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="task"):
        hf.loss_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), "lm")
    with pytest.raises(ValueError, match="do not fit labels"):
        hf.loss_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long), "masked_lm")
    with pytest.raises(ValueError, match="problem_type"):
        hf.loss_from_logits(
            torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), "classification", problem_type="x"
        )


def test_core_does_not_import_transformers() -> None:
    import subprocess
    import sys

    code = "import gradaccum, sys; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["llama-causal_lm", "bert-masked_lm", "t5-seq2seq"])
def test_token_budget_micro_batches_equal_the_full_batch_steps(name: str) -> None:
    """Rows sorted by length, packed within 24 padded tokens and trimmed to each micro-batch's
    longest row: attention over the trimmed rows is the same, so is the step. The seq2seq
    targets are as wide as the inputs (SEQ) with other lengths: trimmed, they must keep every
    scored label (they were once cut to the inputs' lengths)."""
    make, make_batch, helper, _ = CASES[name]
    model = _model(make)
    acc = Accumulator(model, _optimizer(model), max_grad_norm=0.5)
    for batch in _batches(make_batch):
        result = acc.step(batch, helper, max_tokens=24)
        assert result.stepped
        assert result.micro_batches > 2
    assert relative_gap(param_tensors(model), _reference(name)) < EXACT


def test_shift_labels_given_by_the_pipeline_are_scored_as_they_are() -> None:
    """`shift_labels` (already shifted, as some collators make them) are neither shifted again
    nor required to come with `labels`."""
    model = _model(_llama)
    batch = _lm_batch(torch.Generator().manual_seed(4), 0)
    shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    given = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    ours = hf.causal_lm(model, {**given, "shift_labels": shifted})
    reference = hf.causal_lm(model, batch)
    assert int(ours.count) == int(reference.count) == int(hf.causal_lm.items_counted(batch))
    torch.testing.assert_close(ours.value, reference.value, rtol=1e-12, atol=0)


def test_left_padded_rows_with_position_ids_score_their_first_token_as_the_model_does() -> None:
    """A left-padded row's positions start at 0 on its first token, after padding: no document
    boundary. The model scores that token (predicted from the last pad), and so does the helper."""
    model = _model(_gpt2)
    batch = _left_padded_lm_batch(torch.Generator().manual_seed(2), 0)
    ours = hf.causal_lm(model, batch)
    with torch.no_grad():
        theirs = float(model(**batch).loss)
    scored = int((batch["labels"][:, 1:] != -100).sum())
    assert int(ours.count) == int(hf.causal_lm.items_counted(batch)) == scored
    assert float(ours.value) / scored == pytest.approx(theirs, rel=1e-6)
    # Negative control: without the attention mask the helper cannot tell padding from a packed
    # document, drops each padded row's first target, and misses the model's mean.
    blind = hf.causal_lm(model, {k: v for k, v in batch.items() if k != "attention_mask"})
    assert int(blind.count) < scored


@pytest.mark.parametrize("name", ["gpt2-causal_lm", "t5-seq2seq", "bert-masked_lm"])
@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_the_models_own_mean_warns_with_one_row_per_micro_batch(name: str, drive: str) -> None:
    """One row per micro-batch, the usual small-memory setup: `outputs.loss` is that row's token
    mean, weighted by 1, which the library must say. The helpers never warn."""
    make, make_batch, helper, _ = CASES[name]
    batch = _batches(make_batch)[0]

    def warned(loss_fn: Any) -> int:
        model = _model(make)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            if drive == "step":
                Accumulator(model, _optimizer(model), micro_batch_size=1).step(batch, loss_fn)
            else:
                acc = Accumulator(model, _optimizer(model), accumulation_steps=ROWS)
                for row in range(ROWS):
                    acc.micro_step({k: v[row : row + 1] for k, v in batch.items()}, loss_fn)
        return sum(w.category is TokenMeanWarning for w in record)

    assert warned(_model_mean) == 1
    assert warned(helper) == 0


# --- a model inside DataParallel or DistributedDataParallel -------------------------------------


def _bert_regression() -> torch.nn.Module:
    config = _bert_config(num_labels=3, problem_type="regression")
    return transformers.BertForSequenceClassification(config)


def _regression_batch(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    ids, mask = _padded(generator, _lengths(step))
    targets = torch.randn(ROWS, 3, generator=generator, dtype=torch.float64)
    return {"input_ids": ids, "attention_mask": mask, "labels": targets}


def _reference_regression(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(**_inputs(batch)).logits, batch["labels"])


WRAPPED: dict[str, Case] = {
    "t5-seq2seq": CASES["t5-seq2seq"],
    "bart-seq2seq": CASES["bart-seq2seq"],
    "bert-regression": (_bert_regression, _regression_batch, hf.classification, None),
}


def _run_wrapped(name: str, loss_fn: Any) -> dict[str, torch.Tensor]:
    make, make_batch, _, _ = WRAPPED[name]
    model = _model(make)
    wrapped = torch.nn.DataParallel(model)  # on CPU it runs the module: DDP's `.module` layout
    acc = Accumulator(wrapped, _optimizer(model), micro_batch_size=MICRO, max_grad_norm=0.5)
    for batch in _batches(make_batch):
        assert acc.step(batch, loss_fn).stepped
    return param_tensors(model)


@pytest.mark.parametrize("name", list(WRAPPED))
def test_a_model_inside_a_data_parallel_wrapper_equals_the_full_batch_steps(name: str) -> None:
    """DDP and DataParallel hold the model as `.module`; its config and methods are not theirs.
    Before, the helpers read them from the wrapper: a seq2seq model was refused ('DataParallel
    has no prepare_decoder_input_ids_from_labels'), and a multi-output regression's
    `problem_type` was missed, so its float targets were silently scored as multi-label BCE."""
    make, make_batch, helper, reference_loss = WRAPPED[name]
    reference = _run_reference((make, make_batch, helper, reference_loss or _reference_regression))
    assert relative_gap(_run_wrapped(name, helper), reference) < EXACT

    # Negative controls: what the wrapper hid. The regression scored as the model infers it
    # without its problem_type (multi-label), the decoder fed the labels unshifted.
    def hidden(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
        if name == "bert-regression":
            logits = model(**_inputs(batch)).logits
            return hf.loss_from_logits(logits, batch["labels"], "classification")
        unshifted = batch["labels"].clamp(min=0)
        return hf.seq2seq(model, {**batch, "decoder_input_ids": unshifted})

    assert relative_gap(_run_wrapped(name, hidden), reference) > 1e-3
