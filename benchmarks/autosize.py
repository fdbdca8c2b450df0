"""The memory plan on the embedded tasks: planning cost, prediction, and throughput.

(It runs `micro_batch_size="largest"`, the planned size, untimed; `"auto"` times sizes up to it,
which `benchmarks/sweep.py` measures.)

For each task (`digits`, `charlm`, `shapes`), with its default model in fp32, AdamW, and a batch
large enough that a memory budget actually constrains the micro-batch size m (the budgets are
chosen so that m is neither 1 nor the whole batch), this reports:

- **planning time**: `plan_micro_batch` on a fresh model and optimizer (median of a few calls),
  and the extra time of the first `step()` of an `Accumulator(micro_batch_size="auto")` over
  the first step of one at the same fixed m; both as a share of a 100-step run at the chosen m.
  The 100-step run is NOT timed whole: it is 100 x the median step time at m measured in the
  throughput blocks below (extrapolated);
- **predicted vs measured peak** at the chosen m. Measured = the peak of tensor memory from
  `gradaccum.memory.track_tensor_bytes` around a real `Accumulator.step` in the steady state
  (after a first step; the batch is built before the tracker is entered), plus the bytes of
  the parameters and optimizer state that existed before. Also the peak growth of resident
  memory (RSS) of real training at m, each in a fresh subprocess: with
  `MALLOC_MMAP_THRESHOLD_=131072` (glibc then returns freed tensor memory at once, so RSS
  follows live tensors, see tests/rss_worker.py), the same with oneDNN disabled, and with
  glibc's default (its dynamic threshold keeps freed memory); the thresholded subprocess then
  also runs `micro_batch_size="auto"`, planning included;
- **throughput** (samples/s) at the auto choice vs a conservative hand choice (m = 8): the two
  alternate call by call (the order shuffled every round), median over repeats, one
  thread; the speed-up is the median of the per-repeat ratios;
- **activations per item** (`MemoryPlan.activation_bytes_per_item`) at each task's default
  batch and at the batch above.

`--plots DIR` also measures the steady-state peak at a sweep of sizes and draws it with the
plan's fitted line (DIR/memory_fit.png), and the peaks at m relative to the plan
(DIR/memory_rss.png). docs/memory.md explains the memory model and these results.

Usage:
    .venv/bin/python benchmarks/autosize.py [--quick] [--tasks digits,charlm,shapes]
        [--repeats R] [--steps S] [--json PATH] [--plots DIR]

`--quick` (the smoke test): digits and charlm on smaller batches, 2 repeats of 1 step, only
the thresholded RSS subprocess, run while the main process times (so its times are noisy).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from _measure import interleaved_times, paired_ratios, quartiles
from gradaccum import Accumulator, MemoryPlan, plan_micro_batch
from gradaccum.batching import map_tensors
from gradaccum.batchnorm import BatchNormAccumulationWarning
from gradaccum.experiments.tasks import get_task
from gradaccum.memory import track_tensor_bytes

THREADS = 1
HAND_M = 8
RSS_STEPS = 3
MMAP_THRESHOLD = "131072"
ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


@dataclass(frozen=True)
class Case:
    """A task, the batch it is stepped on, and the budget that constrains its micro-batches."""

    task: str
    batch_size: int
    budget: str
    quick_batch_size: int
    quick_budget: str


CASES = {
    "digits": Case("digits", 1024, "6MiB", 256, "3MiB"),
    "charlm": Case("charlm", 256, "96MiB", 64, "24MiB"),
    "shapes": Case("shapes", 128, "96MiB", 32, "24MiB"),
}


@dataclass
class Setup:
    """Everything one case needs: the task, its batch and a factory of fresh models."""

    name: str
    batch: Any
    batch_size: int
    budget: str
    loss_fn: Callable[[torch.nn.Module, Any], Any]
    lr: float
    model: torch.nn.Module  # a fresh model; copies of it are trained

    def fresh(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(self.model)
        return model, torch.optim.AdamW(model.parameters(), lr=self.lr)


def make_setup(name: str, batch_size: int, budget: str) -> Setup:
    task = get_task(name)
    train = task.make_data(seed=0).train
    batch = map_tensors(train, lambda t: t[:batch_size].clone())
    return Setup(name, batch, batch_size, budget, task.loss_fn, task.default_lr, task.make_model(0))


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and optimizer state, counted from the tensors themselves."""
    state = [v for s in optimizer.state.values() for v in s.values()]
    return tensor_bytes(model.parameters()) + tensor_bytes(state)


