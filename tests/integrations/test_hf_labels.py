"""gradaccum.hf with labels as users hand them over: other integer widths, other shapes, or
labels that do not fit the task.

Labels read from numpy or a dataset are often int32 (or narrower); a classifier's labels often
come as a column `(batch, 1)`. The helpers read both as the models do, and the steps are the
full-batch ones of `tests/integrations/test_hf.py`. Labels that cannot be meant for the task
(float class ids, a classification loss on token logits, regression targets that would
broadcast) are refused before anything changes, with the fix in the message.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.integrations._hf import import_transformers

transformers = import_transformers()

from gradaccum import Accumulator, hf  # noqa: E402
from tests.integrations.test_hf import (  # noqa: E402
    CASES,
    EXACT,
    MICRO,
    ROWS,
    _batches,
    _bert_config,
    _lm_batch,
    _model,
    _optimizer,
    _reference,
    _sequence_batch,
)
from tests.reference import finish_step, param_tensors, relative_gap  # noqa: E402
from tests.state import assert_bitwise, clone_state  # noqa: E402


def _steps(name: str, relabel: Any) -> dict[str, torch.Tensor]:
    make, make_batch, helper, _ = CASES[name]
    model = _model(make)
    acc = Accumulator(model, _optimizer(model), micro_batch_size=MICRO, max_grad_norm=0.5)
    for batch in _batches(make_batch):
        assert acc.step({**batch, "labels": relabel(batch["labels"])}, helper).stepped
    return param_tensors(model)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16])
@pytest.mark.parametrize(
    "name", ["llama-causal_lm", "bert-token_classification", "bert-classification"]
)
def test_integer_labels_of_any_width_equal_the_full_batch_steps(
    name: str, dtype: torch.dtype
) -> None:
    """Before, int32 labels failed inside torch ('expected target dtype to be Long or Byte')."""
    ours = _steps(name, lambda labels: labels.to(dtype))
    assert relative_gap(ours, _reference(name)) < EXACT
    # Negative control: torch's cross-entropy itself takes no such targets.
    with pytest.raises(RuntimeError, match="Long"):
        F.cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=dtype))


def test_single_label_classification_labels_as_a_column_equal_the_full_batch_steps() -> None:
    """Labels `(batch, 1)`, which the models read with `labels.view(-1)`: before, refused."""
    ours = _steps("bert-classification", lambda labels: labels[:, None])
    assert relative_gap(ours, _reference("bert-classification")) < EXACT


def test_integer_labels_count_ahead_as_int64_labels() -> None:
    batch = _lm_batch(torch.Generator().manual_seed(1), 0)
    narrow = {**batch, "labels": batch["labels"].int()}
    assert int(hf.causal_lm.items_counted(narrow)) == int(hf.causal_lm.items_counted(batch))
    logits = torch.randn(ROWS, batch["labels"].shape[1], 40, dtype=torch.float64)
    ids = batch["input_ids"]  # no -100: fits uint8, which cannot hold -100 for the shift
    wide = hf.loss_from_logits(logits, ids, "causal_lm")
    byte = hf.loss_from_logits(logits, ids.to(torch.uint8), "causal_lm")
    assert torch.equal(wide.value, byte.value)
    assert int(wide.count) == int(byte.count)


def _snapshot(model: torch.nn.Module, acc: Accumulator) -> Any:
    return clone_state(
        {
            "params": param_tensors(model),
            "grads": [p.grad for p in model.parameters()],
            "optimizer": acc.optimizer.state_dict(),
            "acc": acc.state_dict(),
        }
    )


def _refused(make: Any, good: dict[str, Any], bad: dict[str, Any], loss_fn: Any) -> str:
    """Step once on `good` with `hf.causal_lm` for a causal LM (else `loss_fn`), then on `bad`
    with `loss_fn`: the error's message, with nothing changed by it."""
    model = _model(make)
    acc = Accumulator(model, _optimizer(model), micro_batch_size=MICRO)
    causal = "ForCausalLM" in type(model).__name__
    assert acc.step(good, hf.causal_lm if causal else loss_fn).stepped
    before = _snapshot(model, acc)
    with pytest.raises((TypeError, ValueError)) as error:
        acc.step(bad, loss_fn)
    assert_bitwise(_snapshot(model, acc), before)
    return str(error.value)


