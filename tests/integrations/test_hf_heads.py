"""Hugging Face task heads as the course and example scripts train them, against a full-batch step.

Tiny random configs (no download), float64, SGD steps compared with one plain full-batch step
(rtol 1e-10): Wav2Vec2 CTC under a token budget, where trimming the padding changes a GroupNorm
over time (refused, naming the fix) but not a per-frame LayerNorm (exact); extractive QA, whose
own loss averages a start and an end mean over the positions inside the inputs, through the
docs/losses.md recipe.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.integrations._hf import import_transformers

transformers = import_transformers()

import gradaccum.accumulator  # noqa: E402
import gradaccum.packing  # noqa: E402
from gradaccum import Accumulator, LossSum, hf  # noqa: E402
from gradaccum._trimmed_norms import trimmed_norms_refused  # noqa: E402
from gradaccum.loss import Term, TokenMeanWarning  # noqa: E402
from gradaccum.packing import pack_by_tokens  # noqa: E402
from tests.reference import param_tensors, relative_gap, state_tensors  # noqa: E402

EXACT = 1e-10
STEPS = 2

transformers.logging.set_verbosity_error()

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], Any]


def _own_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    loss: torch.Tensor = model(**batch).loss
    return loss


def _steps(
    make: Callable[[], torch.nn.Module],
    batches: list[Batch],
    loss_fn: LossFn,
    reference: LossFn,
    **step: Any,
) -> float:
    """The parameters' gap after SGD steps through `acc.step(**step)` and plain full-batch ones."""
    torch.manual_seed(0)
    model = make().double()
    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, micro_batch_size=step.pop("micro_batch_size", None))
    for batch in batches:
        plain_optimizer.zero_grad()
        reference(plain, batch).backward()
        plain_optimizer.step()
        acc.step(batch, loss_fn, **step)
    return _gap(param_tensors(model), param_tensors(plain))


