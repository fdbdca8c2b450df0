"""Tests for gradaccum.telemetry: the gradient noise scale against a closed form, and the rest.

Linear regression with Gaussian inputs and noise has a known noise scale. With `y = x·w* + ε`,
`x ~ N(0, I_d)`, `ε ~ N(0, σ²)` and the loss `½ (x·w - y)²` at a fixed `w = w* + δ`:

    G = δ,    tr(Σ) = d (|δ|² + σ²) + |δ|²,    B_simple = tr(Σ) / |G|²

The learning rate is 0, so `w` stays put and every step estimates the same quantity from fresh data.
Windows of 128 items in micro-batches of 8, 600 steps: over 5 data seeds the estimate landed at
16.6 to 17.6 for a truth of 17 (checked by hand), so the 10% tolerance is not tuned to one seed.
"""

from __future__ import annotations

import copy
import statistics

import pytest
import torch
from torch.nn import functional as F

from gradaccum import Accumulator, LossSum
from gradaccum.telemetry import TelemetryMeter

D = 8


def _truth(delta_sq: float, sigma_sq: float) -> float:
    return (D * (delta_sq + sigma_sq) + delta_sq) / delta_sq


def _run(sigma_sq: float, steps: int, *, micro: int = 8, batch: int = 128, plain_mean: bool = True):
    generator = torch.Generator().manual_seed(0)
    w_star = torch.randn(D, 1, generator=generator, dtype=torch.float64)
    delta = torch.randn(D, 1, generator=generator, dtype=torch.float64)
    delta /= delta.norm()  # |δ|² = 1
    model = torch.nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + delta).T)
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.0), micro_batch_size=micro, telemetry=True
    )

    def half_square(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]):
        residual = m(b[0]) - b[1]
        if plain_mean:
            return 0.5 * residual.pow(2).mean()
        return LossSum(0.5 * residual.pow(2).sum(), len(residual))

    results = []
    for _ in range(steps):
        x = torch.randn(batch, D, generator=generator, dtype=torch.float64)
        noise = torch.randn(batch, 1, generator=generator, dtype=torch.float64) * sigma_sq**0.5
        results.append(acc.step((x, x @ w_star + noise), half_square))
    return [r.telemetry for r in results]


@pytest.mark.parametrize("plain_mean", [True, False], ids=["mean", "LossSum"])
def test_the_noise_scale_matches_linear_regression_within_ten_percent(plain_mean: bool) -> None:
    truth = _truth(1.0, 1.0)  # 17
    telemetry = _run(1.0, steps=600, plain_mean=plain_mean)
    trace = statistics.fmean(t.step_trace for t in telemetry)
    grad_sq = statistics.fmean(t.step_grad_sq for t in telemetry)
    assert trace / grad_sq == pytest.approx(truth, rel=0.10)
    assert grad_sq == pytest.approx(1.0, rel=0.10)  # |G|² = |δ|²
    assert trace == pytest.approx(D * 2 + 1, rel=0.10)
    # The smoothed value each step reports: within 10% on average over the later steps.
    smoothed = [t.noise_scale for t in telemetry[150:]]
    assert all(s is not None for s in smoothed)
    assert statistics.fmean(smoothed) == pytest.approx(truth, rel=0.10)
    # Single steps are noisy (that is why they are smoothed): the test is not trivially tight.
    assert statistics.pstdev(t.step_grad_sq for t in telemetry) > 0.1


def test_negative_control_the_estimate_tells_noise_levels_apart() -> None:
    """σ² = 4 gives B_simple = 41: the σ² = 1 estimate must not pass for it."""
    telemetry = _run(1.0, steps=200)
    estimate = statistics.fmean(t.step_trace for t in telemetry) / statistics.fmean(
        t.step_grad_sq for t in telemetry
    )
    assert estimate != pytest.approx(_truth(1.0, 4.0), rel=0.10)
    louder = _run(4.0, steps=200)
    loud = statistics.fmean(t.step_trace for t in louder) / statistics.fmean(
        t.step_grad_sq for t in louder
    )
    assert loud == pytest.approx(_truth(1.0, 4.0), rel=0.15)


def test_throughput_size_and_memory_are_reported() -> None:
    telemetry = _run(1.0, steps=2)
    assert all(t.items_per_second > 0 for t in telemetry)
    assert all(t.micro_batch_size == 8 for t in telemetry)
    assert all(t.peak_memory_bytes is None for t in telemetry)  # CPU reports none
    meter = TelemetryMeter(device=torch.device("cuda"), peak_memory=lambda device: 123_456)
    meter.open_window()
    assert meter.close(True, 64, 1.0, False, 8).peak_memory_bytes == 123_456


