"""Hugging Face `transformers` losses as sum and count, so accumulation is exact in one line.

A Hugging Face model given `labels` returns `outputs.loss`, a mean over the micro-batch's scored
tokens (or rows). Weighting such means by rows is not the full-batch mean when padding differs
between micro-batches, and counting `(labels != -100)` is off for a causal LM, which shifts its
labels by one before it scores them. Each function here runs the model WITHOUT its labels, reads
its logits and returns `LossSum(summed loss, items it scored)`, counted the way the model's own
loss counts them:

- `causal_lm`: next-token prediction; the labels are shifted as the model shifts them, and a
  token that starts a new document of a packed row (`position_ids` back at 0, or
  `cu_seq_lens_q`) is not predicted from the previous document's last token (a separator
  label there, not the token at that position, is, as the model's own loss scores it);
- `seq2seq`: encoder-decoder models (T5, BART); the decoder's inputs are made from the labels
  as the model makes them;
- `masked_lm`: masked language models (BERT); every label that is not -100 is scored;
- `classification`: one label per example (sequence or image classification), following the
  model's `problem_type` (single-label, multi-label or regression), as the model does;
- `token_classification`: one label per token.

`loss_from_logits` is the same arithmetic for a forward the user writes.

This module needs `transformers` only for the models themselves: it imports nothing from it.
Install the extra with `pip install 'gradaccum[hf]'` (see the README, section Installing).

Example:
    >>> import torch, gradaccum
    >>> from gradaccum import hf
    >>> logits = torch.randn(2, 5, 11)
    >>> labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 7, 8]])
    >>> hf.loss_from_logits(logits, labels, "causal_lm").count  # 2 + 4 tokens scored
    tensor(6)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from gradaccum._hf_model import (
    accepts_keyword,
    logits_of,
    problem_type_of,
    refuse_ctc_head,
    refuse_encoder_decoder,
    refuse_own_loss_function,
    refuse_peft_loss_terms,
    refuse_router_losses,
    virtual_tokens,
    with_decoder_inputs,
)
from gradaccum._hf_packing import document_starts, packing_of, shifted
from gradaccum.loss import LossSum
from gradaccum.options import parse

__all__ = [
    "IGNORE_INDEX",
    "Task",
    "TaskLoss",
    "causal_lm",
    "classification",
    "loss_from_logits",
    "masked_lm",
    "seq2seq",
    "token_classification",
]

IGNORE_INDEX = -100
"""The label value Hugging Face models do not score."""

_LABEL_KEYS = ("labels", "shift_labels")


class Task(enum.Enum):
    """What a model's logits predict, which decides how its loss is summed and counted."""

    CAUSAL_LM = "causal_lm"
    SEQ2SEQ = "seq2seq"
    MASKED_LM = "masked_lm"
    CLASSIFICATION = "classification"
    TOKEN_CLASSIFICATION = "token_classification"