def steady_peak(setup: Setup, size: int) -> int:
    """Peak tensor bytes of a steady-state step at `size`: held bytes + what the step allocated."""
    model, optimizer = setup.fresh()
    acc = Accumulator(model, optimizer, micro_batch_size=size)
    acc.step(setup.batch, setup.loss_fn)  # optimizer state now exists
    gc.collect()
    before = held_bytes(model, optimizer)
    with track_tensor_bytes() as tracker:
        acc.step(setup.batch, setup.loss_fn)
    return before + tracker.peak


def timed(fn: Callable[..., object], *args: Any, **kwargs: Any) -> float:
    started = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - started


def planning_times(setup: Setup, size: int, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds of `plan_micro_batch`, and first auto step minus first fixed step, per round."""
    plans, extras = [], []
    for round_ in range(rounds):
        model, optimizer = setup.fresh()
        plans.append(
            timed(
                plan_micro_batch,
                model,
                setup.batch,
                setup.loss_fn,
                optimizer,
                memory_budget=setup.budget,
            )
        )
        firsts = {}
        for kind in ("auto", "fixed") if round_ % 2 == 0 else ("fixed", "auto"):
            model, optimizer = setup.fresh()
            acc = Accumulator(
                model,
                optimizer,
                micro_batch_size="largest" if kind == "auto" else size,
                memory_budget=setup.budget if kind == "auto" else None,
            )
            firsts[kind] = timed(acc.step, setup.batch, setup.loss_fn)
        extras.append(firsts["auto"] - firsts["fixed"])
    return plans, extras


def throughput(setup: Setup, repeats: int, steps: int) -> tuple[dict[str, list[float]], int]:
    """Seconds per step of auto and of m = HAND_M, interleaved step by step; auto's size."""
    model_a, opt_a = setup.fresh()
    model_h, opt_h = setup.fresh()
    auto = Accumulator(model_a, opt_a, micro_batch_size="largest", memory_budget=setup.budget)
    hand = Accumulator(model_h, opt_h, micro_batch_size=HAND_M)
    sizes = []
    candidates = {
        "auto": lambda: sizes.append(auto.step(setup.batch, setup.loss_fn).micro_batch_size),
        f"m={HAND_M}": lambda: hand.step(setup.batch, setup.loss_fn),
    }
    times = interleaved_times(candidates, repeats=repeats, steps_per_repeat=steps, warmup=2)
    assert len(set(sizes)) == 1, f"auto changed its size while timed: {sorted(set(sizes))}"
    return times, sizes[0]


# Resident memory is measured in fresh subprocesses, one per (task, variant): glibc's handling of
# freed memory depends on what the process did before, and MALLOC_MMAP_THRESHOLD_ is read at start.
RSS_VARIANTS = {
    # name: (MALLOC_MMAP_THRESHOLD_ set, oneDNN enabled, sizes run in order)
    "threshold": (True, True, ("m", "auto")),
    "onednn_off": (True, False, ("m",)),
    "default": (False, True, ("m",)),
}


def start_rss_child(setup: Setup, size: int, variant: str) -> subprocess.Popen | None:
    """Start a subprocess training at `size` (and maybe "auto") under one RSS variant."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        return None
    threshold, onednn, sizes = RSS_VARIANTS[variant]
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    spec = {
        "task": setup.name,
        "batch_size": setup.batch_size,
        "budget": setup.budget,
        "onednn": onednn,
        "sizes": [size if s == "m" else s for s in sizes],
    }
    return subprocess.Popen(
        [sys.executable, __file__, "--rss-child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def rss_results(children: dict[str, dict[str, Any]]) -> None:
    """Wait for the children; replace each by its JSON report (None where /proc is missing)."""
    for per_variant in children.values():
        for key, child in per_variant.items():
            if not isinstance(child, subprocess.Popen):  # None, or already collected
                continue
            out, err = child.communicate(timeout=600)
            if child.returncode != 0:
                raise RuntimeError(f"RSS subprocess failed ({child.returncode}):\n{err[-2000:]}")
            per_variant[key] = json.loads(out.strip().splitlines()[-1])


def _status_bytes(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"{field}:\s+(\d+) kB", text)
    assert match is not None
    return int(match.group(1)) * 1024


def rss_child(spec: dict) -> None:
    """In the subprocess: train RSS_STEPS steps per size on a fresh model; print peak growth.

    The baseline is the resident memory right before the model is built, after the imports,
    the data, and a warm-up on a separate copy of the model: one step of 4 items and one
    `plan_micro_batch` on them (so libraries, kernels and the planner's one-time costs are
    loaded; that plan's resident growth is reported as `first_plan`). `/proc/self/clear_refs`
    restarts the high-water mark at the baseline.
    """
    torch.set_num_threads(THREADS)
    torch.backends.mkldnn.enabled = spec["onednn"]
    warnings.simplefilter("ignore", BatchNormAccumulationWarning)
    setup = make_setup(spec["task"], spec["batch_size"], spec["budget"])
    warm, warm_opt = setup.fresh()
    small = map_tensors(setup.batch, lambda t: t[:4])
    Accumulator(warm, warm_opt, micro_batch_size=2).step(small, setup.loss_fn)
    gc.collect()
    before_plan = _status_bytes("VmRSS")
    plan_micro_batch(warm, small, setup.loss_fn, warm_opt, memory_budget="1GiB")
    gc.collect()
    first_plan = _status_bytes("VmRSS") - before_plan
    del warm, warm_opt, small
    runs = []
    for size in spec["sizes"]:
        gc.collect()
        baseline = _status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here
        model, optimizer = setup.fresh()
        budget = setup.budget if size == "auto" else None
        planned = "largest" if size == "auto" else size  # the plan's size, untimed
        acc = Accumulator(model, optimizer, micro_batch_size=planned, memory_budget=budget)
        for _ in range(RSS_STEPS):
            used = acc.step(setup.batch, setup.loss_fn).micro_batch_size
        runs.append({"size": size, "used": used, "peak": _status_bytes("VmHWM") - baseline})
        del acc, model, optimizer
    print(json.dumps({"first_plan": first_plan, "runs": runs}))


def make_plan(setup: Setup) -> MemoryPlan:
    model, optimizer = setup.fresh()
    return plan_micro_batch(
        model, setup.batch, setup.loss_fn, optimizer, memory_budget=setup.budget
    )


def run_case(setup: Setup, plan: MemoryPlan, repeats: int, steps: int, rounds: int) -> dict:
    """Everything measured in this process: tensor peak, planning time, throughput."""
    size = plan.micro_batch_size
    measured = steady_peak(setup, size)
    plans, extras = planning_times(setup, size, rounds)
    times, auto_used = throughput(setup, repeats, steps)
    step_auto, step_hand = statistics.median(times["auto"]), statistics.median(times[f"m={HAND_M}"])
    q1, speedup, q3 = quartiles(paired_ratios(times[f"m={HAND_M}"], times["auto"]))
    run_100 = 100 * step_auto
    return {
        "plan": plan,
        "batch_size": setup.batch_size,
        "budget": setup.budget,
        "m": size,
        "plan_s": statistics.median(plans),
        "first_step_extra_s": statistics.median(extras),
        "step_s_auto": step_auto,
        "step_s_hand": step_hand,
        "run_100_s": run_100,
        "plan_share": statistics.median(plans) / run_100,
        "extra_share": statistics.median(extras) / run_100,
        "predicted": plan.predicted_peak_bytes,
        "measured": measured,
        "auto_used": auto_used,
        "samples_s_auto": setup.batch_size / step_auto,
        "samples_s_hand": setup.batch_size / step_hand,
        "speedup": speedup,
        "speedup_iqr": (q1, q3),
    }


def start_rss(
    setups: dict[str, Setup], plans: dict[str, MemoryPlan], variants: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """Start every resident-memory subprocess at once."""
    return {
        name: {v: start_rss_child(setup, plans[name].micro_batch_size, v) for v in variants}
        for name, setup in setups.items()
    }


def add_rss(children: dict[str, dict[str, Any]], results: dict[str, dict]) -> None:
    """Wait for the subprocesses and put their figures into `results` (None: not measured)."""
    rss_results(children)
    for name, per_variant in children.items():
        figures: dict[str, Any] = dict.fromkeys(
            ["rss_threshold", "rss_onednn_off", "rss_default", "rss_auto", "rss_auto_used"]
        )
        figures["rss_first_plan"] = None
        for variant, report in per_variant.items():
            if report is None:
                continue
            figures[f"rss_{variant}"] = report["runs"][0]["peak"]
            if variant == "threshold":
                figures["rss_auto"] = report["runs"][1]["peak"]
                figures["rss_auto_used"] = report["runs"][1]["used"]
                figures["rss_first_plan"] = report["first_plan"]
        results[name].update(figures)


def default_batch_costs(names: list[str]) -> dict[str, tuple[int, float]]:
    """Per-item activation bytes at each task's default batch, whole batch in one micro-batch."""
    costs = {}
    for name in names:
        task = get_task(name)
        setup = make_setup(name, task.default_batch_size, "1GiB")
        model, optimizer = setup.fresh()
        plan = plan_micro_batch(model, setup.batch, setup.loss_fn, optimizer, memory_budget="1GiB")
        costs[name] = (task.default_batch_size, plan.activation_bytes_per_item)
    return costs


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.2f}"


def with_ratio(value: float | None, reference: float) -> str:
    return "n/a" if value is None else f"{value / MIB:.2f} ({value / reference:.3f})"


def print_report(
    results: dict[str, dict], costs: dict[str, tuple[int, float]], settings: dict
) -> None:
    print(
        f"torch {torch.__version__} | Python {platform.python_version()} | CPU, "
        f"torch.set_num_threads({THREADS}) | AdamW, fp32 | {settings['repeats']} alternating "
        f"repeats x {settings['steps']} steps, planning timed {settings['rounds']}x"
    )
    print()
    for name, r in results.items():
        print(f"### {name}: str(plan)\n```\n{r['plan']}\n```\n")
    print("Planning cost. The 100-step run is 100 x the median step time at the chosen m,")
    print(f"measured over {settings['repeats'] * settings['steps']} timed steps (extrapolated,")
    print("not a timed 100-step run). 'first auto step extra' = first step of an auto")
    print("Accumulator minus first step of one at the same fixed m (fresh models).")
    print()
    print(
        "| task | batch | budget | auto m | plan_micro_batch s | first auto step extra s "
        "| step s at m | 100-step run s | plan / run | extra / run |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        print(
            f"| {name} | {r['batch_size']} | {r['budget']} | {r['m']} | {r['plan_s']:.3f} "
            f"| {r['first_step_extra_s']:.3f} | {r['step_s_auto']:.4f} | {r['run_100_s']:.2f} "
            f"| {r['plan_share']:.1%} | {r['extra_share']:.1%} |"
        )
    print()
    print("Tensor memory at the chosen m, MiB: measured = track_tensor_bytes peak around a")
    print("steady-state Accumulator.step + the parameters and optimizer state held before it.")
    print()
    print(
        "| task | auto m | budget | usable (less margin) | predicted | measured "
        "| measured / predicted |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        plan = r["plan"]
        print(
            f"| {name} | {r['m']} | {mib(plan.memory_budget)} | {mib(plan.usable_bytes)} "
            f"| {mib(r['predicted'])} | {mib(r['measured'])} "
            f"| {r['measured'] / r['predicted']:.3f} |"
        )
    print()
    print(f"Resident memory, MiB (over the predicted peak): peak growth of VmHWM over {RSS_STEPS}")
    print("steps in a fresh subprocess, above its resident memory before the model was built.")
    print(f"threshold: MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}; oneDNN off: the same with")
    print("torch.backends.mkldnn.enabled=False; glibc default: no threshold set. 'auto':")
    print("micro_batch_size='auto' (planning included), run after the fixed-m run in the")
    print("threshold subprocess.")
    print()
    print(
        "| task | auto m | budget | predicted | RSS, threshold | RSS, threshold, oneDNN off "
        "| RSS, glibc default | RSS, auto (threshold) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        p = r["predicted"]
        print(
            f"| {name} | {r['m']} | {mib(r['plan'].memory_budget)} | {mib(p)} "
            f"| {with_ratio(r['rss_threshold'], p)} | {with_ratio(r['rss_onednn_off'], p)} "
            f"| {with_ratio(r['rss_default'], p)} | {with_ratio(r['rss_auto'], p)} |"
        )
    firsts = [f"{n} {mib(r['rss_first_plan'])}" for n, r in results.items()]
    print(f"(one-time resident growth of the first plan in a process, MiB: {', '.join(firsts)})")
    print()
    print("Throughput, samples/s (median over repeats); speed-up = median of per-repeat ratios")
    print(f"(time at m={HAND_M}) / (time at auto m), with its interquartile range")
    print()
    print(f"| task | batch | auto m | samples/s auto | samples/s m={HAND_M} | speed-up | IQR |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        q1, q3 = r["speedup_iqr"]
        print(
            f"| {name} | {r['batch_size']} | {r['auto_used']} | {r['samples_s_auto']:,.0f} "
            f"| {r['samples_s_hand']:,.0f} | {r['speedup']:.2f}x | {q1:.2f}-{q3:.2f} |"
        )
    print()
    print("Activations per item (MemoryPlan.activation_bytes_per_item, default model, fp32)")
    print()
    print("| task | default batch | KiB per item there | batch above | KiB per item there |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (default, per_item) in costs.items():
        r = results[name]
        there = r["plan"].activation_bytes_per_item / 1024
        print(f"| {name} | {default} | {per_item / 1024:.1f} | {r['batch_size']} | {there:.1f} |")


def sweep_sizes(batch_size: int, chosen: int) -> list[int]:
    sizes = {batch_size, chosen}
    size = 4
    while size < batch_size:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def plot_fit(setups: dict[str, Setup], results: dict[str, dict], path: Path) -> dict[str, dict]:
    """Measured steady-state peak at a sweep of sizes against each plan's fitted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[str, dict] = {}
    fig, axes = plt.subplots(1, len(setups), figsize=(5 * len(setups), 4.2), squeeze=False)
    for ax, (name, setup) in zip(axes[0], setups.items(), strict=True):
        plan: MemoryPlan = results[name]["plan"]
        sizes = sweep_sizes(setup.batch_size, plan.micro_batch_size)
        measured = [steady_peak(setup, size) for size in sizes]
        points[name] = {"sizes": sizes, "measured": measured}
        line = list(range(1, setup.batch_size + 1))
        probes = [
            (size, plan.fixed_bytes + max(peak, plan.step_workspace_bytes))
            for size, peak in plan.probes
        ]
        ax.plot(line, [plan.predict(m) / MIB for m in line], "-", label="plan.predict(m)")
        ax.plot(sizes, [v / MIB for v in measured], "o", label="measured: real step")
        ax.plot(
            [size for size, _ in probes],
            [value / MIB for _, value in probes],
            "x",
            markersize=9,
            label="plan's probes (+ fixed part)",
        )
        ax.axhline(plan.memory_budget / MIB, color="grey", linestyle="--", label="budget")
        ax.axvline(plan.micro_batch_size, color="grey", linestyle=":", label="auto m")
        ax.set_title(
            f"{name}: batch {setup.batch_size}, budget {setup.budget}, m={plan.micro_batch_size}"
        )
        ax.set_xlabel("micro-batch size m")
        ax.set_ylabel("peak tensor memory of a step, MiB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return points


def plot_rss(results: dict[str, dict], path: Path) -> None:
    """Bars: every measured peak at the chosen m over the predicted peak, per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        ("measured", "tensor peak (track_tensor_bytes)"),
        ("rss_threshold", "RSS, MALLOC_MMAP_THRESHOLD_"),
        ("rss_onednn_off", "RSS, threshold, oneDNN off"),
        ("rss_default", "RSS, glibc default"),
        ("rss_auto", "RSS, auto incl. planning (threshold)"),
    ]
    names = list(results)
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (key, label) in enumerate(bars):
        values = [(results[n][key] or 0) / results[n]["predicted"] for n in names]
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, values, width, label=label)
    for j, name in enumerate(names):
        budget = results[name]["plan"].memory_budget / results[name]["predicted"]
        ax.plot([j - 0.45, j + 0.45], [budget, budget], "k--", linewidth=1)
    ax.plot([], [], "k--", linewidth=1, label="memory budget")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{n} (m={results[n]['m']})" for n in names])
    ax.set_ylabel("peak / predicted peak")
    ax.set_title("Peak memory at the auto micro-batch size, relative to the plan")
    ax.set_ylim(0, 2.1)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller batches, few repeats")
    parser.add_argument("--tasks", default=None, help="comma-separated, default all three")
    parser.add_argument("--repeats", type=int, default=None, help="timed blocks per choice")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--plots", metavar="DIR", help="write memory_fit.png and memory_rss.png into DIR"
    )
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child is not None:
        rss_child(json.loads(args.rss_child))
        return 0
    names = (args.tasks or ("digits,charlm" if args.quick else ",".join(CASES))).split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--tasks: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    for flag, value in (("--repeats", args.repeats), ("--steps", args.steps)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1")
    repeats, steps, rounds = (2, 1, 1) if args.quick else (7, 3, 3)
    repeats = args.repeats or repeats
    steps = args.steps or steps

    torch.set_num_threads(THREADS)
    warnings.simplefilter("ignore", BatchNormAccumulationWarning)  # shapes' BatchNorm: timing only
    started = time.perf_counter()
    setups = {}
    for name in names:
        case = CASES[name]
        if args.quick:
            setups[name] = make_setup(name, case.quick_batch_size, case.quick_budget)
        else:
            setups[name] = make_setup(name, case.batch_size, case.budget)
    plans = {name: make_plan(setup) for name, setup in setups.items()}
    children = start_rss(setups, plans, ("threshold",) if args.quick else tuple(RSS_VARIANTS))
    if not args.quick:  # the subprocesses would disturb the timing; --quick lets them overlap
        rss_results(children)
    results = {
        name: run_case(setup, plans[name], repeats, steps, rounds) for name, setup in setups.items()
    }
    add_rss(children, results)
    costs = default_batch_costs(names)
    settings = {"repeats": repeats, "steps": steps, "rounds": rounds, "threads": THREADS}
    print_report(results, costs, settings)
    sweep = None
    if args.plots:
        folder = Path(args.plots)
        folder.mkdir(parents=True, exist_ok=True)
        sweep = plot_fit(setups, results, folder / "memory_fit.png")
        plot_rss(results, folder / "memory_rss.png")
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    if args.json:
        payload = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "settings": settings,
            "results": {
                name: {**r, "plan": {**dataclasses.asdict(r["plan"]), "text": str(r["plan"])}}
                for name, r in results.items()
            },
            "activation_bytes_per_item_default_batch": costs,
            "sweep": sweep,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