def _gap(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest parameter gap relative to the largest parameter.

    Per tensor it would be noise: a bias that shifts every position's logit alike (a key's, a
    QA head's, the LayerNorm under it) has a gradient of rounding noise and stays near 0.
    """
    scale = max(float(t.abs().max()) for t in expected.values())
    return max(float((actual[k] - t).abs().max()) for k, t in expected.items()) / scale


# --- Wav2Vec2 CTC: a token budget trims the padding a GroupNorm over time normalizes ----------


def _wav2vec2(norm: str) -> Callable[[], torch.nn.Module]:
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, ctc_loss_reduction="mean", pad_token_id=0,
        feat_extract_norm=norm, do_stable_layer_norm=norm == "layer",
    )  # fmt: skip
    return lambda: transformers.Wav2Vec2ForCTC(config)


def _audio_batch(generator: torch.Generator, rows: int = 7) -> Batch:
    """Padded `input_values` with their `attention_mask`, labels padded with -100."""
    lengths = torch.randint(300, 600, (rows,), generator=generator)
    targets = torch.randint(2, 8, (rows,), generator=generator)
    values = torch.zeros(rows, int(lengths.max()), dtype=torch.float64)
    mask = torch.zeros(rows, int(lengths.max()), dtype=torch.long)
    labels = torch.full((rows, int(targets.max())), -100)
    for row, (length, target) in enumerate(zip(lengths.tolist(), targets.tolist(), strict=True)):
        values[row, :length] = torch.randn(length, generator=generator, dtype=torch.float64)
        mask[row, :length] = 1
        labels[row, :target] = torch.randint(1, 12, (target,), generator=generator)
    return {"input_values": values, "attention_mask": mask, "labels": labels}


def _audio_batches() -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    return [_audio_batch(generator) for _ in range(STEPS)]


def test_a_token_budget_over_a_group_norm_in_time_is_refused_changing_nothing() -> None:
    torch.manual_seed(0)
    model = _wav2vec2("group")().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accumulator(model, optimizer, micro_batch_size=None)
    batches = _audio_batches()
    acc.step(batches[0], _own_loss, max_tokens=10_000)  # one micro-batch: nothing refused
    before = state_tensors(model, optimizer)
    with pytest.raises(ValueError, match="feat_extract_norm='layer'") as error:
        acc.step(batches[1], _own_loss, max_tokens=1500)
    message = str(error.value)
    assert "GroupNorm at wav2vec2.feature_extractor.conv_layers.0.layer_norm" in message
    assert "micro_batch_size=" in message
    assert relative_gap(state_tensors(model, optimizer), before) == 0.0
    assert all(p.grad is None for p in model.parameters())
    assert acc.step(batches[1], _own_loss, max_tokens=10_000).stepped  # one micro-batch: exact


def test_negative_control_the_trimmed_group_norm_was_silently_off(monkeypatch) -> None:
    monkeypatch.setattr(
        gradaccum.accumulator, "trimmed_norms_refused", lambda *_: contextlib.nullcontext()
    )
    gap = _steps(_wav2vec2("group"), _audio_batches(), _own_loss, _own_loss, max_tokens=1500)
    assert gap > 1e-3


@pytest.mark.parametrize(
    ("norm", "step"),
    [("layer", {"max_tokens": 1500}), ("group", {"micro_batch_size": 3})],
    ids=["per-frame-norm-trimmed", "group-norm-untrimmed"],
)
def test_ctc_equals_the_full_batch_steps_where_padding_is_kept_or_masked(
    norm: str, step: dict[str, Any]
) -> None:
    gap = _steps(_wav2vec2(norm), _audio_batches(), _own_loss, _own_loss, **step)
    assert gap < EXACT


def _padded_past_its_rows(batch: Batch, extra: int = 100) -> Batch:
    """`batch` padded `extra` positions past its longest row (`padding="max_length"`)."""
    return {
        "input_values": F.pad(batch["input_values"], (0, extra)),
        "attention_mask": F.pad(batch["attention_mask"], (0, extra)),
        "labels": batch["labels"],
    }


def _equal_rows(rows: int = 6, length: int = 400, extra: int = 100) -> Batch:
    """Rows of one length padded past it: every micro-batch is trimmed to the same width."""
    generator = torch.Generator().manual_seed(3)
    batch = _audio_batch(generator, rows)
    values = torch.randn(rows, length, generator=generator, dtype=torch.float64)
    mask = torch.ones(rows, length, dtype=torch.long)
    return _padded_past_its_rows({**batch, "input_values": values, "attention_mask": mask}, extra)


@pytest.mark.parametrize(
    ("batch", "max_tokens"),
    [(_padded_past_its_rows(_audio_batches()[0]), 10_000), (_equal_rows(), 800)],
    ids=["one-micro-batch", "equal-widths"],
)
def test_a_group_norm_over_rows_all_trimmed_alike_is_refused_changing_nothing(
    batch: Batch, max_tokens: int
) -> None:
    widths = {mb["attention_mask"].shape[1] for mb in pack_by_tokens(batch, max_tokens)}
    assert len(widths) == 1
    assert max(widths) < batch["attention_mask"].shape[1]
    torch.manual_seed(0)
    model = _wav2vec2("group")().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accumulator(model, optimizer, micro_batch_size=None)
    before, rng = state_tensors(model, optimizer), torch.random.get_rng_state()
    with pytest.raises(ValueError, match="the batch's is") as error:
        acc.step(batch, _own_loss, max_tokens=max_tokens)
    assert "feat_extract_norm='layer'" in str(error.value)
    assert relative_gap(state_tensors(model, optimizer), before) == 0.0
    assert all(p.grad is None for p in model.parameters())
    assert model.training
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_negative_control_a_group_norm_over_rows_all_trimmed_alike_was_off(monkeypatch) -> None:
    monkeypatch.setattr(  # the check before: micro-batches compared among themselves only
        gradaccum.accumulator,
        "trimmed_norms_refused",
        lambda model, micro_batches, *_: trimmed_norms_refused(model, micro_batches),
    )
    batches = [_padded_past_its_rows(b) for b in _audio_batches()]
    gap = _steps(_wav2vec2("group"), batches, _own_loss, _own_loss, max_tokens=10_000)
    assert gap > 1e-4


class _CaptionedImages(torch.nn.Module):
    """Text pooled over its mask plus an image through a GroupNorm: its extent is the image's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 4)
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.norm = torch.nn.GroupNorm(2, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixels: torch.Tensor):
        mask = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        text = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        image = self.norm(self.conv(pixels)).mean((2, 3))
        return self.head(text * image).squeeze(-1)


def test_a_group_norm_whose_extent_is_not_the_trimmed_axis_is_exact_and_probed_once() -> None:
    generator = torch.Generator().manual_seed(4)
    rows, width = 6, 12  # every row 5 tokens long: all micro-batches trimmed to 5
    mask = torch.zeros(rows, width, dtype=torch.long)
    mask[:, :5] = 1
    full = {
        "input_ids": torch.randint(1, 20, (rows, width), generator=generator) * mask,
        "attention_mask": mask,
        "pixels": torch.randn(rows, 1, 6, 6, generator=generator, dtype=torch.float64),
        "targets": torch.randn(rows, generator=generator, dtype=torch.float64),
    }
    torch.manual_seed(0)
    model = _CaptionedImages().double()
    plain = copy.deepcopy(model)
    calls: list[int] = []

    def loss_fn(m: torch.nn.Module, b: Batch) -> LossSum:
        calls.append(len(b["attention_mask"]))
        out = m(b["input_ids"], b["attention_mask"], b["pixels"])
        return LossSum(((out - b["targets"]) ** 2).sum(), len(out))

    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=None)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(2):
        plain_optimizer.zero_grad()
        (loss_fn(plain, full).value / rows).backward()
        plain_optimizer.step()
        acc.step(full, loss_fn, max_tokens=10)
    assert _gap(param_tensors(model), param_tensors(plain)) < EXACT
    assert calls[:5] == [6, 1, 2, 2, 2]  # the reference, the untrimmed row, three of 2 rows
    assert calls[5:] == [6, 2, 2, 2]  # the next window: not probed again