class TaskLoss:
    """A `loss_fn` for one `Task`: `loss_fn(model, batch) -> LossSum`, counted ahead too.

    `items_counted(batch)` says from the labels alone how many items the loss will count, so
    that `Accumulator.step` divides every backward by the window's exact count (see
    `gradaccum.loss.counted_ahead`).

    Example:
        >>> import torch
        >>> labels = torch.tensor([[5, 6, 7, -100]])
        >>> causal_lm.items_counted({"input_ids": labels.clamp(min=0), "labels": labels})
        tensor(2)
    """

    def __init__(self, task: Task) -> None:
        self.task = task

    def __repr__(self) -> str:
        return f"gradaccum.hf.{self.task.value}"

    def __call__(self, model: torch.nn.Module, batch: Mapping[str, Any]) -> LossSum:
        """Run `model` on `batch` without its labels and score its logits.

        Raises:
            ValueError: For a model whose own loss adds a term its logits lack (a PEFT AdaLoRA
                or Shadow model, MoE router losses): the message names the setting to change.
        """
        labels = _labels(batch, self.task)
        refuse_peft_loss_terms(model)  # AdaLoRA: its own loss adds a term the logits lack
        refuse_own_loss_function(model)  # model.loss_function = ...: not what is scored
        refuse_ctc_head(model)  # Wav2Vec2ForCTC: frames aligned by CTC, its own loss is exact
        if self.task is Task.CAUSAL_LM:
            refuse_encoder_decoder(model)  # T5, BART: hf.seq2seq makes their decoder's inputs
        inputs = {key: value for key, value in batch.items() if key not in _LABEL_KEYS}
        if self.task is Task.SEQ2SEQ:
            inputs = with_decoder_inputs(model, inputs, labels)
        if self.task is Task.CAUSAL_LM and accepts_keyword(model, "use_cache"):
            # Training needs no cache, and transformers isolates the documents of a packed row
            # (position_ids restarting at 0) in attention only when there is none.
            inputs.setdefault("use_cache", False)
        outputs = model(**inputs)
        refuse_router_losses(model, outputs)  # MoE: the model's loss would add them
        logits = logits_of(outputs)
        packing = batch
        virtual = virtual_tokens(model, logits, labels)
        if virtual:
            # PEFT prompt learning prepends its virtual tokens to every row and, given labels,
            # labels them -100 (so the last one predicts the first real token): the same here.
            # It ignores position_ids, so there are no packed documents to read.
            labels = F.pad(labels, (virtual, 0), value=IGNORE_INDEX)
            packing = {}
        if self.task is Task.CAUSAL_LM and "shift_labels" in batch:
            return _token_cross_entropy(logits, labels)  # shifted by the data pipeline
        if self.task is Task.CAUSAL_LM:  # input_ids tell a separator from a document's start
            starts = document_starts(labels, **packing_of(packing))
            return _token_cross_entropy(logits, shifted(labels, starts))
        return loss_from_logits(
            logits,
            labels,
            self.task,
            problem_type=problem_type_of(model),
        )

    def items_counted(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The items `self(model, batch)` will count, from the batch alone."""
        labels = _labels(batch, self.task)
        if self.task is Task.CAUSAL_LM and "shift_labels" not in batch:
            labels = shifted(labels, document_starts(labels, **packing_of(batch)))
        elif self.task is Task.CLASSIFICATION and labels.is_floating_point():
            return torch.tensor(labels.numel())  # regression or multi-label: every output
        count: torch.Tensor = (labels != IGNORE_INDEX).sum()
        return count


causal_lm = TaskLoss(Task.CAUSAL_LM)
"""Next-token cross-entropy of a causal LM, summed over the tokens the model scores.

The batch holds the model's inputs and `labels` (or `shift_labels`, already shifted). Packed
rows are read from `position_ids` (a 0 starts a document) or `cu_seq_lens_q`. The model is called
with `use_cache=False` unless the batch says otherwise: with a cache, transformers lets the
documents of a packed row attend to each other (as it does given an `attention_mask`: leave it
out of packed batches). A model whose `loss_function` was replaced is refused: its own loss is
not the cross-entropy scored here.
"""

seq2seq = TaskLoss(Task.SEQ2SEQ)
"""Decoder cross-entropy of an encoder-decoder model, summed over the scored label tokens.

Without `decoder_input_ids` in the batch, they are made from the labels by the model's own
`prepare_decoder_input_ids_from_labels` (a right shift with the decoder start token), or, for a
model without it (Whisper, M2M100), by that shift from its config, as its `forward` makes them.
"""

masked_lm = TaskLoss(Task.MASKED_LM)
"""Masked-token cross-entropy, summed over the labels that are not -100."""

classification = TaskLoss(Task.CLASSIFICATION)
"""One label per example (sequence or image classification), as the model's head scores it.

The loss follows `model.config.problem_type` and, when it is unset, the model's own rule: a
single output is a regression (squared error), integer labels are single-label (cross-entropy
over the rows whose label is not -100), float labels are multi-label (binary cross-entropy over
every output).
"""

token_classification = TaskLoss(Task.TOKEN_CLASSIFICATION)
"""One label per token (NER, tagging): cross-entropy summed over the labels that are not -100."""


def loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    task: Task | str,
    *,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    problem_type: str | None = None,
) -> LossSum:
    """The summed loss and the count for logits from the user's own forward.

    Args:
        logits: The model's logits: `(batch, seq, vocab)` for token tasks, `(batch, classes)`
            for classification.
        labels: Hugging Face labels: unshifted for a causal LM, -100 where nothing is scored.
        task: A `Task` or its value.
        position_ids: Causal LM only: positions of a packed row, 0 where a document starts.
        cu_seq_lens: Causal LM only: cumulative document lengths of a flattened row.
        attention_mask: Causal LM only: with `position_ids`, a 0 after padding (a left-padded
            row, whose positions start at its first token) is no document boundary: the model
            scores that token, so this does too.
        problem_type: Classification only: "single_label_classification",
            "multi_label_classification" or "regression"; None infers it as the model does.

    Returns:
        `LossSum(value, count)`: the loss summed in float32 or wider, and the items scored.

    Raises:
        ValueError: For an unknown task or problem type, or logits and labels that do not fit.

    Example:
        >>> import torch
        >>> logits, labels = torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]])
        >>> loss_from_logits(logits, labels, Task.MASKED_LM).count
        tensor(3)
    """
    kind = parse(Task, task, "task")
    labels = _as_long(labels)
    if kind is Task.CAUSAL_LM:
        starts = document_starts(labels, position_ids, cu_seq_lens, attention_mask)
        return _token_cross_entropy(logits, shifted(labels, starts))
    if kind is Task.CLASSIFICATION:
        return _classification_loss(logits, labels, problem_type)
    return _token_cross_entropy(logits, labels)


def _as_long(labels: torch.Tensor) -> torch.Tensor:
    """Integer labels of any width as int64: cross-entropy takes no other, and -100 fits."""
    if (
        labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype in (torch.long, torch.bool)
    ):
        return labels
    return labels.long()


def _token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> LossSum:
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(
            f"labels of dtype {labels.dtype} are not class ids: cross-entropy scores integer "
            "labels (-100 where nothing is scored); pass labels.long(). Float targets of a "
            "sequence classifier are read by gradaccum.hf.classification with problem_type "
            "'regression' or 'multi_label_classification'."
        )
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not fit labels of shape "
            f"{tuple(labels.shape)}: expected logits (*labels.shape, classes)."
        )
    labels = labels.to(logits.device)
    value = F.cross_entropy(
        _wide(logits).flatten(0, -2),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return LossSum(value, (labels != IGNORE_INDEX).sum())


_CLASS_IDS_HINT = (
    " One class id per example read as floats (a dataset's float column) makes the model infer "
    "multi-label: pass them as integers, labels.long(), for single-label cross-entropy."
)
_PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")


def _classification_loss(
    logits: torch.Tensor, labels: torch.Tensor, problem_type: str | None
) -> LossSum:
    if logits.dim() != 2:
        raise ValueError(
            f"classification scores one label per example, from logits (batch, classes), but "
            f"the logits have shape {tuple(logits.shape)}: for one label per token use "
            "gradaccum.hf.token_classification (masked_lm, causal_lm for language models)."
        )
    labels = labels.to(logits.device)
    if problem_type is None:
        if logits.shape[-1] == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if problem_type not in _PROBLEM_TYPES:
        raise ValueError(f"problem_type={problem_type!r} must be one of {_PROBLEM_TYPES} or None.")
    if problem_type == "single_label_classification":
        if labels.numel() == logits.shape[0]:
            labels = labels.reshape(-1)  # (batch, 1) as (batch,), as the models' view(-1) reads it
        elif labels.shape == logits.shape:
            raise ValueError(
                f"single-label classification takes one class id per example, but the labels "
                f"have shape {tuple(labels.shape)}, like the logits: for multi-hot labels pass "
                "them as floats or set problem_type='multi_label_classification'."
            )
        return _token_cross_entropy(logits, labels)
    wide = _wide(logits)
    if logits.shape[-1] == 1:
        wide, labels = wide.flatten(), labels.flatten()  # the models squeeze a single output
    if labels.shape != wide.shape:
        # MSE and BCE would broadcast (batch,) against (batch, outputs) into a wrong loss.
        ids = "" if labels.shape != logits.shape[:1] else _CLASS_IDS_HINT
        raise ValueError(
            f"{problem_type} scores every output: labels of shape {tuple(labels.shape)} do not "
            f"fit logits of shape {tuple(logits.shape)}; pass one target per output.{ids}"
        )
    if problem_type == "regression":
        value = F.mse_loss(wide, labels.to(wide.dtype), reduction="sum")
    else:
        value = F.binary_cross_entropy_with_logits(wide, labels.to(wide.dtype), reduction="sum")
    return LossSum(value, wide.numel())


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32 at least, as the models' own losses upcast them."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def _labels(batch: Mapping[str, Any], task: Task) -> torch.Tensor:
    """The batch's labels: `shift_labels` (already shifted) for a causal LM, else `labels`."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"the batch is a {type(batch).__name__}; gradaccum.hf losses take a mapping of the "
            "model's keyword inputs plus 'labels', as a Hugging Face data collator makes it."
        )
    key = "shift_labels" if task is Task.CAUSAL_LM and "shift_labels" in batch else "labels"
    labels = batch.get(key)
    if labels is not None and not isinstance(labels, torch.Tensor):
        raise TypeError(
            f"batch[{key!r}] is a {type(labels).__name__}, not a torch.Tensor: the model and "
            "these losses take tensors. Collate with return_tensors='pt' (or "
            "dataset.with_format('torch')), or convert with torch.as_tensor."
        )
    if labels is None:
        # A datasets column read by torch's default collate keeps its name ('label'); the
        # Hugging Face collators rename it, as the models take only 'labels'.
        other = next((name for name in ("label", "label_ids") if name in batch), None)
        fix = (
            f"rename batch[{other!r}] to 'labels' (as transformers' data collators do)"
            if other is not None
            else "add the labels (-100 where nothing is scored)"
        )
        raise ValueError(f"the batch has keys {sorted(batch)} but no '{key}' tensor; {fix}.")
    return _as_long(labels)
