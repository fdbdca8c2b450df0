"""`micro_batch_size="auto"`: plan on the first batch, run the fastest size, survive out of memory.

`"auto"` plans the largest size that fits the memory budget on the first batch (again on a larger
batch, if the plan took every item of its own and nothing ran out of memory), then times a
few sizes up to it on real windows and keeps the fastest (`gradaccum._tuner`); `"largest"` keeps
the largest that fits. Every split gives the same step, so the choice changes speed only (the
floating-point rounding may differ in the last bits between splits).

A window that runs out of memory at any micro-batch is rerun whole at a smaller size: its partial
gradients and counts are dropped, the random number generators and BatchNorm statistics are put
back as they were at the window's start, and cached device memory is released. So nothing is
counted twice, and the parameters end bitwise equal to a run that used the smaller size from the
start. Under DDP every micro-batch of an auto-sized window defers its gradient reduction; before
the boundary the ranks all-reduce an out-of-memory flag, so all of them rerun together and agree
on the new size, then the gradients are reduced once, by hand.

Sizes shrink to 3/4 (at least by one) per failure; at size 1 a failure raises
`MemoryBudgetError`. After `regrow_after` clean windows the size grows by a third toward the plan
again; a grown size that fails doubles the wait before the next try.

Example:
    >>> import torch
    >>> from gradaccum import Accumulator
    >>> model = torch.nn.Linear(8, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> acc = Accumulator(model, opt, micro_batch_size="auto", memory_budget="64MiB")
    >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> acc.step((torch.randn(32, 8), torch.randn(32, 1)), mse).micro_batch_size
    32
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

import torch

from gradaccum import _compat
from gradaccum._coupled_sizes import SplitCoupled, sizing_note
from gradaccum._loss_call import refuse_grad_disabled
from gradaccum._oom import (
    MemoryBudgetError,
    is_out_of_memory,
    release_cached_memory,
    rng_states,
    set_rng_states,
)
from gradaccum._rng_state import held_generators
from gradaccum._tuner import ThroughputTuner
from gradaccum.batching import batch_size, map_tensors
from gradaccum.memory import parse_bytes
from gradaccum.options import AutoSize, Precision, SyncPolicy
from gradaccum.sizing import MemoryPlan, format_bytes, plan_micro_batch, resolve_budget
from gradaccum.sync import all_ranks_max, all_ranks_min

__all__ = ["AutoSizer", "is_auto"]

R = TypeVar("R")


def is_auto(micro_batch_size: object, memory_budget: object) -> bool:
    """Whether an Accumulator sizes its micro-batches itself; raise on a half-given setting.

    Raises:
        ValueError: For a string other than "auto" or "largest", or a budget without either.
    """
    auto = micro_batch_size in {mode.value for mode in AutoSize}
    if isinstance(micro_batch_size, str) and not auto:
        raise ValueError(
            f"micro_batch_size={micro_batch_size!r} is not known; pass a positive int, 'auto' "
            "(the fastest size that fits memory_budget) or 'largest' (the largest that fits)."
        )
    if memory_budget is not None and not auto:
        raise ValueError(
            f"memory_budget={memory_budget!r} is only used by micro_batch_size='auto' or "
            "'largest'; pass both, or neither."
        )
    return auto


class AutoSizer:
    """The automatic micro-batch size of one Accumulator: its plan, shrinks and regrowth.

    Args:
        memory_budget: Bytes or a string such as `"2GiB"`; None on CUDA means free memory.
        device: The model's device (a budget is required off CUDA).
        regrow_after: Clean windows after a shrink before trying a larger size; None: never.
        mode: `AutoSize.FASTEST` ("auto") times sizes; `AutoSize.LARGEST` does not.
        clock: Seconds, for timing windows (a fake in tests).
        policy: FSDP2's sync policy, which sets what gradients a rank holds (the plan's).
        dim: The items' dimension of the batches (`Accumulator(batch_dim=)`).
    """

    def __init__(
        self,
        memory_budget: int | str | None,
        device: torch.device,
        regrow_after: int | None,
        mode: AutoSize = AutoSize.FASTEST,
        clock: Callable[[], float] = time.perf_counter,
        policy: SyncPolicy = SyncPolicy.WINDOW,
        dim: int = 0,
    ) -> None:
        if device.type != "cuda":
            resolve_budget(memory_budget, device)  # fail at construction, not at the first step
        if regrow_after is not None and (
            isinstance(regrow_after, bool) or not isinstance(regrow_after, int) or regrow_after < 1
        ):
            raise ValueError(f"regrow_after={regrow_after!r} must be a positive int or None.")
        self.memory_budget = memory_budget
        self.regrow_after = regrow_after
        self.plan: MemoryPlan | None = None
        self.planned: int | None = None  # the size the plan chose (agreed over ranks)
        self.size: int | None = None  # the size the next window runs at
        self.clean_windows = 0
        self.wait = regrow_after  # clean windows before the next regrowth (doubles on failure)
        self.growing = False  # the current size is a regrowth not yet proven
        self.out_of_memory_events = 0
        self.device, self.mode, self.clock, self.policy = device, mode, clock, policy
        self.dim = dim
        self.tuner: ThroughputTuner | None = None  # made with the plan, in "auto" mode
        self.timing = False  # the window running is timed (`gradaccum._coupled_sizes`)
        self.capped = False  # the plan took every item of its batch: a larger one plans again
        self._model: torch.nn.Module | None = None
        self._generators: list[torch.Generator] = []

    def ensure_plan(
        self,
        model: torch.nn.Module,
        batch: Any,
        loss_fn: Callable[[torch.nn.Module, Any], object],
        optimizer: torch.optim.Optimizer,
        *,
        precision: Precision,
        accum_dtype: torch.dtype | None,
    ) -> int:
        """Plan on the first batch (every rank takes the smallest rank's size); the size to run.

        A plan capped by its batch (every item fitted) is made again on a larger batch, so a
        small first batch does not cap the size for good; an out-of-memory shrink ends this.
        """
        refuse_grad_disabled("step()")  # before the planner runs loss_fn
        replan = self.size is None
        if self.capped and not self.out_of_memory_events:
            assert self.planned is not None
            items = batch_size(batch, batch_dim=self.dim, allow_empty=True)  # 0: never larger
            if all_ranks_min(model, items) > self.planned:
                replan = True  # a larger batch: plan on it (planning that raises changes nothing)
        if replan:
            plan = plan_micro_batch(
                model,
                batch,
                loss_fn,
                optimizer,
                memory_budget=self.memory_budget,
                precision=precision,
                accum_dtype=accum_dtype,
                sync_policy=self.policy,
                batch_dim=self.dim,
            )
            self.plan = plan
            self.planned = self.size = all_ranks_min(model, plan.micro_batch_size)
            self.capped = self.planned >= all_ranks_min(model, plan.batch_size)
            self.tuner = None  # time the sizes up to the new plan's
        if model is not self._model:  # a rerun rewinds the model's own generators too
            self._generators = held_generators(model)
        self._model = model  # also after load_state_dict, which restores a size but no model
        assert self.size is not None
        return self.size

    def _agree(self, seconds: list[float]) -> list[float]:
        assert self._model is not None
        return all_ranks_max(self._model, seconds)

    def run(
        self,
        batch: Any,
        items: int,
        attempt: Callable[[int, str | None], R],
        coupled_by: list[str] | None = None,
    ) -> R:
        """Run one window with `attempt(size, note)`; rerun it whole and smaller on OOM.

        In "auto" mode the window is timed (after the device finishes) for the tuner; `note`
        says what the window runs at and why (`StepResult.sizing`). `coupled_by`: why a smaller size
        would change the step (`gradaccum._coupled_sizes`): then, on any rank, the window runs at
        the largest size that fits, untimed.

        Raises:
            MemoryBudgetError: If even size 1 runs out of memory; the sizer is then as it was
                before the window (a retry after memory was freed runs at the same size).
        """
        tuner, tried, coupled = self.tuner, [], None
        if self.mode is AutoSize.FASTEST:
            # Ranks time alike: the same candidates, restarted on the same windows (DDP).
            mine = [_work_per_item(batch, items), float(items), float(bool(coupled_by))]
            work, most, any_coupled = self._agree(mine)
            if any_coupled:  # the split changes the step: no timing, the plan's size
                coupled, tuner = self._untimed(coupled_by), None
            elif tuner is None:
                assert self.planned is not None
                tuner = self.tuner = ThroughputTuner(self.planned, int(most), self._agree)
            if tuner is not None:
                tuner.observe(int(most), work)
            if tuner is not None and tuner.adopted:  # a shape decided before: its choice,
                assert tuner.chosen is not None  # below what ran out of memory
                fits = tuner.shape_fits()
                self.size = tuner.chosen if fits is None else min(tuner.chosen, fits)
                self.clean_windows, self.growing = 0, False
        while True:
            timing = self.timing = tuner is not None and tuner.tuning
            size = tuner.next_size() if tuner is not None and timing else self.size
            assert size is not None
            tried.append(size)
            # Only a rerun rewinds them: a skipped window draws on.
            rng = rng_states(self.device, self._generators)
            start = self.clock()
            try:
                result = attempt(size, sizing_note(tuner, size, tried, items, coupled))
            except SplitCoupled as split:  # warned to couple rows, and forgotten: rerun whole
                set_rng_states(self.device, rng)
                coupled, tuner, tried[-1:] = self._untimed(split.reasons), None, []
                continue
            except BaseException as error:
                if not is_out_of_memory(error):
                    raise
                set_rng_states(self.device, rng)  # the rerun draws the same dropout masks
                release_cached_memory(self.device)
                if len(tried) == 1:  # what the sizer was before this window, should it give up
                    before = self.state_dict()
                self.size = size
                try:
                    self.shrink(tried)
                except MemoryBudgetError as budget_error:
                    self.load_state_dict(before)  # nothing changed: the next window as before
                    raise budget_error from error
                if tuner is not None and timing:
                    tuner.limit(self.size)  # time again, below what ran out of memory
                elif tuner is not None:
                    tuner.ran(self.size, out_of_memory=True)  # for this shape's next turn
                continue
            if tuner is not None and timing:
                _synchronize(self.device)
                tuner.record(size, items=items, seconds=self.clock() - start)
                if not tuner.tuning:
                    self.size = tuner.chosen
                return result
            self.window_done()
            return result

    def _untimed(self, coupled_by: list[str] | None) -> list[str]:
        """No timing: sizes timed before (a split changes the step since) go; the plan's size."""
        self.size, self.tuner = self.untimed_size(), None
        return coupled_by or ["the split changes the step on another rank"]

    def untimed_size(self) -> int:
        """The size a window runs at untimed: the plan's (after out of memory, the shrunk one)."""
        size = (
            self.planned if self.tuner is not None and not self.out_of_memory_events else self.size
        )
        assert size is not None
        return size

    def _target(self) -> int | None:
        """What a shrunk size grows back to: the tuner's choice, else the plan's size."""
        if self.tuner is not None and self.tuner.chosen is not None:
            return self.tuner.chosen
        return self.planned

    def shrink(self, tried: list[int]) -> None:
        """After an out-of-memory window: a smaller size, or give up at size 1."""
        assert self.size is not None
        self.out_of_memory_events += 1
        if self.size == 1:
            budget = "free device memory" if self.memory_budget is None else self.memory_budget
            raise MemoryBudgetError(
                f"out of memory even at micro_batch_size=1 (sizes tried this window: {tried}; "
                f"memory_budget={budget}, plan: {self._planned_text()}). The model, gradients "
                "and optimizer state leave no room: use precision='bf16', a smaller model, or "
                "more memory."
            )
        if self.growing and self.wait is not None:
            self.wait *= 2  # the regrowth failed: wait longer before the next one
        self.growing = False
        self.size = max(1, min(self.size - 1, self.size * 3 // 4))
        self.clean_windows = 0

    def window_done(self) -> None:
        """After a clean window: count toward regrowth, and grow when it is due."""
        target = self._target()
        assert self.size is not None
        assert target is not None
        if self.tuner is not None:
            self.tuner.ran(self.size, out_of_memory=False)
        self.growing = False
        if self.size >= target or self.wait is None:
            return
        self.clean_windows += 1
        if self.clean_windows >= self.wait:
            self.size = min(target, max(self.size + 1, math.ceil(self.size * 4 / 3)))
            self.clean_windows = 0
            self.growing = True

    def state_dict(self) -> dict[str, Any]:
        """Plain data for `Accumulator.state_dict`."""
        return {
            "planned": self.planned,
            "size": self.size,
            "clean_windows": self.clean_windows,
            "wait": self.wait,
            "regrow_after": self.regrow_after,  # a resume with another setting starts from it
            "growing": self.growing,
            "out_of_memory_events": self.out_of_memory_events,
            "capped": self.capped,
            "plan": None if self.plan is None else _plain_plan(self.plan),
            "tuner": None if self.tuner is None else self.tuner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (checked by the caller).

        A state planned for another `memory_budget` is not taken: its sizes may not fit this
        budget (a run resumed on a smaller device), so the next batch plans again.
        """
        plan = state["plan"]
        budget = None if self.memory_budget is None else parse_bytes(self.memory_budget)
        if plan is not None and budget is not None and budget != plan["memory_budget"]:
            return
        self.planned, self.size = state["planned"], state["size"]
        self.clean_windows, self.wait = int(state["clean_windows"]), state["wait"]
        saved = state.get("regrow_after", self.regrow_after if self.wait is not None else None)
        if saved != self.regrow_after:  # resumed with another regrow_after: it holds from now
            self.wait = self.regrow_after
        self.growing = bool(state["growing"])
        self.out_of_memory_events = int(state["out_of_memory_events"])
        self.capped = bool(state.get("capped", False))
        self.plan = (
            None
            if plan is None
            else MemoryPlan(**{**plan, "probes": tuple(tuple(p) for p in plan["probes"])})
        )
        if state.get("tuner") is not None and self.mode is AutoSize.FASTEST:
            tuner = ThroughputTuner(1, 1, self._agree)
            tuner.load_state_dict(state["tuner"])
            self.tuner = tuner

    def _planned_text(self) -> str:
        if self.plan is None:
            return f"planned size {self.planned}"
        return (
            f"planned size {self.planned}, predicted peak "
            f"{format_bytes(self.plan.predicted_peak_bytes)}"
        )


def _plain_plan(plan: MemoryPlan) -> dict[str, Any]:
    plain = asdict(plan)
    plain["probes"] = [list(p) for p in plan.probes]
    return plain


def _work_per_item(batch: Any, items: int) -> float:
    """Tensor (and NumPy array) elements per item: what an item costs, for longer sequences."""
    total = 0

    def count(tensor: Any) -> Any:
        nonlocal total
        total += tensor.numel() if isinstance(tensor, torch.Tensor) else tensor.size
        return tensor

    map_tensors(batch, count, arrays=count)
    return total / max(items, 1)


def _synchronize(device: torch.device) -> None:
    """Wait for the device, so the clock times the window, not its launch."""
    _compat.synchronize(device)
