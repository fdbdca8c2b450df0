"""`micro_batch_size="auto"`: out-of-memory recovery by fault injection, bitwise against references.

Two fault injectors stand in for a device running out of memory: `OomAbove` raises
`torch.OutOfMemoryError` whenever a micro-batch is larger than a threshold (a real allocator
fails the same way: the large sizes, every time); `OomAt` raises once at a chosen micro position
of a chosen window. The references are plain `Accumulator`s with a fixed size per window, so
"equal" means the rerun window is exactly a fresh window at the smaller size: nothing counted
twice, no gradient of the failed attempt left behind, RNG and BatchNorm statistics as at the
window's start. The negative control keeps the failed attempt's gradients and must differ.
"""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradaccum import Accumulator, MemoryBudgetError, accumulate_grad
from gradaccum._tuner import MAX_RESTARTS
from gradaccum.recovery import AutoSizer
from tests.state import assert_bitwise, clone_state

# The BatchNorm variants train in "micro" mode on purpose; its one-time warning is not the subject.
pytestmark = pytest.mark.filterwarnings("ignore::gradaccum.batchnorm.BatchNormAccumulationWarning")

BATCH = 32
BUDGET = "256MiB"  # far more than the tiny model needs: the plan picks the whole batch


class OomAbove(nn.Module):
    """Runs `inner`, but fails like an allocator for micro-batches above `threshold` items."""

    def __init__(self, inner: nn.Module, threshold: float = math.inf) -> None:
        super().__init__()
        self.inner = inner
        self.threshold = threshold
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(x.shape[0])
        if x.shape[0] > self.threshold:
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} items > {self.threshold}")
        return self.inner(x)


class OomAt(nn.Module):
    """Runs `inner`, failing once at forward call number `at` after being armed.

    The failure comes after the inner forward ran (so dropout drew random numbers and BatchNorm
    updated its statistics), either at once (`"forward"`) or from the backward (`"backward"`).
    """

    def __init__(self, inner: nn.Module, phase: str = "forward") -> None:
        super().__init__()
        self.inner = inner
        self.phase = phase
        self.at: int | None = None
        self.calls = 0

    def arm(self, at: int) -> None:
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.at is not None:
            if self.calls == self.at:
                self.at = None
                if self.phase == "forward":
                    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
                out.register_hook(_raise_oom)
            self.calls += 1
        return out


def _raise_oom(grad: torch.Tensor) -> torch.Tensor:
    raise torch.OutOfMemoryError("injected in backward")


def _inner(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(1)
    layers: list[nn.Module] = [nn.Linear(6, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3)]
    return nn.Sequential(*layers).double()


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _batches(count: int, features: int = 6, seed: int = 7) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(BATCH, features, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (BATCH,), generator=generator),
        )
        for _ in range(count)
    ]


def _accumulator(model: nn.Module, size: int | str, **kwargs) -> Accumulator:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    budget = BUDGET if isinstance(size, str) else None
    return Accumulator(model, optimizer, micro_batch_size=size, memory_budget=budget, **kwargs)


def _state(acc: Accumulator) -> dict:
    """Model parameters and buffers, and the optimizer state, cloned."""
    return clone_state({"model": acc.model.state_dict(), "optimizer": acc.optimizer.state_dict()})


def _scarce_after_planning(acc: Accumulator, model: OomAbove, batch, threshold: float) -> None:
    """Plan while memory is plentiful, then make it scarce (as another process would)."""
    acc._auto.ensure_plan(
        acc.model, batch, _loss, acc.optimizer, precision=acc.precision, accum_dtype=None
    )
    model.threshold = threshold


def _reference(sizes: list[int], batches, batchnorm: bool = False) -> Accumulator:
    """A plain run with a fixed, given size per window, from the same seed."""
    torch.manual_seed(0)
    acc = _accumulator(OomAbove(_inner(batchnorm)), sizes[0])
    for size, batch in zip(sizes, batches, strict=True):
        acc.micro_batch_size = size
        acc.step(batch, _loss)
    return acc


@pytest.mark.parametrize("batchnorm", [False, True], ids=["plain", "batchnorm"])
def test_threshold_oom_equals_smaller_size_from_the_start(batchnorm: bool) -> None:
    batches = _batches(4)
    torch.manual_seed(0)
    model = OomAbove(_inner(batchnorm))
    acc = _accumulator(model, "largest")
    _scarce_after_planning(acc, model, batches[0], threshold=10)
    results = [acc.step(batch, _loss) for batch in batches]
    # 32 fits the plan, then fails: 32 -> 24 -> 18 -> 13 -> 9, which stays.
    assert acc.plan is not None
    assert acc.plan.micro_batch_size == BATCH
    assert [r.micro_batch_size for r in results] == [9] * 4
    assert all(r.count == BATCH and r.micro_batches == 4 and r.stepped for r in results)
    assert acc._auto.out_of_memory_events == 4
    reference = _reference([9] * 4, batches, batchnorm)
    assert_bitwise(_state(acc), _state(reference))
    # NEGATIVE CONTROL: the size the plan chose is a different (exact, but differently rounded
    # or, with BatchNorm, differently normalized) run; the comparison is able to fail.
    other = _reference([8] * 4, batches, batchnorm)
    with pytest.raises(AssertionError):
        assert_bitwise(_state(acc), _state(other))


@pytest.mark.parametrize("position", [0, 1, 2, 3])
@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("batchnorm", [False, True], ids=["plain", "batchnorm"])
def test_oom_at_every_micro_position_reruns_the_window(
    position: int, phase: str, batchnorm: bool
) -> None:
    batches = _batches(3)
    torch.manual_seed(0)
    model = OomAt(_inner(batchnorm), phase)
    acc = _accumulator(model, "largest")
    acc._auto.planned = acc._auto.size = 8  # as if the plan had chosen 4 micro-batches of 8
    first = acc.step(batches[0], _loss)
    model.arm(position)  # window 2 fails at micro position `position`, once
    second = acc.step(batches[1], _loss)
    third = acc.step(batches[2], _loss)
    assert [first.micro_batch_size, second.micro_batch_size, third.micro_batch_size] == [8, 6, 6]
    assert second.count == BATCH
    assert second.micro_batches == 6
    reference = _reference([8, 6, 6], batches, batchnorm)
    assert_bitwise(_state(acc), _state(reference))