def test_labels_that_do_not_fit_the_task_are_refused_naming_the_fix_changing_nothing() -> None:
    generator = torch.Generator().manual_seed(2)
    llama = CASES["llama-causal_lm"][0]
    lm = _lm_batch(generator, 0)
    floats = {**lm, "labels": lm["labels"].double()}
    assert "labels.long()" in _refused(llama, lm, floats, hf.causal_lm)
    # numpy arrays (a dataset in numpy format): before, "the batch has ... no 'labels' tensor".
    arrays = {key: value.numpy() for key, value in lm.items()}
    assert "return_tensors='pt'" in _refused(llama, lm, arrays, hf.causal_lm)
    # A datasets column through torch's default collate keeps its name, 'label'.
    renamed = {**{k: v for k, v in lm.items() if k != "labels"}, "label": lm["labels"]}
    assert "rename batch['label'] to 'labels'" in _refused(llama, lm, renamed, hf.causal_lm)
    # A classification loss on a language model's token logits was read as token tagging.
    assert "token_classification" in _refused(llama, lm, lm, hf.classification)

    def regression() -> torch.nn.Module:
        config = _bert_config(num_labels=3, problem_type="regression")
        return transformers.BertForSequenceClassification(config)

    rows = _sequence_batch(generator, 0)
    targets = {**rows, "labels": torch.randn(ROWS, 3, generator=generator, dtype=torch.float64)}
    column = {**targets, "labels": targets["labels"][:, :1]}
    assert "one target per output" in _refused(regression, targets, column, hf.classification)
    # Negative control: MSE broadcasts a (batch, 1) column over 3 outputs into a wrong loss.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        broadcast = F.mse_loss(torch.zeros(ROWS, 3), torch.ones(ROWS, 1), reduction="sum")
    assert float(broadcast) == 3 * ROWS

    def single_label() -> torch.nn.Module:
        return transformers.BertForSequenceClassification(_bert_config(num_labels=3))

    multi_hot = {**rows, "labels": (torch.rand(ROWS, 3, generator=generator) > 0.5).long()}
    message = _refused(single_label, rows, multi_hot, hf.classification)
    assert "multi_label_classification" in message
    # Class ids as floats (a dataset's float column) make the model infer multi-label: the
    # refusal used to say only "one target per output", not the .long() that fixes it.
    float_ids = {**rows, "labels": rows["labels"].double()}
    assert "labels.long()" in _refused(single_label, rows, float_ids, hf.classification)


# --- PEFT prompt learning ------------------------------------------------------------------------

VIRTUAL = 3


def _prompt_tuned(make: Any) -> torch.nn.Module:
    """A PEFT prompt-tuned model in float64 (the prompt embedding too: wrap first, then cast)."""
    peft = pytest.importorskip("peft")
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL)
    torch.manual_seed(0)
    model = peft.get_peft_model(make(), config).double()
    model.train()
    return model


