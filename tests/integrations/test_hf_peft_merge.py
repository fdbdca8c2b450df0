"""PEFT `merge_adapter()` inside a streamed window (an evaluation merged for speed).

`merge_adapter()` adds each LoRA product into its frozen base weight in place and
`unmerge_adapter()` subtracts it again: the weights come back within rounding. Inside a window that
round trip is not a change of the model (the step is the full-batch one), but the frozen-parameter
watch took it for a target network's EMA update and warned so (a false alarm). Adapters left merged
do change the step (the later micro-batches give them no gradient): that is warned of, naming
`unmerge_adapter()`. The reference is a plain full-batch SGD step on a deep copy, no merge.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from tests.integrations._hf import import_transformers

transformers = import_transformers()
peft = pytest.importorskip("peft", reason="the [hf] extra is not installed")

from gradaccum import Accumulator, hf  # noqa: E402
from gradaccum._buffer_watch import ForwardStateWarning  # noqa: E402
from gradaccum._frozen_watch import FrozenWatch  # noqa: E402

transformers.logging.set_verbosity_error()
RTOL, ATOL = 1e-10, 1e-12


def _lora(save_head: bool = False) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(config).double()
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        init_lora_weights=False, modules_to_save=["lm_head"] if save_head else None,
    )  # fmt: skip
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():  # a trained adapter's size: logits that do not saturate the softmax
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
    return model


def _halves() -> tuple[dict[str, torch.Tensor], ...]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 40, (6, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[4, 3:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return batch, {k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}


def _trained(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _window(between: Any, save_head: bool = False) -> tuple[Any, Any]:
    """One streamed window of two micro-batches with `between(model)` run between them."""
    model = _lora(save_head)
    reference = copy.deepcopy(model)
    acc = Accumulator(model, torch.optim.SGD(_trained(model), lr=0.5), accumulation_steps=2)
    batch, first, second = _halves()
    acc.micro_step(first, hf.causal_lm)
    between(model)
    assert acc.micro_step(second, hf.causal_lm).stepped
    plain = torch.optim.SGD(_trained(reference), lr=0.5)
    result = hf.causal_lm(reference, batch)
    (result.value / result.count).backward()
    plain.step()
    return model, reference


def _round_trip(model: Any) -> None:
    with torch.no_grad():
        model.merge_adapter()
        model.unmerge_adapter()


def test_a_merge_and_unmerge_inside_a_window_is_quiet_and_the_full_batch_step() -> None:
    """The window with the round trip equals the window without it (float64, rtol 1e-10).

    Both equal the plain full-batch step to 1e-6 only: Llama's RMSNorm computes in float32 in a
    float64 model, so a sum divided after its backward (what a streamed window of unknown total
    does) differs from the mean's backward by float32 rounding (1e-7) in plain PyTorch too.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForwardStateWarning)
        model, reference = _window(_round_trip)
    untouched, _ = _window(lambda model: None)
    for got, same, want in zip(
        _trained(model), _trained(untouched), _trained(reference), strict=True
    ):
        torch.testing.assert_close(got, same, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_negative_control_the_round_trip_was_warned_as_a_target_networks_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    init = FrozenWatch.__init__

    def blind(self: FrozenWatch, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._merged_into = {}

    monkeypatch.setattr(FrozenWatch, "__init__", blind)
    with pytest.warns(ForwardStateWarning, match="momentum"):
        _window(_round_trip)


def test_adapters_left_merged_inside_a_window_are_warned_of_naming_unmerge() -> None:
    """With a trained head beside them the window runs on; its step is not the full-batch one."""

    def merge(model: Any) -> None:
        with torch.no_grad():
            model.merge_adapter()

    with pytest.warns(ForwardStateWarning, match=r"still merged.*unmerge_adapter\(\)"):
        model, reference = _window(merge, save_head=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    gaps = [
        float((got - want).abs().max().detach() / want.abs().max())
        for got, want in zip(_trained(model), _trained(reference), strict=True)
    ]
    assert max(g for n, g in zip(names, gaps, strict=True) if "lora_B" in n) > 1e-3


def test_adapters_left_merged_alone_are_refused_naming_unmerge() -> None:
    model = _lora()
    acc = Accumulator(model, torch.optim.SGD(_trained(model), lr=0.5), accumulation_steps=2)
    _, first, _ = _halves()
    with torch.no_grad():
        model.merge_adapter()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"merge_adapter\(\).*unmerge_adapter\(\)"):
        acc.micro_step(first, hf.causal_lm)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