def test_negative_control_keeping_the_failed_attempts_gradients_differs() -> None:
    """Had the rerun kept the failed attempt's partial sums, it would count items twice."""
    batches = _batches(1)
    torch.manual_seed(0)
    inner = _inner()
    acc = _accumulator(inner, 8)
    x, y = batches[0]
    _loss(inner, (x[:8], y[:8])).mul(8 / BATCH).backward()  # the failed attempt's 1st micro-batch
    kept = [p.grad.clone() for p in inner.parameters()]
    acc.micro_batch_size = 6
    accumulate_grad(inner, batches[0], _loss, 6)
    doubled = [p.grad + k for p, k in zip(inner.parameters(), kept, strict=True)]
    clean = [p.grad for p in inner.parameters()]
    assert max((d - c).abs().max().item() for d, c in zip(doubled, clean, strict=True)) > 1e-3


def test_gives_up_at_size_one_with_a_clear_error_and_changes_nothing() -> None:
    batches = _batches(2)
    model = OomAbove(_inner())
    acc = _accumulator(model, "largest")
    acc.step(batches[0], _loss)
    stale = [torch.ones_like(p) for p in model.parameters()]
    for param, grad in zip(model.parameters(), stale, strict=True):
        param.grad = grad  # gradients present before the call come back when it gives up
    before = _state(acc)
    model.threshold = 0  # now nothing fits
    with pytest.raises(MemoryBudgetError, match=r"micro_batch_size=1.*256MiB") as caught:
        acc.step(batches[1], _loss)
    assert "[32, 24, 18, 13, 9, 6, 4, 3, 2, 1]" in str(caught.value)
    assert_bitwise(_state(acc), before)
    assert all(p.grad is g for p, g in zip(model.parameters(), stale, strict=True))


def test_other_errors_are_not_retried() -> None:
    model = OomAbove(_inner())
    acc = _accumulator(model, "largest")

    def broken(model: nn.Module, batch) -> torch.Tensor:
        raise RuntimeError("shape mismatch in user code")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        acc.step(_batches(1)[0], broken)
    assert acc._auto.out_of_memory_events == 0


def test_grows_back_after_clean_windows_and_waits_longer_after_a_failed_regrowth() -> None:
    batches = _batches(9)
    torch.manual_seed(0)
    model = OomAbove(_inner())
    acc = _accumulator(model, "largest", regrow_after=2)
    _scarce_after_planning(acc, model, batches[0], threshold=24)
    sizes = [acc.step(batch, _loss).micro_batch_size for batch in batches]
    # 32 fails -> 24; two clean windows -> regrow to 32, which fails -> 24, wait doubles to 4.
    assert sizes == [24, 24, 24, 24, 24, 24, 24, 24, 24]
    assert acc._auto.wait == 8
    assert acc._auto.out_of_memory_events == 3
    model.threshold = math.inf  # memory freed elsewhere: the next regrowth sticks
    for batch in _batches(8):
        last = acc.step(batch, _loss)
    assert last.micro_batch_size == BATCH


def test_regrowth_disabled_with_none() -> None:
    sizer = AutoSizer("1GiB", torch.device("cpu"), regrow_after=None)
    sizer.planned = sizer.size = 16
    sizer.shrink([16])
    for _ in range(100):
        sizer.window_done()
    assert sizer.size == 12


def test_state_dict_keeps_the_chosen_size_and_the_plan() -> None:
    batches = _batches(2)
    model = OomAbove(_inner())
    acc = _accumulator(model, "largest")
    _scarce_after_planning(acc, model, batches[0], threshold=10)
    acc.step(batches[0], _loss)
    state = acc.state_dict()
    assert state["settings"]["micro_batch_size"] == "largest"
    assert state["auto"]["size"] == 9
    twin = _accumulator(OomAbove(_inner(), threshold=10), "largest")
    twin.load_state_dict(state)
    assert twin._auto.size == 9
    assert twin.plan == acc.plan
    assert twin.step(batches[1], _loss).micro_batch_size == 9  # no re-planning on resume


@pytest.mark.parametrize(
    ("saved", "resumed", "expected"),
    [
        (2, None, [24] * 7),  # before: regrown to 32 after the saved wait, regrowth off
        (None, 2, [24, 24] + [32] * 5),  # before: 24 forever
        (2, 4, [24] * 3 + [32] * 4),  # the window that shrank counts; before: [24] + [32] * 6
    ],
)
def test_a_run_resumed_with_another_regrow_after_follows_it(
    saved: int | None, resumed: int | None, expected: list[int]
) -> None:
    """The saved wait held: regrowth went on under `regrow_after=None`, or never came back."""
    batches = _batches(8)
    model = OomAbove(_inner())
    acc = _accumulator(model, "largest", regrow_after=saved)
    _scarce_after_planning(acc, model, batches[0], threshold=30)
    acc.step(batches[0], _loss)  # 32 fails -> 24
    assert acc.state_dict()["auto"]["size"] == 24
    memory_freed = OomAbove(_inner(), threshold=math.inf)
    twin = _accumulator(memory_freed, "largest", regrow_after=resumed)
    twin.load_state_dict(acc.state_dict())
    assert [twin.step(batch, _loss).micro_batch_size for batch in batches[1:]] == expected
    # Control: resumed with the same setting, the saved wait holds.
    same = _accumulator(OomAbove(_inner(), threshold=math.inf), "largest", regrow_after=saved)
    same.load_state_dict(acc.state_dict())
    grown = [same.step(batch, _loss).micro_batch_size for batch in batches[1:4]]
    assert grown == ([24, 32, 32] if saved == 2 else [24, 24, 24])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batch_size": "auto"}, "memory_budget is required on cpu"),
        ({"micro_batch_size": "auto", "memory_budget": "lots"}, "not a size"),
        ({"micro_batch_size": "Auto", "memory_budget": "1GiB"}, "pass a positive int, 'auto'"),
        ({"micro_batch_size": "auto", "memory_budget": "1GiB", "regrow_after": 0}, "regrow_after"),
        ({"micro_batch_size": 8, "memory_budget": "1GiB"}, "only used by micro_batch_size='auto'"),
    ],
)
def test_bad_auto_settings_raise_naming_the_fix(kwargs: dict, message: str) -> None:
    model = _inner()
    with pytest.raises(ValueError, match=message):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