def _prompt_reference(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """As PEFT scores it given labels: -100 for each virtual token, then the usual shift."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs).logits
    labels = F.pad(batch["labels"], (VIRTUAL, 0), value=-100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _prompt_steps(loss_fn: Any, wrapped: bool = False) -> dict[str, torch.Tensor]:
    model = _prompt_tuned(CASES["gpt2-causal_lm"][0])
    optimizer = _optimizer(model)
    runs = torch.nn.DataParallel(model) if wrapped else model  # DDP's `.module` layout on CPU
    acc = Accumulator(runs, optimizer, micro_batch_size=MICRO, max_grad_norm=0.5)
    for batch in _batches(_lm_batch):
        if loss_fn is None:  # the plain full-batch step
            optimizer.zero_grad(set_to_none=True)
            _prompt_reference(model, batch).backward()
            finish_step(model, optimizer, None, max_grad_norm=0.5)
        else:
            assert acc.step(batch, loss_fn).stepped
    return param_tensors(model)


def test_prompt_tuning_equals_the_full_batch_steps() -> None:
    """PEFT prompt tuning prepends virtual tokens to the logits; the last one predicts each row's
    first token. Before, the helper refused the longer logits ('do not fit labels')."""
    reference = _prompt_steps(None)
    assert relative_gap(_prompt_steps(hf.causal_lm), reference) < EXACT

    # Negative control: dropping the virtual positions' logits misses each first-token target.
    def dropped(model: torch.nn.Module, batch: dict[str, Any]) -> Any:
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        logits = model(**inputs).logits[:, VIRTUAL:]
        return hf.loss_from_logits(logits, batch["labels"], "causal_lm")

    assert relative_gap(_prompt_steps(dropped), reference) > 1e-3


def test_prompt_tuning_inside_a_data_parallel_wrapper_equals_the_full_batch_steps() -> None:
    """DDP and DataParallel hold the PEFT model as `.module`. Before, the helper looked for its
    prompt-learning config on the wrapper, found none, and refused the longer logits ('do not
    fit labels')."""
    reference = _prompt_steps(None)
    assert relative_gap(_prompt_steps(hf.causal_lm, wrapped=True), reference) < EXACT

    # Negative control: the virtual tokens' logits dropped, as a helper blind to them would.
    def dropped(model: torch.nn.Module, batch: dict[str, Any]) -> Any:
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        logits = model(**inputs).logits[:, VIRTUAL:]
        return hf.loss_from_logits(logits, batch["labels"], "causal_lm")

    assert relative_gap(_prompt_steps(dropped, wrapped=True), reference) > 1e-3


# --- a causal LM of the user's own ---------------------------------------------------------------


class _OwnLM(torch.nn.Module):
    """A nanoGPT-style model: token ids in, a logits tensor out, no `use_cache`, no `**kwargs`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 8)
        self.head = torch.nn.Linear(8, 40)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = (self.embed(input_ids) * attention_mask[..., None]).cumsum(1)  # causal
        logits: torch.Tensor = self.head(torch.tanh(hidden))
        return logits


def test_a_model_of_the_users_own_returning_logits_equals_the_full_batch_steps() -> None:
    """Before, `hf.causal_lm` passed it `use_cache=False` (TypeError naming an argument the user
    never passed) and refused a plain logits tensor ('returned Tensor without logits')."""
    batches = _batches(_lm_batch)

    def run(loss_fn: Any) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = _OwnLM().double()
        optimizer = _optimizer(model)
        acc = Accumulator(model, optimizer, micro_batch_size=MICRO, max_grad_norm=0.5)
        for batch in batches:
            if loss_fn is None:  # the plain full-batch step, the textbook shift
                optimizer.zero_grad(set_to_none=True)
                logits = model(batch["input_ids"], batch["attention_mask"])[:, :-1]
                targets = batch["labels"][:, 1:].flatten()
                F.cross_entropy(logits.flatten(0, 1), targets, ignore_index=-100).backward()
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
                optimizer.step()
            else:
                assert acc.step(batch, loss_fn).stepped
        return param_tensors(model)

    reference = run(None)
    assert relative_gap(run(hf.causal_lm), reference) < EXACT
    # Negative control: the same model given the cache flag the helper gives transformers' models.
    batch = batches[0]
    with pytest.raises(TypeError, match="use_cache"):
        _OwnLM()(batch["input_ids"], batch["attention_mask"], use_cache=False)


# --- DataCollatorWithFlattening batches ----------------------------------------------------------

_FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _flattened_windows() -> tuple[list[list[dict[str, Any]]], list[list[list[int]]]]:
    """Two windows of two flattened batches (3 documents each), and each window's documents."""
    generator = torch.Generator().manual_seed(5)
    collator = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_position_ids=True
    )
    windows, documents = [], []
    for _ in range(2):
        window, texts = [], []
        for _ in range(2):
            lengths = torch.randint(3, 9, (3,), generator=generator).tolist()
            docs = [torch.randint(2, 40, (n,), generator=generator).tolist() for n in lengths]
            window.append(collator([{"input_ids": doc} for doc in docs]))
            texts += docs
        windows.append(window)
        documents.append(texts)
    return windows, documents


def test_flattened_batches_through_micro_step_equal_the_documents_one_per_row() -> None:
    """A DataCollatorWithFlattening batch is one row plus flash-attention kwargs of n + 1
    document offsets, which no batch dimension fits: before, refused with no word of why."""
    windows, documents = _flattened_windows()
    make = CASES["gpt2-causal_lm"][0]
    model = _model(make)
    acc = Accumulator(model, _optimizer(model), accumulation_steps=2, max_grad_norm=0.5)
    before = clone_state(param_tensors(model))
    with pytest.raises(ValueError, match="return_flash_attn_kwargs=False"):
        acc.micro_step(windows[0][0], hf.causal_lm)
    assert_bitwise(param_tensors(model), before)

    def run(strip: tuple[str, ...]) -> dict[str, torch.Tensor]:
        model = _model(make)
        acc = Accumulator(model, _optimizer(model), accumulation_steps=2, max_grad_norm=0.5)
        for window in windows:
            for batch in window:
                acc.micro_step({k: v for k, v in batch.items() if k not in strip}, hf.causal_lm)
        return param_tensors(model)

    reference_model = _model(make)
    optimizer = _optimizer(reference_model)
    for docs in documents:  # the same documents, one per right-padded row, one full batch each
        width = max(len(doc) for doc in docs)
        ids = torch.tensor([doc + [0] * (width - len(doc)) for doc in docs])
        mask = torch.tensor([[1] * len(doc) + [0] * (width - len(doc)) for doc in docs])
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }
        optimizer.zero_grad(set_to_none=True)
        CASES["gpt2-causal_lm"][3](reference_model, batch).backward()
        torch.nn.utils.clip_grad_norm_(list(reference_model.parameters()), 0.5)
        optimizer.step()
    reference = param_tensors(reference_model)
    assert relative_gap(run(_FLASH_KWARGS), reference) < EXACT
    # Negative control: without position_ids the documents of a row are one sequence.
    assert relative_gap(run((*_FLASH_KWARGS, "position_ids")), reference) > 1e-3


