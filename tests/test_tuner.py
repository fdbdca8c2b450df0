"""Tests for gradaccum._tuner: the fastest micro-batch size, from timed windows, with hysteresis.

The tuner is fed seconds per window directly (no clock, no model): each test states what the
windows cost and asserts the size chosen, so nothing here depends on how fast this machine is.
"""

from __future__ import annotations

import pytest

from gradaccum._tuner import MARGIN, MAX_RESTARTS, ROUNDS, ThroughputTuner, candidates


def _tune(tuner: ThroughputTuner, seconds: dict[int, float], items: int = 64) -> list[int]:
    """Run windows until the tuner decides; each window at size s takes `seconds[s]`."""
    ran = []
    while tuner.tuning:
        size = tuner.next_size()
        ran.append(size)
        tuner.record(size, items=items, seconds=seconds[size])
    return ran


@pytest.mark.parametrize(
    ("fits", "window", "expected"),
    [
        (100, 256, [100, 64, 32, 16]),
        (64, 256, [64, 32, 16, 8]),
        (64, 40, [40, 32, 16, 8]),
        (3, 8, [3, 2, 1]),
        (1, 8, [1]),
        (500, 3, [3, 2, 1]),
    ],
)
def test_candidates_are_the_largest_that_fits_then_powers_of_two(fits, window, expected) -> None:
    assert candidates(fits, window) == expected


def test_the_fastest_is_chosen_after_a_warm_up_and_interleaved_rounds() -> None:
    seconds = {64: 1.0, 32: 0.5, 16: 0.6, 8: 0.9}
    tuner = ThroughputTuner(fits=64, window_items=64)
    ran = _tune(tuner, seconds)
    assert ran == [64] + [64, 32, 16, 8] * ROUNDS  # the warm-up window, then interleaved
    assert tuner.chosen == 32
    assert tuner.rates[32] == pytest.approx(128.0)
    assert "fastest: 32 at 128 items/s, 2.00x the largest that fits" in tuner.reason
    assert tuner.next_size() == 32  # settled: no more timing


def test_the_warm_up_window_does_not_count() -> None:
    tuner = ThroughputTuner(fits=64, window_items=64)
    tuner.record(tuner.next_size(), items=64, seconds=1000.0)  # a terribly slow first window
    _tune(tuner, {64: 0.5, 32: 0.52, 16: 0.7, 8: 0.9})
    assert tuner.chosen == 64


@pytest.mark.parametrize(("gain", "switch"), [(MARGIN / 2, False), (MARGIN * 2, True)])
def test_hysteresis_keeps_the_incumbent_unless_a_candidate_is_clearly_faster(gain, switch) -> None:
    seconds = {64: 1.0, 32: 1.0 / (1 + gain), 16: 1.5, 8: 2.0}
    tuner = ThroughputTuner(fits=64, window_items=64)
    _tune(tuner, seconds)
    assert tuner.chosen == (32 if switch else 64)
    if not switch:
        assert tuner.reason.startswith("kept 64")


def test_a_retune_keeps_the_previous_choice_within_the_noise() -> None:
    """No flip-flop: after the shape changes, 16 is 3% faster than the choice, 32: 32 stays."""
    tuner = ThroughputTuner(fits=64, window_items=64)
    tuner.observe(64, work_per_item=10.0)
    _tune(tuner, {64: 1.0, 32: 0.5, 16: 0.6, 8: 0.9})
    assert tuner.chosen == 32
    assert not tuner.observe(64, work_per_item=15.0)  # 1.5x: not enough to time again
    assert tuner.observe(64, work_per_item=25.0)  # 2.5x longer items: time again
    assert tuner.tuning
    _tune(tuner, {64: 2.0, 32: 1.0, 16: 1.0 / 1.03, 8: 1.5})
    assert tuner.chosen == 32
    assert "previous choice" not in tuner.reason
    assert tuner.reason.startswith("kept 32")