# --------------------------------------------------------------------------------------------
# "auto": the fastest size that fits, timed on real windows (a fake clock: no real timing)
# --------------------------------------------------------------------------------------------


class Clocked(OomAbove):
    """`OomAbove` that advances a fake clock by what a micro-batch of its size costs."""

    def __init__(self, inner: nn.Module, cost) -> None:
        super().__init__(inner)
        self.cost, self.now = cost, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.now += self.cost(x.shape[0])
        return super().forward(x)


def _cache_bound(m: int) -> float:
    """Items cost 1.6x in micro-batches above 16 (out of cache), plus 0.5 per micro-batch."""
    return m * (1.0 if m <= 16 else 1.6) + 0.5


def test_auto_times_the_sizes_that_fit_and_keeps_the_fastest_exactly() -> None:
    batches = _batches(12)
    torch.manual_seed(0)  # as `_reference` does, for the same dropout masks
    model = Clocked(_inner(), _cache_bound)
    acc = _accumulator(model, "auto")
    acc._auto.clock = lambda: model.now
    results = [acc.step(batch, _loss) for batch in batches]
    sizes = [r.micro_batch_size for r in results]
    # Windows of 32 cost 51.7 at 32, 33 at 16, 34 at 8, 36 at 4: a warm-up, 2 rounds, then 16.
    assert sizes == [32] + [32, 16, 8, 4] * 2 + [16] * 3
    assert results[0].sizing.startswith("auto 32: warm-up")
    assert results[1].sizing == "auto 32: timing 4 candidates [32, 16, 8, 4], window 1 of 8"
    assert "fastest: 16 at" in results[-1].sizing
    assert "1.57x the largest that fits (32" in results[-1].sizing
    assert all(r.stepped and r.count == BATCH for r in results)
    # Exact whatever it ran: bitwise the run that used the same sizes from the start.
    assert_bitwise(_state(acc), _state(_reference(sizes, batches)))
    # NEGATIVE CONTROL: the largest size throughout is a differently rounded run.
    with pytest.raises(AssertionError):
        assert_bitwise(_state(acc), _state(_reference([32] * 12, batches)))


def test_auto_keeps_the_largest_when_no_size_is_clearly_faster() -> None:
    model = Clocked(_inner(), lambda m: 1.0 * m + 0.01)  # per-item cost only: sizes tie
    acc = _accumulator(model, "auto")
    acc._auto.clock = lambda: model.now
    results = [acc.step(batch, _loss) for batch in _batches(11)]
    assert [r.micro_batch_size for r in results[9:]] == [32, 32]
    assert results[-1].sizing.startswith("auto 32: kept 32")


def test_running_out_of_memory_while_timing_times_only_what_fits() -> None:
    batches = _batches(12)
    torch.manual_seed(0)  # as `_reference` does, for the same dropout masks
    model = Clocked(_inner(), _cache_bound)
    acc = _accumulator(model, "auto")
    _scarce_after_planning(acc, model, batches[0], threshold=25)
    acc._auto.clock = lambda: model.now
    results = [acc.step(batch, _loss) for batch in batches]
    sizes = [r.micro_batch_size for r in results]
    # 32 fails in the warm-up: 24 fits; then 24, 16, 8, 4 are timed twice and 16 wins.
    assert sizes == [24] + [24, 16, 8, 4] * 2 + [16] * 3
    assert max(model.sizes) == 32  # tried once, and never again
    assert acc._auto.out_of_memory_events == 1
    assert_bitwise(_state(acc), _state(_reference(sizes, batches)))


def test_largest_does_not_time_anything() -> None:
    model = Clocked(_inner(), _cache_bound)
    acc = _accumulator(model, "largest")
    results = [acc.step(batch, _loss) for batch in _batches(3)]
    assert [r.micro_batch_size for r in results] == [32] * 3
    assert all(r.sizing is None for r in results)


def test_auto_resumes_mid_tuning_in_a_fresh_accumulator_bitwise() -> None:
    """A run saved while "auto" still times sizes continues in a new Accumulator (new process).

    The fresh Accumulator has a plan and a tuner from the state but has run no window itself:
    the tuner's agreement over ranks must still find the model.
    """
    batches = _batches(12)
    torch.manual_seed(0)
    model = Clocked(_inner(), _cache_bound)
    acc = _accumulator(model, "auto")
    acc._auto.clock = lambda: model.now
    sizes = [acc.step(batch, _loss).micro_batch_size for batch in batches[:2]]
    saved, rng = clone_state([_state(acc), acc.state_dict()]), torch.get_rng_state()
    assert saved[1]["auto"]["tuner"] is not None  # still timing: the case that failed
    twin_model = Clocked(_inner(), _cache_bound)
    twin = _accumulator(twin_model, "auto")
    twin._auto.clock = lambda: twin_model.now
    twin.model.load_state_dict(saved[0]["model"])
    twin.optimizer.load_state_dict(saved[0]["optimizer"])
    twin.load_state_dict(saved[1])
    torch.set_rng_state(rng)  # the dropout masks continue, as load_checkpoint(restore_rng=True)
    sizes += [twin.step(batch, _loss).micro_batch_size for batch in batches[2:]]
    # Unfinished timing starts over (a warm-up, two rounds), then decides: the step that failed.
    assert sizes == [32, 32] + [32] + [32, 16, 8, 4] * 2 + [16]
    assert_bitwise(_state(twin), _state(_reference(sizes, batches)))
    # NEGATIVE CONTROL: the same sizes without the saved optimizer state end elsewhere.
    with pytest.raises(AssertionError):
        assert_bitwise(_state(twin), _state(_reference([32] * 12, batches)))


