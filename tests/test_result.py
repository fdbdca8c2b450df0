"""`StepResult`: built through named constructors, immutable, the loss read only when asked."""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import pickle
import warnings
import weakref
from typing import Any

import pytest
import torch

from gradaccum import Accumulator, LossSum, StepResult
from gradaccum.loss import Term


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


def _nan_run(
    poisoned: list[bool], precision: str = "fp32", *, resume: bool = False
) -> list[warnings.WarningMessage]:
    """Windows of a linear model, the ones marked True with a NaN loss; the warnings they gave.

    With `resume`, each window runs in a fresh Accumulator loaded from the previous one's state
    (saved and read back as `torch.save` / `torch.load(weights_only=True)` do).
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, micro_batch_size=2, precision=precision)
    x = torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for nan in poisoned:
            if resume:
                buffer = io.BytesIO()
                torch.save(acc.state_dict(), buffer)
                buffer.seek(0)
                acc = Accumulator(model, optimizer, micro_batch_size=2, precision=precision)
                acc.load_state_dict(torch.load(buffer, weights_only=True))
            scale = float("nan") if nan else 1.0
            result = acc.step(x, lambda m, b, s=scale: m(b).pow(2).mean() * s)
            assert result.skipped == nan
            assert result.stepped != nan
    return [w for w in caught if "in a row were skipped" in str(w.message)]


def test_windows_skipped_as_non_finite_in_a_row_warn_once_that_nothing_trains() -> None:
    assert _nan_run([True, True]) == []  # two may be a passing spike
    stalled = _nan_run([True] * 6)
    assert len(stalled) == 1  # once, at the third
    message = str(stalled[0].message)
    assert message.startswith("3 accumulation windows in a row were skipped")
    assert "on_nonfinite='raise'" in message
    assert "weight" in message  # names the parameters
    assert stalled[0].filename == __file__  # points at the caller's line


def test_skips_apart_do_not_warn_and_fp16_allows_its_scale_backoff() -> None:
    # Negative control: as many skips, but a stepped window between them resets the count.
    assert _nan_run([True, True, False, True, True, False, True, True]) == []
    # fp16 skips a few windows while its loss scale backs off: 3 in a row is routine there.
    assert _nan_run([True] * 3, precision="fp16") == []


def test_the_streak_of_skipped_windows_survives_a_resume() -> None:
    """A run resumed between the skipped windows warns as the uninterrupted run does.

    Before, the streak was not in `Accumulator.state_dict()`: a run resumed every window (or
    every other, a preempted job) never warned however many windows it skipped.
    """
    assert len(_nan_run([True] * 6, resume=True)) == 1  # once, at the third, as uninterrupted
    # Negative control: the streak is the saved run's, so a stepped window still resets it.
    assert _nan_run([True, True, False, True, True, False], resume=True) == []
    # A loaded state replaces the streak of the run it is loaded into.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2)
    clean = acc.state_dict()
    x = torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            acc.step(x, lambda m, b: m(b).pow(2).mean() * float("nan"))
        acc.load_state_dict(clean)  # back to a state with no window skipped
        acc.step(x, lambda m, b: m(b).pow(2).mean() * float("nan"))
    assert [w for w in caught if "in a row were skipped" in str(w.message)] == []


def _kept_run(terms: bool) -> tuple[list[StepResult], list[weakref.ref[Any]], list[float]]:
    """Two streamed windows of 3 micro-batches, every result kept (a logging loop's list).

    Returns the results, weak references to the model, optimizer, Accumulator and (for a
    `LossSum.terms` loss whose two counts the window learns at its end, so its second term has a
    gradient buffer) each window's term ledger, and each result's loss computed by hand.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accumulator(model, optimizer, accumulation_steps=3)
    batches = [torch.randn(2 + k % 2, 4, dtype=torch.float64) for k in range(6)]

    def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> Any:
        out = m(b)
        if terms:
            a, c = out.pow(2).sum(), out.abs().sum()
            return LossSum.terms(sq=(a, out.numel()), ab=Term(c, count=b.shape[0], weight=0.5))
        return LossSum(out.pow(2).sum(), out.numel())

    kept, refs, expected = [], [weakref.ref(o) for o in (model, optimizer, acc)], []
    for window in range(2):
        seen: list[torch.Tensor] = []
        for b in batches[3 * window : 3 * window + 3]:
            with torch.no_grad():  # by hand, before the micro-batch (the window's weights)
                seen.append(model(b))
                out = torch.cat(seen)
                value = out.pow(2).mean() + (0.5 * out.abs().sum() / len(out) if terms else 0)
            expected.append(float(value))
            kept.append(acc.micro_step(b, loss_fn))
            if terms and acc._engine.window.terms is not None:
                refs.append(weakref.ref(acc._engine.window.terms))
    return kept, refs, expected


@pytest.mark.parametrize("terms", [False, True], ids=["loss_sum", "terms"])
def test_results_kept_for_logging_keep_no_model_optimizer_or_gradient_buffer_alive(
    terms: bool,
) -> None:
    """A pending result's lazy loss holds copies of the window's totals, nothing else.

    Before, a `micro_step()` result's loss reader closed over the Accumulator (so a list of
    logged results kept every run's model, optimizer state and Accumulator alive, a sweep's
    memory growing run after run), and a `LossSum.terms` one over the window's term ledger,
    with its parameter-sized gradient buffers: 100 windows' results held 100 model gradients.
    """
    kept, refs, expected = _kept_run(terms)
    assert kept[0].stepped is False
    assert kept[2].stepped is True
    if terms:
        assert len(refs) == 3 + 2 + 2  # the ledger of each window, while open
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)  # nothing kept alive by the results
    for result, value in zip(kept, expected, strict=True):  # the values are still there, exact
        assert result.loss == pytest.approx(value, rel=1e-12, abs=0)