def test_ranks_agree_on_the_slowest_ranks_times() -> None:
    """Rank 0 alone would pick 16, rank 1 alone 32; both pick what is fastest for the slowest."""
    per_rank = [
        {64: 1.0, 32: 0.8, 16: 0.5, 8: 0.9},
        {64: 1.0, 32: 0.6, 16: 0.9, 8: 0.9},
    ]
    logs: list[list[float]] = [[], []]

    def agree(rank: int):
        def combine(mine: list[float]) -> list[float]:
            logs[rank] = mine
            other = [s / 64 for s in per_rank[1 - rank].values()]  # the other rank's medians
            return [max(a, b) for a, b in zip(mine, other, strict=True)]

        return combine

    chosen = []
    for rank in (0, 1):
        tuner = ThroughputTuner(fits=64, window_items=64, agree=agree(rank))
        _tune(tuner, per_rank[rank])
        chosen.append(tuner.chosen)
    assert chosen == [32, 32]  # slowest-rank times: 64: 1.0, 32: 0.8, 16: 0.9, 8: 0.9
    # NEGATIVE CONTROL: without agreeing, rank 0 would choose differently.
    alone = ThroughputTuner(fits=64, window_items=64)
    _tune(alone, per_rank[0])
    assert alone.chosen == 16


def test_running_out_of_memory_while_timing_drops_the_larger_sizes() -> None:
    tuner = ThroughputTuner(fits=64, window_items=64)
    tuner.record(tuner.next_size(), items=64, seconds=1.0)  # warm-up
    assert tuner.next_size() == 64
    tuner.limit(48)  # 64 ran out of memory; the sizer shrank to 48
    assert tuner.sizes == [48, 32, 16, 8]
    ran = _tune(tuner, {48: 1.0, 32: 0.7, 16: 0.8, 8: 0.9})
    assert max(ran) == 48
    assert tuner.chosen == 32


def test_a_rerun_window_at_another_size_is_not_counted() -> None:
    tuner = ThroughputTuner(fits=64, window_items=64)
    tuner.record(64, items=64, seconds=1.0)  # warm-up
    tuner.record(17, items=64, seconds=0.01)  # not the size asked for: ignored
    assert tuner.next_size() == 64


def test_state_dict_keeps_the_decision_and_restarts_unfinished_timing() -> None:
    tuner = ThroughputTuner(fits=64, window_items=64)
    _tune(tuner, {64: 1.0, 32: 0.5, 16: 0.6, 8: 0.9})
    twin = ThroughputTuner(fits=1, window_items=1)
    twin.load_state_dict(tuner.state_dict())
    assert (twin.chosen, twin.reason, twin.rates) == (tuner.chosen, tuner.reason, tuner.rates)
    half = ThroughputTuner(fits=64, window_items=64)
    half.record(64, items=64, seconds=1.0)
    again = ThroughputTuner(fits=1, window_items=1)
    again.load_state_dict(half.state_dict())
    assert again.tuning
    assert again.sizes == [64, 32, 16, 8]


def test_a_shape_change_while_timing_times_again_at_the_new_shape() -> None:
    """One decision compares windows of one shape: short windows timed, then long ones, is noise.

    Windows of short items (work 10) begin the timing; midway the items get 3x longer. The
    timing starts over at the new shape, and once decided at that shape the next long window
    does not time again (the reference is the shape timed, not the very first window's).
    """
    tuner = ThroughputTuner(fits=64, window_items=64)
    assert not tuner.observe(64, work_per_item=10.0)
    for _ in range(3):  # the warm-up and two timed windows, at the short shape
        tuner.record(tuner.next_size(), items=64, seconds=1.0)
    assert tuner.observe(64, work_per_item=30.0)  # 3x: the windows timed so far do not count
    assert tuner.tuning
    assert tuner.note().startswith("auto 64: warm-up")
    long_windows = {64: 3.0, 32: 1.5, 16: 1.8, 8: 2.7}
    while tuner.tuning:
        assert not tuner.observe(64, work_per_item=30.0)
        size = tuner.next_size()
        tuner.record(size, items=64, seconds=long_windows[size])
    assert tuner.chosen == 32
    assert not tuner.observe(64, work_per_item=31.0)  # the shape timed: no new timing
    assert tuner.chosen == 32
    # NEGATIVE CONTROL: a change of less than SHAPE_CHANGE while timing does not restart it.
    other = ThroughputTuner(fits=64, window_items=64)
    other.observe(64, work_per_item=10.0)
    other.record(other.next_size(), items=64, seconds=1.0)
    assert not other.observe(64, work_per_item=15.0)
    assert other.note().startswith("auto 64: timing")