def test_sizing_says_when_a_window_ran_out_of_memory_and_was_rerun() -> None:
    """`StepResult.sizing` tells why a window ran smaller: "largest" and "auto" alike."""
    batches = _batches(3)
    torch.manual_seed(0)
    model = OomAt(_inner(), "backward")
    acc = _accumulator(model, "largest")
    acc._auto.planned = acc._auto.size = 8
    first = acc.step(batches[0], _loss)
    model.arm(2)
    second, third = acc.step(batches[1], _loss), acc.step(batches[2], _loss)
    assert first.sizing is None  # nothing to tell: the planned size ran
    assert second.sizing == ("largest 6: ran out of memory at 8; the window was rerun whole at 6")
    assert third.sizing is None  # a clean window at the smaller size
    # NEGATIVE CONTROL: the same run without the fault says nothing of memory.
    torch.manual_seed(0)
    clean = _accumulator(OomAt(_inner(), "backward"), "largest")
    clean._auto.planned = clean._auto.size = 8
    assert all(clean.step(b, _loss).sizing is None for b in batches)
    # "auto": the tuner's reason, then the rerun.
    torch.manual_seed(0)
    model = OomAt(_inner(), "forward")
    acc = _accumulator(model, "auto")
    acc.step(batches[0], _loss)  # plans, then the warm-up
    model.arm(0)
    timed = acc.step(batches[1], _loss)
    assert timed.sizing is not None
    assert timed.sizing.startswith(f"auto {timed.micro_batch_size}: ")
    assert timed.sizing.endswith(f"; the window was rerun whole at {timed.micro_batch_size})")
    assert "ran out of memory at " in timed.sizing