def test_negative_control_a_reader_closing_over_the_accumulator_keeps_it_alive() -> None:
    """The measure above catches the old closure: a lazy loss reading `acc` keeps it alive."""
    model = torch.nn.Linear(2, 1)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    result = StepResult.pending(**_fields(loss=lambda a=acc: float(a.micro_batch_size or 0)))
    ref = weakref.ref(acc)
    del acc, model
    gc.collect()
    assert ref() is not None
    assert result.loss == 0.0


def test_results_pickle_and_deepcopy_by_value() -> None:
    """Results go through `pickle`, `copy.deepcopy` and `torch.save` (a history of results).

    Before, every result failed: its read-only `terms` (a `mappingproxy`) cannot be pickled, nor
    a pending result's lazy loss (a local function). The lazy loss is read on the way.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    acc = Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        micro_batch_size=2,
        accumulation_steps=2,
        telemetry=True,
    )
    x = torch.randn(4, 3)

    def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> Any:
        out = m(b)
        return LossSum.terms(sq=(out.pow(2).sum(), out.numel()), ab=(out.abs().sum(), len(b)))

    results = [acc.step(x, loss_fn), acc.micro_step(x, lambda m, b: m(b).pow(2).mean())]
    assert results[0].terms
    assert results[0].telemetry is not None
    for result in results:
        for copied in (
            pickle.loads(pickle.dumps(result)),
            copy.deepcopy(result),
            copy.copy(result),
        ):
            assert copied == result
            assert copied is not result
            assert type(copied.loss) is float
            assert dict(copied.terms) == dict(result.terms)
            with pytest.raises(AttributeError):
                copied.count = 5  # type: ignore[misc]
    buffer = io.BytesIO()
    torch.save(results, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False) == results


def _epochs_of_drops(epoch_batches: int, accumulation_steps: int, epochs: int = 3) -> list[Any]:
    """Epoch loops of `epoch_batches` micro-batches, each ended by `flush()` under "drop"."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    acc = Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        accumulation_steps=accumulation_steps,
        partial_window="drop",
    )
    x = torch.randn(2, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(epochs):
            for _ in range(epoch_batches):
                acc.micro_step(x, lambda m, b: m(b).pow(2).mean())
            acc.flush()
    return [w for w in caught if "dropped by flush()" in str(w.message)]


def test_epochs_shorter_than_a_window_dropped_each_time_warn_once_that_nothing_trains() -> None:
    """A dataset of 4 micro-batches per epoch with `accumulation_steps=8` never fills a window.

    Under `partial_window="drop"` every epoch's window was discarded and the optimizer never
    stepped, silently; the second such drop in a row now warns once, naming "carry" and "step".
    """
    stalled = _epochs_of_drops(epoch_batches=4, accumulation_steps=8)
    assert len(stalled) == 1
    message = str(stalled[0].message)
    assert message.startswith("2 partial windows in a row were dropped by flush()")
    assert "partial_window='carry'" in message
    assert "accumulation_steps=8" in message
    # Negative control: windows step inside each epoch, so each dropped tail is routine.
    assert _epochs_of_drops(epoch_batches=10, accumulation_steps=4) == []
    # A flush with no open window (an epoch that ended on a boundary) drops nothing.
    assert _epochs_of_drops(epoch_batches=8, accumulation_steps=4) == []