# --- extractive QA: a start and an end mean, each over the positions inside the inputs -------


def _tiny_bert_config() -> transformers.BertConfig:
    """A one-layer BERT of width 16, without dropout (QA and multiple-choice heads share it)."""
    return transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
    )  # fmt: skip


def _bert_qa() -> torch.nn.Module:
    config = _tiny_bert_config()
    return transformers.BertForQuestionAnswering(config)


def _qa_batch(generator: torch.Generator, outside: str, rows: int = 7) -> Batch:
    lengths = torch.randint(4, 12, (rows,), generator=generator)
    ids = torch.zeros(rows, int(lengths.max()), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths.tolist()):
        ids[row, :length] = torch.randint(1, 50, (length,), generator=generator)
        mask[row, :length] = 1
    start = (torch.rand(rows, generator=generator) * (lengths - 2)).long()
    end = start + 1
    if outside == "end":  # an answer cut off by truncation: only its end is past the inputs
        end[[1, 5]] = 99
    elif outside == "both":  # a whole micro-batch without a position inside (HF: a NaN mean)
        start[:3], end[:3] = 99, 120
    batch = {"input_ids": ids, "attention_mask": mask}
    return {**batch, "start_positions": start, "end_positions": end}


def _qa_batches(outside: str) -> list[Batch]:
    generator = torch.Generator().manual_seed(2)
    return [_qa_batch(generator, outside) for _ in range(STEPS)]


def _qa_recipe(model: torch.nn.Module, micro_batch: Batch) -> Any:
    """docs/losses.md, Extractive question answering, as written there."""
    positions = ("start_positions", "end_positions")
    inputs = {k: v for k, v in micro_batch.items() if k not in positions}
    out = model(**inputs)
    n = out.start_logits.shape[1]
    start = micro_batch["start_positions"].clamp(0, n)
    end = micro_batch["end_positions"].clamp(0, n)
    return LossSum.terms(
        start=Term(
            F.cross_entropy(out.start_logits, start, ignore_index=n, reduction="sum"),
            count=(start != n).sum(),
            weight=0.5,
        ),
        end=Term(
            F.cross_entropy(out.end_logits, end, ignore_index=n, reduction="sum"),
            count=(end != n).sum(),
            weight=0.5,
        ),
    )