def test_a_window_of_one_micro_batch_has_no_noise_estimate() -> None:
    telemetry = _run(1.0, steps=3, micro=128)
    assert all(t.step_trace is None and t.noise_scale is None for t in telemetry)


def test_telemetry_is_off_by_default_and_costs_nothing() -> None:
    model = torch.nn.Linear(3, 1)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2)
    result = acc.step(
        (torch.randn(4, 3), torch.randn(4, 1)),
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
    )
    assert result.telemetry is None
    assert acc._engine.telemetry is None  # no meter: no norm, no clock, nothing per window


def test_state_round_trip_keeps_the_averages() -> None:
    meter = TelemetryMeter(decay=0.5)
    meter.observe(3.0, 4, 1.0, 16)
    twin = TelemetryMeter(decay=0.5)
    twin.load_state_dict(meter.state_dict())
    assert (twin.trace, twin.grad_sq, twin.noise_scale()) == (
        meter.trace,
        meter.grad_sq,
        meter.noise_scale(),
    )


def test_a_first_micro_batch_that_counts_nothing_does_not_lose_the_estimate() -> None:
    """Token losses: a first micro-batch whose labels are all ignored adds nothing to the
    gradient, so the small-batch gradient is read after the first micro-batch that counts."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    x = torch.randn(12, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (12,))
    y[:4] = -100  # the first micro-batch of 4 counts no item

    def loss(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
        summed = F.cross_entropy(m(batch[0]), batch[1], ignore_index=-100, reduction="sum")
        return LossSum(summed, (batch[1] != -100).sum())

    def grad_sq(rows: slice) -> float:
        probe = copy.deepcopy(model)
        value = loss(probe, (x[rows], y[rows]))
        (value.value / value.count).backward()
        return sum(float(p.grad.pow(2).sum()) for p in probe.parameters())

    small_sq, big_sq = grad_sq(slice(4, 8)), grad_sq(slice(0, 12))  # b=4 (items 4-7), B=8
    expected_trace = (small_sq - big_sq) / (1 / 4 - 1 / 8)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), micro_batch_size=4,
                      telemetry=True)  # fmt: skip
    telemetry = acc.step((x, y), loss).telemetry
    assert telemetry is not None
    assert telemetry.step_trace == pytest.approx(expected_trace, rel=1e-9)
    # NEGATIVE CONTROL: micro-batches 2 and 3 together (b=8 = B) would give no estimate at all,
    # and the full batch's gradient is not the small one.
    assert abs(small_sq - big_sq) > 1e-6 * big_sq


def test_items_per_second_after_a_mid_window_resume_counts_only_this_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A window loaded half done: its items per second are the items run since the load."""
    clock = [100.0]
    monkeypatch.setattr("gradaccum.telemetry.time.perf_counter", lambda: clock[0])

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        clock[0] += 1.0  # each micro-batch of 10 items takes one second
        return F.mse_loss(model(batch[0]), batch[1])

    def build() -> Accumulator:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return Accumulator(model, opt, accumulation_steps=4, telemetry=True)

    batches = [(torch.randn(10, 3), torch.randn(10, 1)) for _ in range(4)]
    whole = build()
    for batch in batches:
        result = whole.micro_step(batch, loss_fn)
    assert result.telemetry is not None
    assert result.telemetry.items_per_second == pytest.approx(10.0)  # 40 items in 4 s
    first = build()
    for batch in batches[:2]:
        first.micro_step(batch, loss_fn)
    state = first.state_dict()
    clock[0] += 1000.0  # the process restarts later
    resumed = build()
    resumed.load_state_dict(state)
    for batch in batches[2:]:
        result = resumed.micro_step(batch, loss_fn)
    assert result.stepped
    assert result.count == 40  # the window's count is still the whole window's
    assert result.telemetry is not None
    # 20 items ran in the 2 s since the load (before: 40 / 2 s = 20, twice the real rate).
    assert result.telemetry.items_per_second == pytest.approx(10.0)
    for batch in batches:  # the next window counts all of its items again
        result = resumed.micro_step(batch, loss_fn)
    assert result.telemetry is not None
    assert result.telemetry.items_per_second == pytest.approx(10.0)