def test_a_shape_change_on_a_short_window_keeps_the_candidates() -> None:
    """A short last batch of longer items times again, but not only sizes up to its rows."""
    tuner = ThroughputTuner(fits=64, window_items=64)
    tuner.observe(64, work_per_item=10.0)
    _tune(tuner, {64: 1.0, 32: 0.5, 16: 0.6, 8: 0.9})
    assert tuner.observe(3, work_per_item=40.0)
    assert tuner.sizes == [64, 32, 16, 8]
    # NEGATIVE CONTROL: a tuner built on the short window alone has only its sizes.
    assert ThroughputTuner(fits=64, window_items=3).sizes == [3, 2, 1]


def test_shapes_that_never_settle_cannot_keep_it_timing_forever() -> None:
    """Work per item alternating 3x every window: the timing restarts at most MAX_RESTARTS times.

    Then it finishes on the shape it restarted at: the other shape's windows run at the
    incumbent, untimed (before, they were timed with it and the decision mixed two shapes).
    """
    tuner = ThroughputTuner(fits=64, window_items=64)
    windows, timed = 0, []
    while tuner.tuning and windows < 100:
        work = 10.0 if windows % 2 else 30.0
        tuner.observe(64, work_per_item=work)
        size = tuner.next_size()
        if "untimed" not in tuner.note():
            timed.append(work)
        else:
            assert size == tuner.incumbent
        tuner.record(size, items=64, seconds=1.0 if work == 30.0 else 0.001)
        windows += 1
    assert not tuner.tuning
    # warm-ups, then the timed windows of one shape, each after an untimed one of the other
    assert windows == 1 + MAX_RESTARTS + 2 * len(tuner.sizes) * ROUNDS
    assert set(timed[1 + MAX_RESTARTS :]) == {30.0}  # no decision compares two shapes
    assert tuner.chosen == 64  # every size alike at 1.0 s: the fast short windows did not count
    # NEGATIVE CONTROL: each restart did happen (the timing began again with a warm-up).
    restarted = ThroughputTuner(fits=64, window_items=64)
    restarted.observe(64, work_per_item=10.0)
    restarted.record(restarted.next_size(), items=64, seconds=1.0)
    assert restarted.observe(64, work_per_item=30.0)
    assert restarted.note().startswith("auto 64: warm-up")


def test_no_measurable_work_never_times_again() -> None:
    """Batches without tensors (raw text tokenized in the loss, NumPy arrays) measure 0 work per
    item: that is no shape change, so a decision stands."""
    tuner = ThroughputTuner(fits=64, window_items=64)
    assert not tuner.observe(64, work_per_item=0.0)
    _tune(tuner, {64: 1.0, 32: 0.5, 16: 0.6, 8: 0.9})
    assert tuner.chosen == 32
    for _ in range(5):
        assert not tuner.observe(64, work_per_item=0.0)
    assert tuner.chosen == 32
    # NEGATIVE CONTROL: a measurable 3x change does time again.
    assert tuner.observe(64, work_per_item=3.0) is False  # from 0: nothing to compare with
    assert tuner.observe(64, work_per_item=9.0)


