"""`StepResult`: built through named constructors, immutable, the loss read only when asked."""

from __future__ import annotations

import dataclasses

import pytest

from gradaccum import StepResult


def _fields(**overrides: object) -> dict[str, object]:
    fields: dict[str, object] = {"loss": 0.5, "count": 4, "micro_batches": 2, "micro_batch_size": 2}
    return {**fields, "lr": 0.1, **overrides}


@pytest.mark.parametrize(
    ("build", "stepped", "skipped"),
    [("stepped", True, False), ("skipped", False, True), ("pending", False, False)],
)
def test_named_constructors_set_the_outcome_flags(build: str, stepped: bool, skipped: bool) -> None:
    result = getattr(StepResult, build)(**_fields())
    assert (result.stepped, result.skipped) == (stepped, skipped)
    assert (result.loss, result.count, result.micro_batches, result.lr) == (0.5, 4, 2, 0.1)


def test_a_result_is_immutable_and_its_lazy_loss_is_read_once() -> None:
    reads: list[int] = []

    def loss() -> float:
        reads.append(1)
        return 1.25

    result = StepResult.pending(**_fields(loss=loss))
    assert reads == []  # nothing read until asked
    assert result.loss == result.loss == 1.25
    assert len(reads) == 1
    with pytest.raises((AttributeError, dataclasses.FrozenInstanceError, TypeError)):
        result.count = 5  # type: ignore[misc]


def test_the_flags_are_not_positional_arguments() -> None:
    """NEGATIVE CONTROL of the constructors: the plain constructor takes keywords only."""
    with pytest.raises(TypeError):
        StepResult(0.5, 4, 2, 2, True, False, 0.1)  # type: ignore[misc]
