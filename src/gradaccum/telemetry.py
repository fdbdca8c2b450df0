"""Opt-in telemetry per optimizer step: the gradient noise scale, throughput and memory.

`Accumulator(..., telemetry=True)` puts a `Telemetry` on every stepped `StepResult`:

- **the gradient noise scale** `B_simple = tr(Σ) / |G|²` (McCandlish et al., 2018, "An Empirical
  Model of Large-Batch Training", appendix A.1): the batch size above which a larger batch
  stops paying for itself. Its cheap unbiased estimator needs the squared norm of a mean gradient
  at two batch sizes. Accumulation has both for free: after the window's first micro-batch that
  counts an item (earlier ones, whose labels were all ignored, add nothing) the accumulated
  gradient is that micro-batch's (`b` items), and at the boundary it is the window's
  (`B` items, all ranks). With `|g_b|²` and `|g_B|²`:

      |G|²  ≈ (B |g_B|² - b |g_b|²) / (B - b)        tr(Σ) ≈ (|g_b|² - |g_B|²) / (1/b - 1/B)

  Each step's estimates are unbiased but noisy (either may be negative), so, as the paper
  advises, each is smoothed over steps (a bias-corrected exponential average) before the ratio
  is taken. Validated in `tests/test_telemetry.py` on linear regression with Gaussian noise,
  whose noise scale is known in closed form.
- **items per second** of the window (wall time from its first micro-batch to its boundary);
- **the micro-batch size** and, where the device reports it, **peak allocated memory**.

Cost: off (the default), nothing at all. On, one fused norm of the gradients after each window's
first micro-batch (read at the boundary, so no extra device synchronization) and a few floats.
A window with one micro-batch on one process (b = B), a `LossSum.terms` window, or an FSDP2
model (whose gradients only exist after the reduce-scatter) has no noise-scale estimate.

Example:
    >>> meter = TelemetryMeter(decay=0.0)
    >>> meter.observe(small_sq=2.0, small=4, big_sq=0.5, big=16)  # |g_b|² at b=4, |g_B|² at B=16
    >>> meter.grad_sq, meter.trace
    (0.0, 8.0)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum import _compat
from gradaccum.norms import total_norm

__all__ = ["Telemetry", "TelemetryMeter"]


@dataclass(frozen=True)
class Telemetry:
    """What one optimizer step measured (`StepResult.telemetry`).

    Attributes:
        noise_scale: `B_simple`, from the smoothed estimates; None until both are positive.
        trace: The smoothed estimate of tr(Σ), the per-item gradient variance summed.
        grad_sq: The smoothed estimate of |G|², the true gradient's squared norm.
        step_trace: This step's own (unsmoothed) estimate of tr(Σ); None without one.
        step_grad_sq: This step's own estimate of |G|²; None without one.
        items_per_second: Items counted per second of wall time, over the window.
        micro_batch_size: Items per micro-batch (the largest when streaming).
        peak_memory_bytes: The device's peak allocated memory so far; None on CPU.
    """

    noise_scale: float | None
    trace: float | None
    grad_sq: float | None
    step_trace: float | None
    step_grad_sq: float | None
    items_per_second: float
    micro_batch_size: int
    peak_memory_bytes: int | None


class TelemetryMeter:
    """Accumulates the noise-scale estimates over steps and times windows.

    Args:
        decay: Weight of the past in the exponential averages (0 keeps only the last step).
        device: The model's device, for its peak memory (CPU reports none).
        peak_memory: Reads a device's peak allocated bytes (a fake in tests).
    """

    def __init__(
        self,
        decay: float = 0.95,
        device: torch.device | None = None,
        peak_memory: Callable[[torch.device], int] | None = None,
    ) -> None:
        self.decay, self.device = decay, device
        self._peak_memory = peak_memory or _peak_allocated
        self.steps = 0
        self._trace = 0.0  # exponential averages, before the bias correction
        self._grad_sq = 0.0
        self.step_trace: float | None = None
        self.step_grad_sq: float | None = None
        self._small: tuple[torch.Tensor, int, float] | None = None  # |raw|², items, scale
        self._started: float | None = None
        self._resumed = 0  # items a loaded window counted before this process's clock started

    @property
    def trace(self) -> float | None:
        """The smoothed tr(Σ) estimate (None before any step had one)."""
        return self._corrected(self._trace)

    @property
    def grad_sq(self) -> float | None:
        """The smoothed |G|² estimate (None before any step had one)."""
        return self._corrected(self._grad_sq)

    def _corrected(self, value: float) -> float | None:
        if not self.steps:
            return None
        return value / (1 - self.decay**self.steps)

    def open_window(self) -> None:
        """A window starts: its clock starts, and its first micro-batch is still to come."""
        self._started = time.perf_counter()
        self._small, self._resumed = None, 0

    def forget_window(self) -> None:
        """The window was forgotten (failed, skipped, dropped): its first measurement goes too."""
        self._small = None

    def first_micro_batch(self, grads: Sequence[torch.Tensor], items: int, scale: float) -> None:
        """The accumulated gradients after the window's first micro-batch of `items` counted.

        `scale` turns them into that micro-batch's mean gradient (`denominator / (loss_scale *
        items)`, see `gradaccum.divisor`). The norm stays on the device until the boundary.
        """
        if grads and items > 0:
            self._small = (total_norm(list(grads)).double().square(), items, scale)

    def close(
        self,
        stepped: bool,
        count: int,
        grad_norm: float | None,
        summed: bool,
        micro_batch: int,
        local_count: int | None = None,
    ) -> Telemetry:
        """The boundary of a window of `count` items, whose gradient's norm was `grad_norm`.

        `summed`: the gradient was the sum over items (`normalize="sum"`), not their mean;
        `micro_batch`: the items of the window's largest micro-batch; `local_count`: the items
        this rank counted (of `count`, over all ranks), for a window resumed mid-way, whose
        items counted before the load are not this process's throughput.
        """
        seconds = time.perf_counter() - (self._started or time.perf_counter())
        self.step_trace = self.step_grad_sq = None
        small, self._small, self._started = self._small, None, None
        processed = float(count)
        if self._resumed and local_count:  # a resumed window: only what ran since the load
            processed = count * max(local_count - self._resumed, 0) / local_count
        self._resumed = 0
        if stepped and small is not None and grad_norm is not None and count > 0:
            mean_norm = grad_norm / count if summed else grad_norm
            raw_sq, items, scale = small
            self.observe(float(raw_sq) * scale * scale, items, mean_norm**2, count)
        return Telemetry(
            noise_scale=self.noise_scale(),
            trace=self.trace,
            grad_sq=self.grad_sq,
            step_trace=self.step_trace,
            step_grad_sq=self.step_grad_sq,
            items_per_second=processed / seconds if seconds > 0 else 0.0,
            micro_batch_size=micro_batch,
            peak_memory_bytes=self._peak(),
        )

    def _peak(self) -> int | None:
        if self.device is None or self.device.type == "cpu":
            return None
        return self._peak_memory(self.device)

    def observe(self, small_sq: float, small: int, big_sq: float, big: int) -> None:
        """One step's mean-gradient squared norms at `small` and `big` items: update."""
        if big <= small:
            return
        self.step_grad_sq = (big * big_sq - small * small_sq) / (big - small)
        self.step_trace = (small_sq - big_sq) / (1 / small - 1 / big)
        self.steps += 1
        self._trace = self.decay * self._trace + (1 - self.decay) * self.step_trace
        self._grad_sq = self.decay * self._grad_sq + (1 - self.decay) * self.step_grad_sq

    def noise_scale(self) -> float | None:
        """`B_simple` from the smoothed estimates; None until both are positive."""
        trace, grad_sq = self.trace, self.grad_sq
        if trace is None or grad_sq is None or trace <= 0 or grad_sq <= 0:
            return None
        return trace / grad_sq

    def state_dict(self) -> dict[str, Any]:
        """The averages, and an open window's first micro-batch measurement (exact resume)."""
        small = None
        if self._small is not None:
            raw_sq, items, scale = self._small
            small = [float(raw_sq), items, scale]
        return {"steps": self.steps, "trace": self._trace, "grad_sq": self._grad_sq, "small": small}

    def load_state_dict(self, state: dict[str, Any], resumed_items: int = 0) -> None:
        """Restore `state_dict()` output (the resumed window's clock starts again).

        `resumed_items`: the items the loaded window had counted on this rank; its items per
        second count only the items processed after the load.
        """
        self.steps = int(state["steps"])
        self._trace, self._grad_sq = float(state["trace"]), float(state["grad_sq"])
        small = state.get("small")
        self._small = None
        if small is not None:
            self._small = (
                torch.tensor(float(small[0]), dtype=torch.float64),
                int(small[1]),
                float(small[2]),
            )
        self._started, self._resumed = time.perf_counter(), int(resumed_items)


def _peak_allocated(device: torch.device) -> int | None:
    """The accelerator's peak allocated bytes since the process started (or the user's reset)."""
    return _compat.max_memory_allocated(device)
