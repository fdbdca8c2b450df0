"""Tests for gradaccum.options: typed choices, `parse`, and how the Accumulator reads them."""

from __future__ import annotations

import copy
import enum

import pytest
import torch

import gradaccum
from gradaccum.options import (
    BatchNormMode,
    Normalize,
    OnNonFinite,
    PartialWindow,
    Precision,
    parse,
)

ALL_ENUMS = [Normalize, Precision, PartialWindow, OnNonFinite, BatchNormMode]
EXPECTED_VALUES = {
    Normalize: {"mean", "sum"},
    Precision: {"fp32", "bf16", "fp16"},
    PartialWindow: {"step", "drop", "carry"},
    OnNonFinite: {"skip", "raise"},
    BatchNormMode: {"micro", "pooled", "frozen"},
}


@pytest.mark.parametrize("kind", ALL_ENUMS, ids=lambda k: k.__name__)
def test_enum_values_are_the_documented_strings(kind: type[enum.Enum]) -> None:
    assert {m.value for m in kind} == EXPECTED_VALUES[kind]
    # str-valued enums compare equal to their strings, so call sites may mix both forms.
    for member in kind:
        assert member == member.value


@pytest.mark.parametrize("kind", ALL_ENUMS, ids=lambda k: k.__name__)
def test_parse_accepts_members_and_strings(kind: type[enum.Enum]) -> None:
    for member in kind:
        assert parse(kind, member, "arg") is member
        assert parse(kind, member.value, "arg") is member


@pytest.mark.parametrize("kind", ALL_ENUMS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("bad", ["nope", "", "float32", 3, None])
def test_parse_rejects_unknown_values_listing_the_choices(kind: type[enum.Enum], bad) -> None:
    with pytest.raises(ValueError, match="setting_name=") as info:
        parse(kind, bad, "setting_name")
    message = str(info.value)
    assert "use one of" in message
    for member in kind:
        assert repr(member.value) in message


def test_parse_rejects_a_member_of_another_enum() -> None:
    with pytest.raises(ValueError, match="precision="):
        parse(Precision, Normalize.MEAN, "precision")


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # Give the model gradients and the optimizer state, so "untouched" means something.
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    model(torch.randn(4, 3)).pow(2).sum().backward()
    return model, optimizer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [p.grad.clone() for p in model.parameters()]
    tensors += [
        v.clone()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]
    return tensors


def _assert_bitwise(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("argument", "bad", "choices"),
    [
        ("precision", "fp64", "'fp32', 'bf16', 'fp16'"),
        ("precision", "float16", "'fp32', 'bf16', 'fp16'"),
        ("normalize", "avg", "'mean', 'sum'"),
        ("partial_window", "keep", "'step', 'drop', 'carry'"),
        ("on_nonfinite", "ignore", "'skip', 'raise'"),
        ("batchnorm", "sync", "'micro', 'pooled', 'frozen'"),
    ],
)
def test_accumulator_rejects_unknown_strings_and_changes_nothing(
    argument: str, bad: str, choices: str
) -> None:
    model, optimizer = _model_and_optimizer()
    before = _state(model, optimizer)
    opt_state_before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match=f"{argument}='{bad}'") as info:
        gradaccum.Accumulator(model, optimizer, micro_batch_size=2, **{argument: bad})
    assert choices in str(info.value)
    _assert_bitwise(before, _state(model, optimizer))
    assert optimizer.state_dict()["param_groups"] == opt_state_before["param_groups"]


def test_accumulator_accepts_enum_members_and_strings_alike() -> None:
    x, y = torch.randn(6, 3), torch.randn(6, 2)

    def mse(m: torch.nn.Module, b) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    results = []
    for style in ("enum", "str"):
        torch.manual_seed(1)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        options = {
            "normalize": Normalize.SUM,
            "precision": Precision.FP32,
            "partial_window": PartialWindow.DROP,
            "on_nonfinite": OnNonFinite.RAISE,
            "batchnorm": BatchNormMode.MICRO,
        }
        if style == "str":
            options = {k: v.value for k, v in options.items()}
        acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=4, **options)
        assert acc.normalize is Normalize.SUM
        assert acc.precision is Precision.FP32
        assert acc.partial_window is PartialWindow.DROP
        assert acc.on_nonfinite is OnNonFinite.RAISE
        acc.step((x, y), mse)
        results.append([p.detach().clone() for p in model.parameters()])
    _assert_bitwise(results[0], results[1])


def test_options_are_exported_from_the_package() -> None:
    assert gradaccum.Precision is Precision
    assert gradaccum.Normalize is Normalize
    assert gradaccum.PartialWindow is PartialWindow
    assert gradaccum.OnNonFinite is OnNonFinite
    assert gradaccum.BatchNormMode is BatchNormMode