def test_flattened_batches_with_a_separator_label_score_it_as_the_model_does() -> None:
    """`DataCollatorWithFlattening(separator_id=eos)` labels each document's first position
    with the separator: the previous document's last position learns to predict it, and the
    model's own loss scores that target. The helper took it for a document's first token
    predicted across the boundary and dropped it: 1.1 off under SGD, silently."""
    eos = 1
    collator = transformers.DataCollatorWithFlattening(separator_id=eos)
    generator = torch.Generator().manual_seed(6)
    window = []
    for _ in range(2):
        lengths = torch.randint(3, 9, (3,), generator=generator).tolist()
        docs = [torch.randint(2, 40, (n,), generator=generator).tolist() for n in lengths]
        window.append(collator([{"input_ids": doc} for doc in docs]))
    make = CASES["gpt2-causal_lm"][0]

    def run(loss_fn: Any) -> dict[str, torch.Tensor]:
        model = _model(make)
        acc = Accumulator(model, _optimizer(model), accumulation_steps=2, max_grad_norm=0.5)
        for batch in window:
            acc.micro_step(batch, loss_fn)
        return param_tensors(model)

    model = _model(make)
    optimizer = _optimizer(model)
    total = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in window)
    for batch in window:  # the plain loss: every shifted label that is not -100
        logits = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        targets = batch["labels"][:, 1:].flatten()
        (F.cross_entropy(logits.logits[0, :-1], targets, reduction="sum") / total).backward()
    finish_step(model, optimizer, None, 0.5)
    reference = param_tensors(model)
    assert all(int(hf.causal_lm.items_counted(batch)) > 0 for batch in window)
    assert sum(int(hf.causal_lm.items_counted(batch)) for batch in window) == total
    assert relative_gap(run(hf.causal_lm), reference) < EXACT

    def without_input_ids(model: torch.nn.Module, batch: dict[str, Any]) -> Any:
        """Negative control: the documents read from position_ids alone, as before."""
        logits = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        position_ids = batch["position_ids"]
        return hf.loss_from_logits(
            logits.logits, batch["labels"], "causal_lm", position_ids=position_ids
        )

    assert relative_gap(run(without_input_ids), reference) > 1e-3