def _small_then_full(count: int, small: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A small first batch (a smoke test, a short shard), then full batches."""
    batches = _batches(count)
    x, y = batches[0]
    return [(x[:small], y[:small]), *batches[1:]]


@pytest.mark.parametrize("mode", ["largest", "auto"])
def test_a_small_first_batch_does_not_cap_the_size_for_good(mode: str) -> None:
    """The plan takes the whole first batch (4 items fit); a larger batch is planned again."""
    batches = _small_then_full(4)
    torch.manual_seed(0)  # as `_reference` does, for the same dropout masks
    acc = _accumulator(OomAbove(_inner()), mode)
    results = [acc.step(batch, _loss) for batch in batches]
    sizes = [r.micro_batch_size for r in results]
    assert acc.plan is not None
    assert acc.plan.batch_size == BATCH  # the plan now is the full batch's
    assert sizes[0] == 4
    assert sizes[1] == BATCH  # "largest", or "auto"'s warm-up at the new largest that fits
    assert all(r.count == len(b[1]) and r.stepped for r, b in zip(results, batches, strict=True))
    assert_bitwise(_state(acc), _state(_reference(sizes, batches)))
    # NEGATIVE CONTROL: capped at the first batch's 4, the full batches run 8 micro-batches of 4,
    # a different rounding of the same step: the comparison can fail.
    with pytest.raises(AssertionError):
        assert_bitwise(_state(acc), _state(_reference([4] * 4, batches)))


def test_a_plan_below_its_batch_or_after_out_of_memory_is_not_made_again() -> None:
    batches = _small_then_full(3)
    torch.manual_seed(0)
    model = OomAt(_inner(), "forward")
    acc = _accumulator(model, "largest")
    acc.step(batches[0], _loss)
    model.arm(0)  # the 4-item window fails once: 4 -> 3
    assert acc.step(batches[0], _loss).micro_batch_size == 3
    assert acc.step(batches[1], _loss).micro_batch_size == 3  # memory is short: no new plan
    assert acc.plan is not None
    assert acc.plan.batch_size == 4


def test_sizing_of_a_window_smaller_than_the_size_says_what_ran() -> None:
    """A short batch runs as one micro-batch of its items; the note does not claim the candidate."""
    batches = _batches(3)
    torch.manual_seed(0)
    acc = _accumulator(_inner(), "auto")
    first = acc.step(batches[0], _loss)  # warm-up at 32
    x, y = batches[1]
    short = acc.step((x[:5], y[:5]), _loss)
    assert first.sizing is not None
    assert first.sizing.startswith("auto 32: warm-up")
    assert short.micro_batch_size == 5
    assert short.sizing is not None
    assert short.sizing.startswith("auto 32: ")  # the candidate being timed ...
    assert short.sizing.endswith(
        "(the window's 5 items ran as one micro-batch)"
    )  # ... and what ran
    # NEGATIVE CONTROL: a full window says nothing of it.
    assert "ran as one micro-batch" not in acc.step(batches[2], _loss).sizing


@pytest.mark.parametrize("mode", ["largest", "auto"])
def test_giving_up_leaves_the_size_as_it_was_for_a_retry(mode: str) -> None:
    """After MemoryBudgetError nothing changed, the sizer included: a retry once memory is back
    runs at the size of before, not at 1."""
    batches = _batches(3)
    torch.manual_seed(0)
    model = OomAbove(_inner())
    acc = _accumulator(model, mode)
    first = acc.step(batches[0], _loss)
    before = acc._auto.state_dict()
    model.threshold = 0  # another process holds the memory for a while
    with pytest.raises(MemoryBudgetError):
        acc.step(batches[1], _loss)
    assert acc._auto.state_dict() == before
    model.threshold = math.inf  # it let go
    retry = acc.step(batches[1], _loss)
    assert retry.micro_batch_size == first.micro_batch_size == BATCH
    # NEGATIVE CONTROL: the sizes tried shrink to 1; had they stayed, the retry would run at 1.
    assert retry.micro_batch_size != 1


def test_sizing_after_a_shrink_names_the_size_that_ran_not_the_choice() -> None:
    batches = _batches(16)
    torch.manual_seed(0)
    model = OomAt(_inner(), "forward")
    acc = _accumulator(model, "auto", regrow_after=2)
    results = [acc.step(batch, _loss) for batch in batches[:10]]  # warm-up, 8 timed, 1 chosen
    assert acc._auto.tuner is not None
    assert not acc._auto.tuner.tuning
    chosen = acc._auto.tuner.chosen
    assert results[-1].sizing.startswith(f"auto {chosen}: ")
    model.arm(0)
    results = [acc.step(batch, _loss) for batch in batches[10:]]
    for result in results:  # shrunk, then clean windows, then regrown to the choice
        assert result.sizing.startswith(f"auto {result.micro_batch_size}: ")
    assert results[0].micro_batch_size < chosen
    assert f"the choice is {chosen}, out of memory since" in results[0].sizing
    assert results[-1].micro_batch_size == chosen
    # NEGATIVE CONTROL: the tuner's own note still names the choice, not what ran.
    assert acc._auto.tuner.note().startswith(f"auto {chosen}: ")


def test_numpy_batches_are_timed_again_when_their_items_grow() -> None:
    """NumPy arrays count as work per item too: 4x longer rows time the candidates again."""
    import numpy as np

    def loss(model: nn.Module, batch: dict) -> torch.Tensor:
        x = torch.as_tensor(batch["x"]).double()
        return F.cross_entropy(model(x.view(len(x), -1, 6).mean(1)), torch.as_tensor(batch["y"]))

    torch.manual_seed(0)
    acc = _accumulator(_inner(), "auto")
    generator = np.random.default_rng(0)
    short = {"x": generator.standard_normal((BATCH, 6)), "y": generator.integers(0, 3, BATCH)}
    long = {"x": generator.standard_normal((BATCH, 24)), "y": short["y"]}
    notes = [acc.step(short, loss).sizing for _ in range(10)]  # warm-up, 8 timed, decided
    assert "timing" not in notes[-1]
    assert "warm-up" not in notes[-1]
    assert acc.step(short, loss).sizing == notes[-1]  # the same shape: the decision stands
    assert "warm-up" in acc.step(long, loss).sizing  # NEGATIVE CONTROL: 4x the work: re-timed


class _Rows(nn.Module):
    """Mean-pools `(batch, length, 6)` rows, advancing a fake clock by a cost per micro-batch."""

    def __init__(self, inner: nn.Module, cost) -> None:
        super().__init__()
        self.inner, self.cost, self.now = inner, cost, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.now += self.cost(x.shape[0], x.shape[1])
        return self.inner(x.mean(1))


def test_varying_lengths_are_timed_once_per_shape_and_stay_exact() -> None:
    """Padded batches of 4, 12 or 40 positions in turn: each length is timed once, then runs
    at its own choice; every window equals the plain full-batch step (float64, 1e-10).

    Before, each change of length timed every candidate again (and after two restarts mixed the
    lengths in one decision), so "auto" never stopped timing and ran the slowest sizes.
    """
    generator = torch.Generator().manual_seed(3)
    lengths = [4, 12, 40] * 36
    batches = [
        (
            torch.randn(BATCH, length, 6, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (BATCH,), generator=generator),
        )
        for length in lengths
    ]
    # Items cost 1.6x in micro-batches above 16, plus 20 per micro-batch: 16 is the fastest.
    torch.manual_seed(0)
    model = _Rows(_inner(), lambda m, length: m * length * (1.0 if m <= 16 else 1.6) + 20)
    model.inner[2].p = 0.0  # no dropout: the reference below is plain PyTorch
    acc = _accumulator(model, "auto")
    acc._auto.clock = lambda: model.now
    results = [acc.step(batch, _loss) for batch in batches]
    notes = [r.sizing.split(" (")[0] for r in results]
    timed = [i for i, note in enumerate(notes) if "timing" in note or "warm-up" in note]
    # Each length timed once (a warm-up and 2 rounds of 4), in turn with the others' windows.
    assert len(timed) <= 3 * (1 + 4 * 2 + MAX_RESTARTS)  # and the warm-ups of restarts
    assert timed[-1] < 90  # then never again: the last windows run at the choices
    assert [r.micro_batch_size for r in results[90:]] == [16] * 18
    assert sorted(d["chosen"] for d in acc._auto.tuner.decisions) == [16, 16, 16]
    # EXACT whatever ran: the plain full-batch steps.
    reference = _Rows(_inner(), lambda m, length: 0.0)
    reference.inner[2].p = 0.0
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    for batch in batches:
        optimizer.zero_grad()
        _loss(reference, batch).backward()
        optimizer.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    # NEGATIVE CONTROL: a run that never adapts (size 4 throughout) is slower on this clock.
    slow = _Rows(_inner(), lambda m, length: m * length * (1.0 if m <= 16 else 1.6) + 20)
    slow_acc = _accumulator(slow, 4)
    for batch in batches[90:]:
        slow_acc.step(batch, _loss)
    fast = model.now
    for batch in batches[90:]:
        acc.step(batch, _loss)
    assert model.now - fast < slow.now


@pytest.mark.parametrize("mode", ["largest", "auto"])
def test_a_state_planned_for_another_budget_plans_again(mode: str) -> None:
    """A run resumed with a smaller `memory_budget` (a smaller device) plans for it.

    Before, the saved plan and size were kept whatever the budget: 4096 items per micro-batch
    where 1,000-odd fit, silently over the budget (on CUDA, out-of-memory reruns until shrunk).
    """
    generator = torch.Generator().manual_seed(5)
    batch = (
        torch.randn(4096, 6, generator=generator, dtype=torch.float64),
        torch.randint(0, 3, (4096,), generator=generator),
    )

    def build(budget: str) -> Accumulator:
        model = _inner()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return Accumulator(model, optimizer, micro_batch_size=mode, memory_budget=budget)

    big = build("256MiB")
    big.step(batch, _loss)
    saved = big.state_dict()
    fresh = build("600KiB")
    fits = fresh.step(batch, _loss).micro_batch_size
    assert fits < 4096
    resumed = build("600KiB")
    resumed.load_state_dict(saved)
    assert resumed.step(batch, _loss).micro_batch_size == fits
    assert resumed.plan is not None
    assert resumed.plan.memory_budget == 600 * 1024
    # NEGATIVE CONTROL: the same budget resumes without planning again.
    same = build("256MiB")
    same.load_state_dict(saved)
    assert same.plan == big.plan
    assert same._auto.size == big._auto.size == 4096


def test_a_shape_that_ran_out_of_memory_keeps_its_smaller_size_across_shape_changes() -> None:
    """Short and long rows in turn, each decided; then memory gets scarce for the long rows only.

    The long rows shrink once (16 -> 12) and keep 12 on each of their turns, while the short rows
    keep their 32. Remembering each shape's choice must not bring back the size that ran out of
    memory at every change of shape (before the fix: one out-of-memory rerun per long window).
    """
    generator = torch.Generator().manual_seed(3)
    lengths = [4] * 12 + [12] * 12 + [4, 12] * 8
    batches = [
        (
            torch.randn(BATCH, length, 6, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (BATCH,), generator=generator),
        )
        for length in lengths
    ]
    torch.manual_seed(0)
    # Above 200 positions per micro-batch items cost 1.6x: short rows run fastest at 32, long at 16.
    model = _Rows(_inner(), lambda m, length: m * length * (1.0 if m * length <= 200 else 1.6) + 20)
    model.inner[2].p = 0.0
    acc = _accumulator(model, "auto")
    acc._auto.clock = lambda: model.now
    for batch in batches[:24]:
        acc.step(batch, _loss)
    assert sorted(d["chosen"] for d in acc._auto.tuner.decisions) == [16, 32]
    failures = []

    def scarce(module: nn.Module, args: tuple[torch.Tensor]) -> None:
        if args[0].shape[0] * args[0].shape[1] > 12 * 12:
            failures.append(args[0].shape[0])
            raise torch.OutOfMemoryError("injected: the long rows no longer fit above 12")

    model.register_forward_pre_hook(scarce)
    results = [acc.step(batch, _loss) for batch in batches[24:]]
    assert [r.micro_batch_size for r in results] == [32, 12] * 8
    assert failures == [16]  # once, not on every turn of the long rows
    assert "the choice is 16, out of memory since" in results[-1].sizing
    assert acc._auto.tuner.state_dict()["decisions"][1]["fits"] == 12  # kept in the state
    # EXACT: the plain full-batch steps.
    reference = _Rows(_inner(), lambda m, length: 0.0)
    reference.inner[2].p = 0.0
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    for batch in batches:
        optimizer.zero_grad()
        _loss(reference, batch).backward()
        optimizer.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["largest", "auto"])
def test_planning_again_that_raises_changes_nothing(mode: str) -> None:
    """A larger batch plans again (the first plan took all 4 items); if that planning raises
    (here the loss, on more than 4 rows), the sizer is as before: its size, plan and timing.

    Before, the size and the tuner were dropped before planning, so the error left the sizer
    without them (the next window planned and timed from scratch).
    """
    batches = _small_then_full(3)
    torch.manual_seed(0)
    model = Clocked(_inner(), _cache_bound)
    acc = _accumulator(model, mode)
    acc._auto.clock = lambda: model.now
    for _ in range(3):
        acc.step(batches[0], _loss)
    before, state = acc._auto.state_dict(), _state(acc)

    def only_small(model: nn.Module, batch) -> torch.Tensor:
        if len(batch[1]) > 4:
            raise ValueError("a loss that fails on larger batches")
        return _loss(model, batch)

    with pytest.raises(ValueError, match="fails on larger batches"):
        acc.step(batches[1], only_small)
    assert acc._auto.state_dict() == before
    assert_bitwise(_state(acc), state)
    # NEGATIVE CONTROL: with a loss that works, the larger batch is planned on.
    acc.step(batches[1], _loss)
    assert acc.plan is not None
    assert acc.plan.batch_size == BATCH


@pytest.mark.parametrize("mode", ["largest", "auto"])
def test_a_skipped_window_advances_the_random_numbers_as_a_fixed_size_run(mode: str) -> None:
    """A non-finite window is skipped; the next one draws new dropout masks, as at a fixed size.

    Before, an auto-sized window rewound the random number generators whenever it was forgotten
    (to be ready for an out-of-memory rerun), so after a skipped window the next one reused the
    skipped window's masks and the run left the fixed-size run it should equal.
    """
    batches = _batches(4)
    x, y = batches[1]
    batches[1] = (x.clone().index_fill_(0, torch.tensor([3]), math.inf), y)  # non-finite: skipped
    torch.manual_seed(0)
    acc = _accumulator(OomAbove(_inner()), mode)
    results = [acc.step(batch, _loss) for batch in batches]
    assert [r.stepped for r in results] == [True, False, True, True]
    sizes = [r.micro_batch_size for r in results]
    assert_bitwise(_state(acc), _state(_reference(sizes, batches)))
    # NEGATIVE CONTROL: the old behaviour, the generators rewound after the skipped window.
    torch.manual_seed(0)
    rewound = _accumulator(OomAbove(_inner()), sizes[0])
    for index, (size, batch) in enumerate(zip(sizes, batches, strict=True)):
        rewind = torch.get_rng_state()
        rewound.micro_batch_size = size
        rewound.step(batch, _loss)
        if index == 1:
            torch.set_rng_state(rewind)
    with pytest.raises(AssertionError):
        assert_bitwise(_state(acc), _state(rewound))


def _augmented_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Jitters the inputs with NumPy's and Python's global generators (an older pipeline's
    augmentation), not torch's."""
    x, y = batch
    jitter = torch.from_numpy(np.random.standard_normal(tuple(x.shape))) * random.uniform(0, 1)
    return F.cross_entropy(model(x + jitter), y)


class _OwnJitter(nn.Module):
    """Jitters its input with a generator of its own (a diffusion model's noise generator)."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn(x.shape, generator=self.generator, dtype=x.dtype)


def test_a_rerun_window_draws_numpy_and_python_numbers_as_a_fixed_size_run() -> None:
    """An out-of-memory rerun rewinds NumPy's and Python's generators too, and those the model
    holds, so a `loss_fn` that augments with them (a model drawing its own noise) sees the same
    numbers as a run at the smaller size from the start.

    Before, only torch's global generators were rewound: the rerun jittered with the failed
    attempt's successors and ended 1e-2 away from that run.
    """
    batches = _batches(3)

    def run(sizes: list[int] | None, burned: int = 0) -> Accumulator:
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        if sizes is None:  # auto, failing once at the second window's third micro-batch
            model = OomAt(nn.Sequential(_OwnJitter(), _inner()))
            acc = _accumulator(model, "largest")
            acc._auto.planned = acc._auto.size = 8  # type: ignore[union-attr]
            acc.step(batches[0], _augmented_loss)
            model.arm(2)
            results = [acc.step(batch, _augmented_loss) for batch in batches[1:]]
            assert [r.micro_batch_size for r in results] == [6, 6]
            return acc
        jitter = _OwnJitter()
        acc = _accumulator(OomAbove(nn.Sequential(jitter, _inner())), sizes[0])
        for index, (size, batch) in enumerate(zip(sizes, batches, strict=True)):
            for _ in range(burned if index == 1 else 0):  # the failed attempt's draws
                np.random.standard_normal((8, 6))
                random.uniform(0, 1)
                torch.randn(8, 6, generator=jitter.generator, dtype=torch.float64)
            acc.micro_batch_size = size
            acc.step(batch, _augmented_loss)
        return acc

    rerun = run(None)
    assert_bitwise(_state(rerun), _state(run([8, 6, 6])))
    # NEGATIVE CONTROL: the same sizes after the failed attempt's 3 micro-batches of draws (the
    # old behaviour) end elsewhere.
    with pytest.raises(AssertionError):
        assert_bitwise(_state(rerun), _state(run([8, 6, 6], burned=3)))


def test_a_failed_window_leaves_the_rng_advanced_by_its_draws_as_a_plain_loop() -> None:
    """RNG is not part of "a failed window changes nothing" (docs/reliability.md): a window that
    raised (not out of memory) leaves torch's generator where its forwards' draws left it, as a
    plain loop would; only an out-of-memory rerun rewinds it. Streamed, a rewind would repeat
    the loop's own draws between micro_step() calls (data augmentation)."""

    def build(**kwargs: int) -> tuple[torch.nn.Module, Accumulator]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5))
        model.append(torch.nn.Linear(8, 1))
        return model, Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)

    x, y = torch.randn(16, 4), torch.randn(16, 1)
    calls = [0]

    def failing(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = model(batch[0])
        calls[0] += 1
        if calls[0] == 2:  # after the second micro-batch's forward drew its dropout mask
            raise RuntimeError("a bad micro-batch")
        return torch.nn.functional.mse_loss(out, batch[1])

    for kwargs, stream in (({"micro_batch_size": 4}, False), ({"accumulation_steps": 4}, True)):
        model, acc = build(**kwargs)
        twin = copy.deepcopy(model)
        calls[0] = 0
        torch.manual_seed(7)
        before = torch.get_rng_state()

        def run(acc: Accumulator = acc, stream: bool = stream) -> None:
            if stream:
                for i in range(0, 16, 4):
                    acc.micro_step((x[i : i + 4], y[i : i + 4]), failing)
            else:
                acc.step((x, y), failing)

        with pytest.raises(RuntimeError, match="a bad micro-batch"):
            run()
        after = torch.get_rng_state()
        torch.set_rng_state(before)  # the same two forwards in a plain loop
        with torch.no_grad():
            twin(x[:4])
            twin(x[4:8])
        assert torch.equal(after, torch.get_rng_state())
        assert not torch.equal(after, before)  # the control: not rewound


# --------------------------------------------------------------------------------------------
# "auto" with BatchNorm normalizing each micro-batch: the split is the statistics' batch
# --------------------------------------------------------------------------------------------


class _ClockedBatchNorm(nn.Module):
    """A float64 MLP with BatchNorm whose fake clock makes micro-batches of 16 the fastest."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
        self.body.double()
        self.now = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.now += _cache_bound(x.shape[0])
        return self.body(x)


def _bn_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _batches(count, features=8, seed=5)


def _bn_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _bn_auto(batchnorm: str) -> tuple[Accumulator, _ClockedBatchNorm]:
    model = _ClockedBatchNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(
        model, opt, micro_batch_size="auto", memory_budget=BUDGET, batchnorm=batchnorm
    )
    acc._auto.clock = lambda: model.now
    return acc, model


def _full_batch_run(batches, *, train: bool = True) -> _ClockedBatchNorm:
    """The plain loop: one forward and backward of the whole batch per step."""
    model = _ClockedBatchNorm()
    model.train(train)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        _bn_loss(model, batch).backward()
        opt.step()
    return model


def _off(model: nn.Module, reference: nn.Module) -> float:
    pairs = zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
    return max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
        for a, b in pairs
        if a.is_floating_point()
    )


@pytest.mark.parametrize("batchnorm", ["micro", "pooled"])
def test_auto_with_train_mode_batchnorm_keeps_the_largest_and_stays_exact(batchnorm) -> None:
    """Timing 16, 8 and 4 for a window of 32 trained three other BatchNorm batches.

    The fake clock makes 16 the fastest: "auto" timed it and kept it, 0.03 to 1 off the plain
    full-batch step (silently under "pooled"). With BatchNorm normalizing each micro-batch the
    split is not a speed knob: the window runs at the largest size that fits, untimed.
    """
    batches = _bn_batches(12)
    acc, _ = _bn_auto(batchnorm)
    results = [acc.step(batch, _bn_loss) for batch in batches]
    assert [r.micro_batch_size for r in results] == [BATCH] * 12
    assert results[-1].sizing.startswith("auto 32: the largest that fits, untimed: BatchNorm")
    assert "batchnorm='frozen'" in results[-1].sizing
    assert acc._auto.tuner is None
    assert _off(acc.model, _full_batch_run(batches)) < 1e-10
    # NEGATIVE CONTROL: the sizes the tuner timed and kept (16) are another training.
    fixed = _ClockedBatchNorm()
    opt = torch.optim.SGD(fixed.parameters(), lr=0.1, momentum=0.9)
    split = Accumulator(fixed, opt, micro_batch_size=16, batchnorm=batchnorm)
    for batch in batches:
        split.step(batch, _bn_loss)
    assert _off(fixed, _full_batch_run(batches)) > 1e-3


def test_auto_still_times_sizes_under_frozen_batchnorm_exactly() -> None:
    """Frozen BatchNorm uses its running statistics: the split is a speed knob again."""
    batches = _bn_batches(12)
    acc, _ = _bn_auto("frozen")
    sizes = [acc.step(batch, _bn_loss).micro_batch_size for batch in batches]
    assert sizes == [32] + [32, 16, 8, 4] * 2 + [16] * 3
    assert _off(acc.model, _full_batch_run(batches, train=False)) < 1e-10


def test_batchnorm_put_in_train_mode_after_timing_goes_back_to_the_largest() -> None:
    """A BatchNorm left in eval mode while "auto" timed (16 kept), then trained: 32 again."""
    batches = _bn_batches(14)
    acc, model = _bn_auto("micro")
    model.body[1].eval()
    sizes = [acc.step(batch, _bn_loss).micro_batch_size for batch in batches[:12]]
    assert sizes[-1] == 16
    model.body[1].train()
    result = acc.step(batches[12], _bn_loss)
    assert result.micro_batch_size == BATCH
    assert "untimed: BatchNorm (body.1)" in result.sizing
    assert acc._auto.tuner is None


class _ClockedEncoder(nn.Module):
    """A float64 encoder whose fake clock makes micro-batches of 16 the fastest."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 4).double()
        self.now = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.now += _cache_bound(x.shape[0])
        return self.body(x)


def _clocked_auto(model: _ClockedEncoder) -> Accumulator:
    """An auto-sized Accumulator over `model`, timed by the model's fake clock."""
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size="auto",
        memory_budget=BUDGET,
    )  # fmt: skip
    acc._auto.clock = lambda: model.now
    return acc


