"""The micro-batch size as a speed knob: items per second and peak memory per size, and auto's pick.

For each embedded task (digits, shapes, charlm) and one effective batch, in ONE process:

- every fixed micro-batch size (powers of two up to the batch, and the batch) trains windows of
  `Accumulator.step`; `micro_batch_size="auto"` trains too, first through its timing windows
  (a warm-up, then each candidate twice), then at the size it chose;
- the timed blocks alternate between all contenders (`_measure.interleaved_times`), so drift of
  the machine falls on every size alike; items per second is the median over blocks;
- peak memory is the largest number of CPU tensor bytes alive at once during one window
  (`_measure.peak_allocated_bytes`, allocator events from the profiler), per size.

Printed per task: a table of sizes (auto's choice marked), then auto's throughput as a fraction of
the best fixed size (target: >= 0.95) and of the largest size (the old "largest that fits" rule).

Threads: `torch.set_num_threads(1)`, as in `benchmarks/overhead.py`.

Usage:
    .venv/bin/python benchmarks/sweep.py [--quick] [--tasks digits,shapes,charlm] [--batch N]
                                         [--repeats N] [--windows N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from _measure import interleaved_times, peak_allocated_bytes
from gradaccum import Accumulator
from gradaccum.batching import map_tensors
from gradaccum.batchnorm import BatchNormAccumulationWarning
from gradaccum.experiments.tasks import get_task

BATCHES = {"digits": 256, "shapes": 64, "charlm": 128}


def _setup(task_name: str, batch_items: int) -> tuple[Any, Callable[..., Any], Callable[[], Any]]:
    task = get_task(task_name)
    train = task.make_data(0).train
    index = torch.arange(batch_items)
    batch = map_tensors(train, lambda t: t[index])

    def fresh() -> torch.nn.Module:
        return task.make_model(0)

    return batch, task.loss_fn, fresh


def _window(size: int | str, fresh: Callable[[], torch.nn.Module]) -> tuple[Accumulator, Any]:
    model = fresh()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    budget = "4GiB" if isinstance(size, str) else None
    return Accumulator(model, optimizer, micro_batch_size=size, memory_budget=budget), model


def sweep(task_name: str, batch_items: int, repeats: int, windows: int) -> dict[str, Any]:
    """Time every size and auto on one task; return the table's numbers."""
    batch, loss_fn, fresh = _setup(task_name, batch_items)
    sizes = sorted({1 << k for k in range(batch_items.bit_length()) if 1 << k < batch_items})
    sizes = [s for s in sizes if s >= 2] + [batch_items]
    contenders: dict[str, Callable[[], object]] = {}
    for size in sizes:
        acc, _ = _window(size, fresh)
        contenders[str(size)] = lambda acc=acc: acc.step(batch, loss_fn)
    auto, _ = _window("auto", fresh)
    tuning = []
    while True:  # auto's timing windows, untimed here: only its steady state is compared
        result = auto.step(batch, loss_fn)
        tuning.append(result.micro_batch_size)
        if result.sizing is not None and "timing" not in result.sizing:
            break
        if len(tuning) > 40:
            raise RuntimeError("auto never settled")
    contenders["auto"] = lambda: auto.step(batch, loss_fn)
    times = interleaved_times(contenders, repeats=repeats, steps_per_repeat=windows, warmup=1)
    rate = {name: batch_items / statistics.median(t) for name, t in times.items()}
    peaks = {}
    for size in sizes:
        acc, _ = _window(size, fresh)
        acc.step(batch, loss_fn)
        peaks[size] = peak_allocated_bytes(lambda acc=acc: acc.step(batch, loss_fn)).peak_bytes
    chosen = auto.step(batch, loss_fn)
    best = max(sizes, key=lambda s: rate[str(s)])
    return {
        "task": task_name,
        "batch": batch_items,
        "sizes": sizes,
        "items_per_second": {str(s): rate[str(s)] for s in sizes},
        "peak_bytes": {str(s): peaks[s] for s in sizes},
        "auto": {
            "chosen": chosen.micro_batch_size,
            "sizing": chosen.sizing,
            "tuning_windows": len(tuning),
            "items_per_second": rate["auto"],
            "vs_best": rate["auto"] / rate[str(best)],
            # The same interleaved measurement, at the size auto chose: its choice, without
            # the noise between two contenders that run the same size.
            "chosen_vs_best": rate[str(chosen.micro_batch_size)] / rate[str(best)],
            "vs_largest": rate["auto"] / rate[str(batch_items)],
            "best": best,
        },
    }


def _print(report: dict[str, Any]) -> None:
    auto = report["auto"]
    print(f"\n## {report['task']} (effective batch {report['batch']})\n")
    print("| micro-batch | items/s | peak MiB | |")
    print("|---:|---:|---:|:---|")
    for size in report["sizes"]:
        marks = []
        if size == auto["chosen"]:
            marks.append("auto")
        if size == auto["best"]:
            marks.append("fastest")
        rate = report["items_per_second"][str(size)]
        peak = report["peak_bytes"][str(size)] / 2**20
        print(f"| {size} | {rate:,.0f} | {peak:.1f} | {', '.join(marks)} |")
    print(
        f"\nauto: {auto['items_per_second']:,.0f} items/s at {auto['chosen']} after "
        f"{auto['tuning_windows']} timing windows = {auto['vs_best']:.2f}x the fastest fixed size "
        f"({auto['best']}), {auto['vs_largest']:.2f}x the largest ({report['batch']}); the size it "
        f"chose runs at {auto['chosen_vs_best']:.2f}x the fastest as a fixed size"
    )
    print(f"auto's reason: {auto['sizing']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run for a smoke test")
    parser.add_argument("--tasks", default="digits,shapes,charlm")
    parser.add_argument("--batch", type=int, default=None, help="effective batch for every task")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--windows", type=int, default=3, help="windows per timed block")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Speed only: what BatchNorm computes per micro-batch is the subject of batchnorm_study.py.
    warnings.filterwarnings("ignore", category=BatchNormAccumulationWarning)
    repeats, windows = (2, 1) if args.quick else (args.repeats, args.windows)
    print(f"$ {' '.join(['python', *sys.argv])}")
    print(f"torch {torch.__version__}, 1 thread, {repeats} repeats x {windows} windows per size")
    reports = []
    for name in args.tasks.split(","):
        batch = args.batch or (16 if args.quick else BATCHES[name])
        reports.append(sweep(name, batch, repeats, windows))
        _print(reports[-1])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(reports, handle, indent=2)


if __name__ == "__main__":
    main()