@pytest.mark.parametrize("outside", ["none", "end", "both"])
def test_the_qa_recipe_equals_the_full_batch_steps_of_the_models_own_loss(outside: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gap = _steps(_bert_qa, _qa_batches(outside), _qa_recipe, _own_loss, micro_batch_size=3)
    assert gap < EXACT


def test_the_models_own_qa_loss_is_exact_while_every_position_is_inside() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gap = _steps(_bert_qa, _qa_batches("none"), _own_loss, _own_loss, micro_batch_size=3)
    assert gap < EXACT


def test_negative_control_the_own_qa_loss_with_a_clamped_end_warns_naming_the_terms() -> None:
    with pytest.warns(TokenMeanWarning, match=r"combines 2 .*LossSum\.terms\(start=Term") as seen:
        gap = _steps(_bert_qa, _qa_batches("end"), _own_loss, _own_loss, micro_batch_size=3)
    assert "Extractive question answering" in str(seen[0].message)
    assert gap > 1e-3


@pytest.mark.parametrize("loss_fn", [_own_loss, _qa_recipe], ids=["own-loss", "recipe"])
def test_qa_under_a_token_budget_that_trims_is_refused_changing_nothing(loss_fn: LossFn) -> None:
    torch.manual_seed(0)
    model = _bert_qa().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accumulator(model, optimizer, micro_batch_size=None)
    before = state_tensors(model, optimizer)
    with pytest.raises(ValueError, match="start_positions and end_positions") as error:
        acc.step(_qa_batches("none")[0], loss_fn, max_tokens=24)
    assert "micro_batch_size=" in str(error.value)
    assert relative_gap(state_tensors(model, optimizer), before) == 0.0
    assert all(p.grad is None for p in model.parameters())


def test_qa_under_a_token_budget_that_trims_nothing_is_exact() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gap = _steps(_bert_qa, _qa_batches("end"), _qa_recipe, _own_loss, max_tokens=10_000)
    assert gap < EXACT


def test_negative_control_qa_trimmed_was_off_with_every_position_inside(monkeypatch) -> None:
    monkeypatch.setattr(gradaccum.packing, "_refuse_trimmed_spans", lambda *_: None)
    gap = _steps(_bert_qa, _qa_batches("none"), _qa_recipe, _own_loss, max_tokens=24)
    assert gap > 1e-3


@pytest.mark.parametrize("helper", [hf.classification, hf.token_classification])
def test_the_hf_helpers_on_a_qa_head_name_the_recipe_changing_nothing(helper: Any) -> None:
    torch.manual_seed(0)
    model = _bert_qa().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = state_tensors(model, optimizer)
    batch = {**_qa_batches("none")[0], "labels": torch.zeros(7, dtype=torch.long)}
    acc = Accumulator(model, optimizer, micro_batch_size=3)
    with pytest.raises(TypeError, match=r"docs/losses\.md, Extractive question answering"):
        acc.step(batch, helper)
    assert relative_gap(state_tensors(model, optimizer), before) == 0.0
    assert all(p.grad is None for p in model.parameters())


def _lora(model: torch.nn.Module, targets: list[str], task: str | None = None) -> torch.nn.Module:
    """`get_peft_model(model, LoraConfig(...))`, as the PEFT fine-tuning guides wrap a head."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=targets, task_type=task)
    wrapped: torch.nn.Module = peft.get_peft_model(model, config)
    return wrapped


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "peft-lora"])
@pytest.mark.parametrize(
    "helper", [hf.classification, hf.token_classification, hf.masked_lm, hf.causal_lm]
)
def test_the_hf_helpers_on_a_ctc_head_name_its_own_loss_changing_nothing(
    helper: Any, lora: bool
) -> None:
    torch.manual_seed(0)
    model = _wav2vec2("layer")().double()
    if lora:  # before, a PeftModel's class hid the head: it failed on the logits' shape
        model = _lora(model, ["q_proj", "v_proj"])
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    before = state_tensors(model, optimizer)
    acc = Accumulator(model, optimizer, micro_batch_size=3)
    with pytest.raises(ValueError, match=r"Wav2Vec2ForCTC is a CTC model.*\.loss"):
        acc.step(_audio_batches()[0], helper)
    assert relative_gap(state_tensors(model, optimizer), before) == 0.0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("helper", [hf.classification, hf.token_classification])
def test_the_hf_helpers_on_a_peft_qa_head_name_the_recipe(helper: Any) -> None:
    torch.manual_seed(0)
    model = _lora(_bert_qa().double(), ["query", "value"], "QUESTION_ANS")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    before = state_tensors(model, optimizer)
    batch = {**_qa_batches("none")[0], "labels": torch.zeros(7, dtype=torch.long)}
    with pytest.raises(TypeError, match="Extractive question answering"):
        Accumulator(model, optimizer, micro_batch_size=3).step(batch, helper)
    assert relative_gap(state_tensors(model, optimizer), before) == 0.0


def _tiny_t5() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _t5_batch() -> Batch:
    generator = torch.Generator().manual_seed(5)
    labels = torch.randint(1, 50, (7, 5), generator=generator)
    labels[::2, 3:] = -100
    ids = torch.randint(1, 50, (7, 9), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "peft-lora"])
def test_causal_lm_on_an_encoder_decoder_names_seq2seq_changing_nothing(lora: bool) -> None:
    torch.manual_seed(0)
    model = _tiny_t5().double()
    if lora:
        model = _lora(model, ["q", "v"], "SEQ_2_SEQ_LM")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    before = state_tensors(model, optimizer)
    acc = Accumulator(model, optimizer, micro_batch_size=3)
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder"):
        acc.step(_t5_batch(), hf.causal_lm)  # before: "You must specify exactly one of ..."
    assert relative_gap(state_tensors(model, optimizer), before) == 0.0


def _t5_own_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    loss: torch.Tensor = model(**batch).loss
    return loss


def test_seq2seq_on_a_peft_lora_t5_equals_its_own_full_batch_loss() -> None:
    gap = _steps(
        lambda: _lora(_tiny_t5(), ["q", "v"], "SEQ_2_SEQ_LM"),
        [_t5_batch()],
        hf.seq2seq,
        _t5_own_loss,
        micro_batch_size=3,
    )
    assert gap < EXACT


# --- multiple choice: rows of (choices, seq), split on dim 0 -----------------------------------


def _bert_choices() -> torch.nn.Module:
    config = _tiny_bert_config()
    return transformers.BertForMultipleChoice(config)


def _choices_batches(rows: int = 7, choices: int = 4, seq: int = 11) -> list[Batch]:
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(STEPS):
        lengths = torch.randint(3, seq + 1, (rows, choices, 1), generator=generator)
        mask = (torch.arange(seq) < lengths).long()
        ids = torch.randint(1, 50, (rows, choices, seq), generator=generator) * mask
        labels = torch.randint(0, choices, (rows,), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


@pytest.mark.parametrize(
    ("loss_fn", "step"),
    [
        (_own_loss, {"micro_batch_size": 3}),
        (hf.classification, {"micro_batch_size": 3}),
        (_own_loss, {"max_tokens": 100}),
    ],
    ids=["own-loss", "hf-classification", "token-budget"],
)
def test_multiple_choice_equals_the_full_batch_steps(loss_fn: Any, step: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gap = _steps(_bert_choices, _choices_batches(), loss_fn, _own_loss, **step)
    assert gap < EXACT


def test_a_token_budget_counts_every_choice_of_a_multiple_choice_row() -> None:
    batch = _choices_batches(rows=8)[0]  # 4 choices of 11 tokens: 44 per row
    micro_batches = pack_by_tokens(batch, 100)
    assert [len(mb["labels"]) for mb in micro_batches] == [2, 2, 2, 2]
    assert all(mb["input_ids"].shape[1:] == (4, 11) for mb in micro_batches)  # not trimmed
