"""The fastest micro-batch size that fits: timed on real windows, decided with hysteresis.

Because every split of a window gives the same step, the micro-batch size is a pure speed knob
(train-mode BatchNorm aside, whose batch is the micro-batch: see docs/memory.md).
`ThroughputTuner` times a few candidates, one real window each, and keeps the one with the most
items per second:

- the candidates are the largest size that fits and the powers of two below it, at most
  `MAX_CANDIDATES` of them (largest first), never more than a window holds;
- the first timed window is a warm-up and does not count (allocator, lazy initialization);
- each candidate is timed `ROUNDS` times, interleaved, and its best (fastest) window kept: a
  size's first windows pay for memory touched the first time, and noise only ever slows a window;
- under DDP the ranks agree by taking, for each candidate, the slowest rank's time (one
  all-reduce), so every rank picks the same size;
- hysteresis: a candidate replaces the incumbent (the largest that fits, or the previous choice)
  only if it is at least `MARGIN` faster, so timing noise cannot make the choice flip-flop;
- when the work per item changes a lot (`SHAPE_CHANGE`x, e.g. longer sequences), the candidates are
  timed again, also midway through a timing (so one decision compares windows of one shape), at
  most `MAX_RESTARTS` times per timing, so shapes that never settle cannot keep it timing forever
  (after that, windows of other shapes run at the incumbent, untimed: no decision mixes shapes);
- each decision is remembered with the shape it was timed at: a window of a shape decided before
  runs at that shape's choice, untimed (also in the middle of timing another shape), so data whose
  lengths vary (padded batches of short and long sequences) is timed once per shape, not forever.

Example:
    >>> times = {64: 1.0, 32: 0.5, 16: 0.6, 8: 0.9}  # seconds per window of 64 items
    >>> tuner = ThroughputTuner(fits=64, window_items=64)
    >>> while tuner.tuning:
    ...     size = tuner.next_size()
    ...     tuner.record(size, items=64, seconds=times[size])
    >>> tuner.chosen, tuner.reason
    (32, 'fastest: 32 at 128 items/s, 2.00x the largest that fits (64 at 64 items/s)')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "MARGIN",
    "MAX_CANDIDATES",
    "MAX_RESTARTS",
    "PATIENCE",
    "ROUNDS",
    "SHAPE_CHANGE",
    "ThroughputTuner",
    "candidates",
]

MAX_CANDIDATES = 4
MAX_RESTARTS = 2  # shape changes that may start one timing over before it just finishes
PATIENCE = 16  # then windows of other shapes in a row before the shape timed is given up
ROUNDS = 2
MARGIN = 0.05
SHAPE_CHANGE = 2.0

AgreeFn = Callable[[list[float]], list[float]]


def candidates(fits: int, window_items: int) -> list[int]:
    """The sizes to time: the largest that fits a window, then powers of two below it.

    Example:
        >>> candidates(100, 256), candidates(64, 40), candidates(1, 8)
        ([100, 64, 32, 16], [40, 32, 16, 8], [1])
    """
    top = max(1, min(fits, window_items))
    sizes = [top]
    power = 1 << (top.bit_length() - 1)
    if power == top:
        power //= 2
    while power >= 1 and len(sizes) < MAX_CANDIDATES:
        sizes.append(power)
        power //= 2
    return sizes


class ThroughputTuner:
    """Times candidate micro-batch sizes on real windows and keeps the fastest.

    Args:
        fits: The largest micro-batch size that fits the memory budget.
        window_items: Items per window (sizes above it run the same window).
        agree: Combines every rank's seconds per candidate (the slowest rank's); the identity
            on one process.
    """

    def __init__(self, fits: int, window_items: int, agree: AgreeFn | None = None) -> None:
        self._agree = agree or list
        self.fits = fits
        self.chosen: int | None = None  # None while tuning
        self.incumbent = min(fits, window_items)
        self.reason = "timing the candidates"
        self.rates: dict[int, float] = {}  # items per second of each candidate, once decided
        self.work: float | None = None  # work per item of the windows timed
        self.restarts = 0  # timings started over midway by a shape change, since the last choice
        self.decisions: list[dict[str, Any]] = []  # per shape decided: work, chosen, reason, rates
        self._untimed: tuple[int, str] | None = None  # a window of another shape: size, why
        self._away = 0  # windows in a row of another shape than the one being timed
        self.adopted = False  # the last `observe` took back a shape's earlier decision
        self._start(window_items)

    def _start(self, window_items: int) -> None:
        self.window_items = window_items
        self.sizes = candidates(self.fits, window_items)
        self._order = [size for _ in range(ROUNDS) for size in self.sizes]
        self._seconds: dict[int, list[float]] = {size: [] for size in self.sizes}
        self._warm = False
        self.chosen = None
        self.reason = f"timing {len(self.sizes)} candidates {self.sizes}"

    @property
    def tuning(self) -> bool:
        """Whether windows are still being timed."""
        return self.chosen is None

    def next_size(self) -> int:
        """The size the next window runs at."""
        if self.chosen is not None:
            return self.chosen
        if self._untimed is not None:  # a window of another shape than the one being timed
            return min(self._untimed[0], self.fits)
        if not self._warm:
            return self.incumbent
        return self._order[0]

    def note(self) -> str:
        """What the next window runs at, and why (for `StepResult.sizing`)."""
        if self.chosen is not None:
            return f"auto {self.chosen}: {self.reason}"
        if self._untimed is not None:
            return (
                f"auto {self.next_size()}: {self._untimed[1]}, untimed (meanwhile "
                f"{self.reason} on windows of another shape)"
            )
        if not self._warm:
            return f"auto {self.incumbent}: warm-up before {self.reason}"
        done = len(self.sizes) * ROUNDS - len(self._order) + 1
        return f"auto {self._order[0]}: {self.reason}, window {done} of {len(self.sizes) * ROUNDS}"

    def record(self, size: int, *, items: int, seconds: float) -> None:
        """The window at `size` took `seconds` for `items` items (synchronized wall time)."""
        if self.chosen is not None or self._untimed is not None:
            return  # decided, or a window of another shape than the one being timed
        if not self._warm:
            self._warm = True
            return
        if not self._order or size != self._order[0]:
            return  # not the window we asked for (an out-of-memory rerun): time it again
        self._order.pop(0)
        self._seconds[size].append(seconds / max(items, 1))
        if not self._order:
            self._decide()

    def _decide(self) -> None:
        per_item = [min(self._seconds[size]) for size in self.sizes]
        agreed = self._agree(per_item)  # the slowest rank's, so every rank decides alike
        self.rates = {size: 1.0 / max(t, 1e-12) for size, t in zip(self.sizes, agreed, strict=True)}
        best = max(self.sizes, key=lambda size: self.rates[size])
        incumbent = self.incumbent if self.incumbent in self.rates else self.sizes[0]
        base = self.rates[incumbent]
        if best != incumbent and self.rates[best] < base * (1 + MARGIN):
            best = incumbent  # within the noise: keep what runs now
        label = "the largest that fits" if incumbent == self.sizes[0] else "the previous choice"
        if best == incumbent:
            self.reason = (
                f"kept {incumbent} at {base:.0f} items/s: no candidate was {MARGIN:.0%} faster "
                f"({self._listing()})"
            )
        else:
            self.reason = (
                f"fastest: {best} at {self.rates[best]:.0f} items/s, "
                f"{self.rates[best] / base:.2f}x {label} ({incumbent} at {base:.0f} items/s)"
            )
        self.chosen = self.incumbent = best
        self._remember()

    def _remember(self) -> None:
        """Keep this decision for its shape, replacing one made for the same shape."""
        if self.work is None or self.work <= 0:
            return  # no measurable shape: the decision stands for every window anyway
        self.decisions = [d for d in self.decisions if not _same_shape(d["work"], self.work)]
        self.decisions.append(
            {
                "work": self.work,
                "chosen": self.chosen,
                "reason": self.reason,
                "rates": self.rates,
                "fits": None,  # set when this shape runs out of memory after the decision
            }
        )

    def shape_fits(self) -> int | None:
        """The largest size known to fit the current shape since it ran out of memory, if it did."""
        decided = None if self.work is None or self.work <= 0 else self._decided(self.work)
        return None if decided is None else decided["fits"]

    def ran(self, size: int, *, out_of_memory: bool) -> None:
        """Record what fits the current shape, for when its decision is taken back later.

        Args:
            size: A size that ran clean, or the size shrunk to after running out of memory.
            out_of_memory: Which of the two.
        """
        decided = None if self.work is None or self.work <= 0 else self._decided(self.work)
        if decided is None or (decided["fits"] is None and not out_of_memory):
            return
        if out_of_memory:
            decided["fits"] = min(size, decided["fits"] or size)
        else:
            decided["fits"] = max(size, decided["fits"])

    def _decided(self, work: float) -> dict[str, Any] | None:
        """The decision for items of `work` (the nearest shape decided within SHAPE_CHANGE)."""
        near = [d for d in self.decisions if _same_shape(d["work"], work)]
        return min(near, key=lambda d: abs(math.log(d["work"] / work)), default=None)

    def _listing(self) -> str:
        return ", ".join(f"{size}: {self.rates[size]:.0f}" for size in self.sizes)

    def limit(self, fits: int) -> None:
        """Sizes above `fits` ran out of memory: drop them, and time again if tuning."""
        self.fits = max(1, fits)
        self.incumbent = min(self.incumbent, self.fits)
        if self.chosen is not None and self.chosen > self.fits:
            self.chosen = self.incumbent = self.fits
        if self.chosen is None:
            self._start(self.window_items)

    def observe(self, window_items: int, work_per_item: float) -> bool:
        """Time again when the work per item moved `SHAPE_CHANGE`x since timing; True if so.

        Also while timing: one decision compares windows of one shape, so timing starts over
        at the new shape, and the shape timed is what later windows are compared with.
        A shape decided before is not timed again: its choice is taken back (or, in the middle
        of timing another shape, this one window runs at it, untimed). Once `MAX_RESTARTS`
        shape changes restarted one timing, windows of other shapes run at the incumbent,
        untimed, unless the shape timed stays away for `PATIENCE` windows in a row.
        `work_per_item` is any measure proportional to an item's cost (its tensor elements).
        """
        self._untimed, self.adopted = None, False
        if self.work is None or self.work <= 0 or work_per_item <= 0:
            self.work = work_per_item  # 0: nothing measurable (no tensor), so no shape to change
            return False
        if _same_shape(work_per_item, self.work):
            self._away = 0
            return False
        decided = self._decided(work_per_item)
        if decided is not None and self.chosen is None:  # timing goes on at its own shape
            self._untimed = (int(decided["chosen"]), "chosen before for items of this shape")
            return False
        if decided is not None:
            self.work, self.reason = float(decided["work"]), str(decided["reason"])
            self.chosen = self.incumbent = min(int(decided["chosen"]), self.fits)
            self.rates = dict(decided["rates"])
            if self.chosen < decided["chosen"]:  # a larger size ran out of memory since
                self.reason = (
                    f"{self.chosen}, the largest that fits since a larger size ran out of "
                    f"memory (for this shape before: {self.reason})"
                )
            self.adopted = True
            return False
        if self.chosen is None and self.restarts >= MAX_RESTARTS:
            self._away += 1  # shapes that never settle: finish this timing, on its shape only
            if self._away <= PATIENCE:
                self._untimed = (self.incumbent, "items of a shape not timed yet")
                return False
        self.restarts = min(self.restarts + 1, MAX_RESTARTS) if self.chosen is None else 0
        self.work, self._away = work_per_item, 0
        self._start(max(window_items, self.window_items))  # a short batch keeps the candidates
        return True

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the decision and the timing still to do."""
        return {
            "fits": self.fits,
            "window_items": self.window_items,
            "chosen": self.chosen,
            "incumbent": self.incumbent,
            "reason": self.reason,
            "work": self.work,
            "rates": _plain_rates(self.rates),
            "decisions": [{**d, "rates": _plain_rates(d["rates"])} for d in self.decisions],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a decision; timing still in progress starts over (times do not carry)."""
        self.fits = int(state["fits"])
        self.incumbent = int(state["incumbent"])
        self.work = state["work"]
        self._start(int(state["window_items"]))
        if state["chosen"] is not None:
            self.chosen = int(state["chosen"])
            self.reason = str(state["reason"])
            self.rates = _rates(state["rates"])
        self.decisions = [
            {
                "work": float(d["work"]),
                "chosen": int(d["chosen"]),
                "reason": str(d["reason"]),
                "rates": _rates(d["rates"]),
                "fits": None if d.get("fits") is None else int(d["fits"]),
            }
            for d in state.get("decisions", [])  # absent from states saved before
        ]


def _same_shape(work: float, other: float) -> bool:
    """Whether two works per item are less than `SHAPE_CHANGE`x apart (one shape, for timing)."""
    return 1 / SHAPE_CHANGE < work / other < SHAPE_CHANGE


def _plain_rates(rates: dict[int, float]) -> dict[str, float]:
    return {str(size): rate for size, rate in rates.items()}


def _rates(plain: dict[str, Any]) -> dict[int, float]:
    return {int(size): float(rate) for size, rate in plain.items()}