def _info_nce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    anchors, positives = model(batch[0]), model(batch[1])
    return F.cross_entropy(anchors @ positives.T, torch.arange(len(anchors)))


def _pairs(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(6)
    return [
        tuple(torch.randn(BATCH, 8, generator=generator, dtype=torch.float64) for _ in range(2))
        for _ in range(count)
    ]


class _DroppedEncoder(_ClockedEncoder):
    """`_ClockedEncoder` with dropout: a rerun window must draw the same masks as a fresh one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(super().forward(x), p=0.25, training=self.training)


def test_auto_reruns_whole_the_split_window_that_warned_the_loss_compares_rows() -> None:
    """In-batch negatives: the size is the number of negatives, not a speed knob.

    "auto" timed 16, 8 and 4 and kept 16 (16 negatives instead of 32, 3e-2 off the full-batch
    step), the warning told once. Then the windows after the warning ran at the largest size,
    untimed, but the timed window that warned (at 16) had already stepped split (1.8e-2 off).
    Now that window is forgotten (gradients, RNG) and rerun whole: every window is the plain
    full-batch step, dropout masks included.
    """
    batches = _pairs(12)
    torch.manual_seed(3)
    model = _DroppedEncoder()
    acc = _clocked_auto(model)
    with pytest.warns(UserWarning, match="compares the rows of its micro-batch") as told:
        results = [acc.step(batch, _info_nce) for batch in batches]
    assert len([w for w in told if "compares the rows" in str(w.message)]) == 1
    assert [r.micro_batch_size for r in results] == [BATCH] * 12
    assert "the window ran at 16 first and was rerun whole" in results[2].sizing
    assert "untimed: loss_fn compares, pools or normalizes the rows" in results[-1].sizing
    torch.manual_seed(3)
    reference = _DroppedEncoder()  # the plain full-batch loop
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        _info_nce(reference, batch).backward()
        opt.step()
    assert _off(acc.model, reference) < 1e-10
    # NEGATIVE CONTROL: the old behaviour, the window that warned stepped at 16.
    torch.manual_seed(3)
    split = _DroppedEncoder()
    opt = torch.optim.SGD(split.parameters(), lr=0.5)
    for index, (a, p) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        if index == 2:
            halves = [(a[:16], p[:16]), (a[16:], p[16:])]
            (sum(_info_nce(split, half) for half in halves) / 2).backward()
        else:
            _info_nce(split, (a, p)).backward()
        opt.step()
    assert _off(split, reference) > 1e-3


def _normalized_advantages(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """PPO's copied line: advantages normalized over the micro-batch inside loss_fn."""
    x, advantages = batch
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    return -(model(x).sum(dim=1) * advantages).mean()


def test_auto_stops_timing_once_advantages_are_warned_normalized_per_micro_batch() -> None:
    """Any loss warned to depend on the split (here advantages normalized per micro-batch, as
    mixup drawn in loss_fn or class weights from its labels would be) stops the timing: the
    tuner went on timing 16, 8 and 4 after the warning and kept 16, another objective."""
    generator = torch.Generator().manual_seed(7)
    batches = [
        (torch.randn(BATCH, 8, generator=generator, dtype=torch.float64),
         torch.randn(BATCH, generator=generator, dtype=torch.float64))
        for _ in range(12)
    ]  # fmt: skip
    model = _ClockedEncoder()
    acc = _clocked_auto(model)
    with pytest.warns(UserWarning, match="Normalize over the whole batch"):
        results = [acc.step(batch, _normalized_advantages) for batch in batches]
    sizes = [r.micro_batch_size for r in results]
    assert sizes[-4:] == [BATCH] * 4, sizes  # NEGATIVE CONTROL before the fix: 16 kept
    assert "untimed: loss_fn compares, pools or normalizes the rows" in results[-1].sizing
    # The plain loop, with each window split as the Accumulator split it (rows-weighted means).
    reference = _ClockedEncoder()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for (x, adv), size in zip(batches, sizes, strict=True):
        opt.zero_grad(set_to_none=True)
        parts = zip(x.split(size), adv.split(size), strict=True)
        sum(_normalized_advantages(reference, p) * len(p[0]) / BATCH for p in parts).backward()
        opt.step()
    assert _off(acc.model, reference) < 1e-10
