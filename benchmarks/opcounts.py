"""What `Accumulator.step` runs that the hand loop does not, counted rather than timed.

Timing on a shared machine cannot resolve a few tenths of a percent; counts are deterministic.
For each model of `benchmarks/overhead.py` (same batches, loops and optimizer, one thread), after
warm-up steps:

- aten operations and CPU allocations per step, under `torch.profiler` (`profile_memory=True`;
  allocations read from the exported trace as in `_measure.peak_allocated_bytes`);
- Python and builtin function calls per step, under `cProfile`;

for ours, the bare hand loop and the hand loop with loss logging and a finite check, then every
aten operation whose count per step differs between ours and the bare hand loop.

Usage:
    .venv/bin/python benchmarks/opcounts.py [--cases cnn,lm] [--steps N]    # ~30 s
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from _measure import _memory_events, _profiler_chatter_filtered
from gradaccum import Accumulator
from overhead import Case, make_cases, new_optimizer


def op_counts(step: Callable[[], object], steps: int) -> tuple[collections.Counter[str], float]:
    """aten operations per step by name, and CPU allocations per step."""
    with (
        _profiler_chatter_filtered(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        for _ in range(steps):
            step()
    ops = collections.Counter(event.name for event in prof.events() if event.name != "[memory]")
    allocations = sum(1 for event in _memory_events(prof) if event[3] > 0)
    return ops, allocations / steps


def python_calls(step: Callable[[], object], steps: int) -> float:
    """Python and builtin function calls per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    return sum(entry[1] for entry in stats.values()) / steps


def contenders(case: Case) -> dict[str, Callable[[], object]]:
    """One step of each loop, on one model and optimizer (as `overhead.run_case` builds them)."""
    torch.manual_seed(2)
    model = case.make_model()
    opt = new_optimizer(model)
    acc = Accumulator(model, opt, micro_batch_size=case.micro)
    return {
        "ours": lambda: acc.step(case.batch, case.loss_fn),
        "hand": lambda: case.hand_step(model, opt, case.batch, case.micro),
        "hand, checked": lambda: case.hand_step(model, opt, case.batch, case.micro, checked=True),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="cnn,lm", help="comma-separated: cnn, lm")
    parser.add_argument("--steps", type=int, default=5, help="counted steps per loop")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for case in make_cases():
        if case.name not in args.cases.split(","):
            continue
        loops = contenders(case)
        rows, ops = {}, {}
        for name, step in loops.items():
            for _ in range(3):
                step()
            ops[name], allocations = op_counts(step, args.steps)
            rows[name] = (sum(ops[name].values()) / args.steps, allocations)
            rows[name] += (python_calls(step, args.steps),)
        print(f"\n{case.name}: per step       aten ops  allocations  Python calls")
        for name, (count, allocations, calls) in rows.items():
            print(f"  {name:<20} {count:>10,.0f} {allocations:>12,.0f} {calls:>13,.0f}")
        print("  aten ops whose count differs, ours - hand (per step):")
        names = set(ops["ours"]) | set(ops["hand"])
        diffs = {n: (ops["ours"][n] - ops["hand"][n]) / args.steps for n in names}
        for name, diff in sorted(diffs.items(), key=lambda item: -abs(item[1])):
            if diff:
                print(f"    {diff:+7.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