def test_a_shape_decided_before_is_not_timed_again() -> None:
    """Batches of short and long items in turn (padded NLP data): each shape is timed once.

    Before, every change of shape past SHAPE_CHANGE timed all candidates again, so data whose
    lengths vary kept "auto" timing (and running the slow sizes) for the whole run.
    """
    short, long = {64: 1.0, 32: 0.5, 16: 0.6, 8: 0.9}, {64: 3.0, 32: 3.3, 16: 3.6, 8: 4.0}
    tuner = ThroughputTuner(fits=64, window_items=64)
    tuner.observe(64, work_per_item=10.0)
    _tune(tuner, short)
    assert tuner.chosen == 32
    assert tuner.observe(64, work_per_item=30.0)  # a new shape: timed
    _tune(tuner, long)
    assert tuner.chosen == 64
    for _ in range(3):  # back and forth: each shape's own choice, and no timing
        assert not tuner.observe(64, work_per_item=11.0)
        assert (tuner.tuning, tuner.chosen) == (False, 32)
        assert tuner.reason.startswith("fastest: 32")
        assert not tuner.observe(64, work_per_item=29.0)
        assert (tuner.tuning, tuner.chosen) == (False, 64)
    # While a third shape is timed, a window of a decided shape runs at its choice, untimed.
    assert tuner.observe(64, work_per_item=100.0)  # NEGATIVE CONTROL: a new shape is timed
    tuner.record(tuner.next_size(), items=64, seconds=1.0)  # its warm-up
    assert not tuner.observe(64, work_per_item=10.0)
    assert tuner.next_size() == 32
    assert tuner.note().startswith("auto 32: chosen before for items of this shape, untimed")
    tuner.record(32, items=64, seconds=0.001)  # not counted for the shape being timed
    assert not tuner.observe(64, work_per_item=100.0)
    ran = _tune(tuner, {64: 9.0, 32: 8.0, 16: 9.5, 8: 12.0})
    assert ran == [64, 32, 16, 8] * ROUNDS  # the foreign window took no turn of the timing
    assert tuner.chosen == 32
    assert tuner.rates[32] == pytest.approx(64 / 8.0)  # 64 items in 8 s, not in 0.001 s
    # The decisions survive a state_dict round trip (a resumed run does not time them again).
    twin = ThroughputTuner(fits=1, window_items=1)
    twin.load_state_dict(tuner.state_dict())
    assert not twin.observe(64, work_per_item=30.0)
    assert (twin.tuning, twin.chosen) == (False, 64)


def test_a_decision_taken_back_after_running_out_of_memory_says_it_was_capped() -> None:
    """Long items ran out of memory above 6 while timed: the short items' earlier choice of 32
    comes back capped at 6, and the reason says so (it claimed 32 while 6 ran)."""
    tuner = ThroughputTuner(fits=64, window_items=64)
    tuner.observe(64, work_per_item=10.0)
    _tune(tuner, {64: 1.0, 32: 0.5, 16: 0.6, 8: 0.9})
    assert tuner.observe(64, work_per_item=40.0)
    tuner.limit(6)  # the long items' warm-up at 64 ran out of memory: 6 fits
    _tune(tuner, {6: 1.0, 4: 1.2, 2: 1.5, 1: 2.0})
    assert not tuner.observe(64, work_per_item=10.0)
    assert tuner.chosen == 6
    assert tuner.note().startswith("auto 6: 6, the largest that fits since a larger size ran out")
    assert "for this shape before: fastest: 32" in tuner.reason
    # NEGATIVE CONTROL: without the out-of-memory error the choice comes back whole.
    free = ThroughputTuner(fits=64, window_items=64)
    free.observe(64, work_per_item=10.0)
    _tune(free, {64: 1.0, 32: 0.5, 16: 0.6, 8: 0.9})
    free.observe(64, work_per_item=40.0)
    _tune(free, {64: 1.0, 32: 1.2, 16: 1.5, 8: 2.0})
    assert not free.observe(64, work_per_item=10.0)
    assert (free.chosen, free.reason[:10]) == (32, "fastest: 3")
