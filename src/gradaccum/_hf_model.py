"""What `gradaccum.hf` reads from a Hugging Face model: its inputs, logits and settings.

Nothing here imports transformers or peft: the models are read through their attributes.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "accepts_keyword",
    "refuse_ctc_head",
    "refuse_encoder_decoder",
    "refuse_own_loss_function",
    "refuse_peft_loss_terms",
    "refuse_router_losses",
    "logits_of",
    "problem_type_of",
    "virtual_tokens",
    "with_decoder_inputs",
]


def accepts_keyword(model: torch.nn.Module, name: str) -> bool:
    """Whether the forward of `model` (inside DDP, DataParallel or torch.compile) takes `name`.

    A `**kwargs` forward counts as taking it: transformers' models and PEFT's wrappers pass
    their keyword arguments on. A model of the user's own may take only its inputs.
    """
    try:
        parameters = inspect.signature(_unwrapped(model).forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: pass it, as before
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _unwrapped(model: torch.nn.Module) -> Any:
    """The model inside DDP, DataParallel or torch.compile, whose attributes the helpers read."""
    inner: Any = model
    while isinstance(getattr(inner, "module", None), torch.nn.Module):  # DDP, DataParallel
        inner = inner.module
    return getattr(inner, "_orig_mod", inner)  # torch.compile


def _base(model: torch.nn.Module) -> Any:
    """The transformers model: inside the wrappers and a PEFT model (whose class is PeftModel)."""
    inner = _unwrapped(model)
    base = getattr(inner, "get_base_model", None)
    found = base() if callable(base) else inner
    return found if isinstance(found, torch.nn.Module) else inner


# PEFT methods whose model, given labels, adds a term of its own to the loss it returns: the
# config field weighing it, and what it is. The helpers call the model without labels (they
# score its logits), so they would silently train without it.
_PEFT_LOSS_TERMS = {
    "ADALORA": ("orth_reg_weight", "the orthogonal regularization of its lora_A and lora_B"),
    "SHADOW": ("auxiliary_loss_weight", "the shadow network's auxiliary task loss"),
}


def refuse_peft_loss_terms(model: torch.nn.Module) -> None:
    """Raise, before any forward, for a PEFT model whose own loss adds a term to the logits'.

    CPT (context-aware prompt tuning) scores its own labels, with weights. AdaLoRA adds
    `orth_reg_weight` times an orthogonal regularization of its adapters, and Shadow
    `auxiliary_loss_weight` times its shadow network's loss, to the loss of a
    task-typed PEFT model (`get_peft_model` given a `task_type`: `PeftModelForCausalLM`...)
    called with labels. A bare `PeftModel`'s forward skips the tuner's, so its own loss has no
    such term and is not refused; nor is a validation loss under `torch.no_grad()`, where the
    token loss alone is what is measured.

    Raises:
        ValueError: Naming the term, its weight and both fixes.
    """
    if not torch.is_grad_enabled():
        return  # nothing trains: a validation loss, the token loss alone
    inner = _unwrapped(model)
    config = getattr(inner, "active_peft_config", None)
    kind = getattr(config, "peft_type", None)
    if str(getattr(kind, "value", kind)) == "CPT":
        raise ValueError(
            f"{type(inner).__name__} is a CPT PEFT model, whose own loss is its own: it also "
            "scores the labelled tokens of its context (cpt_tokens_type_mask), only those of "
            "the input its input_type_mask marks, weighted by opt_weighted_loss_type. "
            "gradaccum.hf scores every label of the logits instead; write a loss_fn of your "
            "own returning LossSum.terms(loss=(weighted token sum, summed weights))."
        )
    found = _PEFT_LOSS_TERMS.get(str(getattr(kind, "value", kind)))
    if found is None or getattr(config, "task_type", None) is None:
        return
    field, term = found
    weight = getattr(config, field, 0)
    if not isinstance(weight, (int, float)) or weight <= 0:
        return
    name, adapter = getattr(kind, "value", kind), getattr(inner, "active_adapter", None)
    adapter = repr(adapter) if isinstance(adapter, str) else "<adapter>"
    raise ValueError(
        f"{type(inner).__name__} is a {name} PEFT model: given labels, its own loss adds "
        f"{field}={weight:g} times {term}, and gradaccum.hf scores the logits alone (it "
        "calls the model without labels), so it would silently train without it. Set "
        f"model.peft_config[{adapter}].{field} = 0: the helpers then score the token loss "
        "alone, and a loss_fn of your own can add the term, LossSum.terms(ce=(ce.value, "
        f"ce.count), reg=Term(term, count=..., weight={weight:g})) (Term from gradaccum.loss; "
        "docs/losses.md, PEFT, has AdaLoRA's, exact)."
    )


def refuse_ctc_head(model: torch.nn.Module) -> None:
    """Raise, before any forward, for a CTC model (`*ForCTC`), whose logits no helper scores.

    Its logits are per audio frame, aligned to the shorter labels by CTC: a helper would fail
    on the shapes, and `hf.classification`'s error pointed to `hf.token_classification`,
    which fails too.

    Raises:
        ValueError: Naming the model's own loss, which is exact as it is.
    """
    name = type(_base(model)).__name__  # PEFT's LoRA on a CTC model: PeftModel around it
    if not name.endswith("ForCTC"):
        return
    raise ValueError(
        f"{name} is a CTC model: its logits are per audio frame, aligned to the labels by CTC, "
        "which no gradaccum.hf helper scores. Its own loss is exact as it is: return "
        "model(**micro_batch).loss with config.ctc_loss_reduction='mean' (a mean over rows of "
        "each row's loss per target token); with 'sum', return LossSum(model(**micro_batch)"
        ".loss, rows) (docs/losses.md, Other task heads)."
    )


def refuse_encoder_decoder(model: torch.nn.Module) -> None:
    """Raise, before any forward, for `hf.causal_lm` on an encoder-decoder (T5, BART).

    Called without `decoder_input_ids`, its decoder failed inside transformers ("You must
    specify exactly one of input_ids or inputs_embeds"), wrapped in PEFT or not.

    Raises:
        ValueError: Naming `gradaccum.hf.seq2seq`, which makes the decoder's inputs.
    """
    base = _base(model)
    if getattr(getattr(base, "config", None), "is_encoder_decoder", None) is True:
        raise ValueError(
            f"gradaccum.hf.causal_lm scores a decoder-only language model, but "
            f"{type(base).__name__} is an encoder-decoder (config.is_encoder_decoder=True): use "
            "gradaccum.hf.seq2seq, which makes the decoder's inputs from the labels and scores "
            "each of its positions against its own label (nothing was changed)."
        )


def refuse_own_loss_function(model: torch.nn.Module) -> None:
    """Raise, before any forward, for a transformers model whose `loss_function` was replaced.

    Given labels, a transformers model computes its loss with `self.loss_function`, which a
    user may set (`model.loss_function = my_loss`: label smoothing, a z-loss) or override in a
    subclass. The helpers call the model without labels and score its logits with plain
    cross-entropy, so they would silently train on another loss. Not refused under
    `torch.no_grad()` (a validation loss), as for PEFT's terms.

    Raises:
        ValueError: Naming the replaced function and the loss_fn that keeps it.
    """
    if not torch.is_grad_enabled():
        return
    inner = _unwrapped(model)
    base = getattr(inner, "get_base_model", None)  # PEFT: the transformers model it wraps
    for candidate in (inner, base() if callable(base) else None):
        if not isinstance(candidate, torch.nn.Module) or not hasattr(candidate, "loss_type"):
            continue  # loss_type: set by transformers' PreTrainedModel, which owns loss_function
        owner = next((c for c in type(candidate).__mro__ if "loss_function" in vars(c)), None)
        replaced = getattr(candidate, "_loss_function", None)
        if replaced is None and (owner is None or owner.__module__.startswith("transformers.")):
            continue
        what = getattr(replaced, "__name__", type(replaced).__name__)
        if replaced is None:
            what = f"{owner.__name__}.loss_function" if owner is not None else "loss_function"
        raise ValueError(
            f"{type(candidate).__name__}'s loss_function is replaced ({what}): given labels, "
            "the model's own loss is yours, and gradaccum.hf scores the logits with plain "
            "cross-entropy (it calls the model without labels), so it would silently train on "
            "another loss. Keep yours in a loss_fn of your own: return LossSum(model(**mb, "
            "num_items_in_batch=1).loss, count), your loss's sum if it divides by "
            "num_items_in_batch as transformers' losses do, and count the items it sums over "
            "(a causal LM's: (mb['labels'][..., 1:] != -100).sum()); or remove the replacement "
            "(del model._loss_function) to train on the plain token loss."
        )


def virtual_tokens(model: torch.nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> int:
    """The positions PEFT prompt learning (prompt tuning, P-tuning) adds before each row."""
    config = getattr(_unwrapped(model), "active_peft_config", None)
    if not getattr(config, "is_prompt_learning", False) or logits.dim() < 3:
        return 0
    extra = logits.shape[-2] - labels.shape[-1]
    return extra if extra > 0 and extra == getattr(config, "num_virtual_tokens", None) else 0


def with_decoder_inputs(
    model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor
) -> dict[str, Any]:
    """`inputs` with the decoder's inputs made from `labels` as an encoder-decoder makes them.

    Raises:
        ValueError: For a model whose config says it is no encoder-decoder: a decoder-only LM
            ignores `decoder_input_ids` and, scored without the shift, learns to copy its input.
    """
    inner = _unwrapped(model)  # DDP and DataParallel hold the model's config and methods
    if getattr(getattr(inner, "config", None), "is_encoder_decoder", None) is False:
        raise ValueError(
            f"gradaccum.hf.seq2seq scores the decoder of an encoder-decoder model, but "
            f"{type(_base(model)).__name__} is none (config.is_encoder_decoder=False): for a "
            "decoder-only language model use gradaccum.hf.causal_lm, which scores each "
            "position's next token."
        )
    if "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs:
        return inputs
    prepare = getattr(inner, "prepare_decoder_input_ids_from_labels", None)
    if prepare is not None:
        return {**inputs, "decoder_input_ids": prepare(labels=labels)}
    # Whisper, Speech2Text, M2M100/NLLB, Blenderbot, Moonshine have no such method: given
    # labels, their forward shifts them right itself, from the config's two token ids.
    config = getattr(inner, "config", None)
    pad = getattr(config, "pad_token_id", None)
    start = getattr(config, "decoder_start_token_id", None)
    if not getattr(config, "is_encoder_decoder", False) or pad is None or start is None:
        raise ValueError(
            f"{type(inner).__name__} has no prepare_decoder_input_ids_from_labels and no "
            "config.is_encoder_decoder with pad_token_id and decoder_start_token_id to make "
            "them from; put 'decoder_input_ids' (the labels shifted right) in the batch."
        )
    return {**inputs, "decoder_input_ids": _shifted_right(labels, int(pad), int(start))}


def _shifted_right(labels: torch.Tensor, pad: int, start: int) -> torch.Tensor:
    """The labels shifted right as `shift_tokens_right` does: `start` first, -100 as `pad`."""
    shifted = labels.new_full(labels.shape, start)
    shifted[..., 1:] = labels[..., :-1]
    return shifted.masked_fill(shifted == -100, pad)


def problem_type_of(model: torch.nn.Module) -> str | None:
    """`model.config.problem_type`, or None when unset (the loss then infers it)."""
    value = getattr(getattr(_unwrapped(model), "config", None), "problem_type", None)
    return value if isinstance(value, str) else None


def logits_of(outputs: object) -> torch.Tensor:
    """The logits of a model output: a `ModelOutput`, a mapping, a tuple led by them, or a tensor.

    A tensor is the logits themselves, as a model of the user's own returns them.
    """
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
    if logits is None:
        logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, tuple) and outputs:
        logits = outputs[0]
    if not isinstance(logits, torch.Tensor) and getattr(outputs, "start_logits", None) is not None:
        raise TypeError(
            f"the model returned {type(outputs).__name__}: start and end logits of extractive "
            "question answering, which no gradaccum.hf helper scores. Its own loss averages a "
            "start and an end mean, each over the positions inside the inputs; write a loss_fn "
            "returning LossSum.terms(start=Term(start_sum, count=..., weight=0.5), "
            "end=Term(...)): docs/losses.md, Extractive question answering, has it exact."
        )
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"the model returned {type(outputs).__name__} without logits; call it yourself and "
            "use gradaccum.hf.loss_from_logits."
        )
    return logits


def refuse_router_losses(model: torch.nn.Module, outputs: object) -> None:
    """Raise if `outputs` carry a mixture-of-experts router loss the model's own loss would add.

    Given labels, a transformers MoE model (Mixtral, Qwen-MoE, OLMoE, Switch...) with
    `config.output_router_logits` adds its load-balancing (and z-) losses to the token loss;
    the `gradaccum.hf` helpers score the logits alone, so they would silently train without
    them. Computed per forward, those losses are not additive over micro-batches either, so
    no helper can add them exactly: the user chooses.

    Raises:
        ValueError: Naming the router losses and both fixes.
    """
    items = outputs.items() if isinstance(outputs, Mapping) else ()
    names = [
        str(name)
        for name, value in items
        if str(name).endswith(("aux_loss", "z_loss"))
        and isinstance(value, torch.Tensor)
        and value.requires_grad
    ]
    if not names:
        return
    raise ValueError(
        f"{type(_unwrapped(model)).__name__} returned router losses ({', '.join(names)}): with "
        "config.output_router_logits=True its own loss adds them, times "
        "config.router_aux_loss_coef, to the token loss, and gradaccum.hf scores the logits "
        "alone. Set model.config.output_router_logits = False to train on the token loss "
        "alone, or keep them in a loss_fn of your own: out = model(**inputs); "
        "ce = hf.loss_from_logits(out.logits, labels, 'causal_lm'); return "
        "LossSum.terms(ce=(ce.value, ce.count), aux=Term(out.aux_loss, count=1, "
        "weight=coef)) (Term from gradaccum.loss), whose router loss is each micro-batch's, "
        "not the full batch's (docs/losses.md, MoE load-balancing losses)."
    )
