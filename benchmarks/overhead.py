"""Overhead of `gradaccum.Accumulator.step` against a correct hand-written accumulation loop.

Both run in ONE process on the SAME model and optimizer, interleaved step by step, at the
same micro-batch size, on CPU with a fixed number of threads:

- cnn: a small CNN (2 conv layers + linear) on 28x28 inputs, batch 64, micro-batch 16,
  mean cross-entropy per sample;
- lm: a tiny causal transformer language model (2 layers, d_model 64, sequence 64, vocabulary
  96), batch 32, micro-batch 8, with padded (ignored) label positions, token-level mean
  cross-entropy: `LossSum(sum, tokens)` for the library; the hand loop divides each
  micro-batch's summed loss by the whole batch's token count.

The hand loop is the correct mean-loss version: `zero_grad` once, then for each micro-batch a
forward, `loss * (n_i / B)` (or `sum_i / total_tokens`), `backward`, and one `optimizer.step`.
It reads nothing back to the host (no loss logging, no gradient norm).

Printed per model: median seconds per step for each, the median of the per-repeat ratios
ours / hand (with its interquartile range) and the peak-memory ratio. Peak memory is the largest
number of bytes of CPU tensor storage allocated during one step and alive at once, from the
PyTorch profiler's allocator events (see `_measure.peak_allocated_bytes`).

Threads: `torch.set_num_threads(1)`, so each step uses one core whatever else the machine runs.

Usage:
    .venv/bin/python benchmarks/overhead.py [--quick] [--processes P] [--repeats N] [--steps N]
                                            [--json PATH] [--profile]

`--profile` then prints the self time of every library function inside real steps, next to the
hand loop's (see `_measure.attributed_time`). docs/benchmarks.md explains the method and results.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradaccum
from _measure import (
    attributed_time,
    interleaved_times,
    paired_ratios,
    peak_allocated_bytes,
    quartiles,
    saved_for_backward_bytes,
)
from gradaccum import Accumulator, LossSum
from gradaccum.batching import map_tensors

THREADS = 1
TARGET = 1.02
IGNORE = -100
VOCAB = 96
SEQ = 64

Batch = Any
StepFn = Callable[[nn.Module, torch.optim.Optimizer, Batch, int], None]


class SmallCNN(nn.Module):
    """Two 3x3 conv layers with pooling, then a linear classifier, for 1x28x28 inputs."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class TinyLM(nn.Module):
    """A causal transformer language model: embeddings, 2 encoder layers, a vocabulary head."""

    def __init__(self, vocab: int = VOCAB, d_model: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(SEQ, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:length]
        h = self.encoder(h, mask=self.mask[:length, :length], is_causal=True)
        return self.head(h)


def lm_loss_sum(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the labels that are not `IGNORE`."""
    logits = model(inputs)
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )


# --- the library's loss functions -----------------------------------------------------------


def cnn_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)  # a mean: the library weights it by len(x)


def lm_loss(model: nn.Module, batch: Batch) -> LossSum:
    labels = batch["labels"]
    return LossSum(lm_loss_sum(model, batch["input"], labels), (labels != IGNORE).sum())


# --- the hand-written loops ------------------------------------------------------------------


def hand_step_cnn(
    model: nn.Module, opt: torch.optim.Optimizer, batch: Batch, micro: int, checked: bool = False
) -> None:
    x, y = batch
    total = x.shape[0]
    opt.zero_grad(set_to_none=True)
    loss_sum = torch.zeros(())
    for start in range(0, total, micro):
        xb, yb = x[start : start + micro], y[start : start + micro]
        loss = F.cross_entropy(model(xb), yb)
        (loss * (xb.shape[0] / total)).backward()
        if checked:
            loss_sum += loss.detach() * xb.shape[0]
    if checked and not _grads_finite_and_logged(model, loss_sum):
        return
    opt.step()


def hand_step_lm(
    model: nn.Module, opt: torch.optim.Optimizer, batch: Batch, micro: int, checked: bool = False
) -> None:
    inputs, labels = batch["input"], batch["labels"]
    tokens = (labels != IGNORE).sum()
    opt.zero_grad(set_to_none=True)
    loss_sum = torch.zeros(())
    for start in range(0, inputs.shape[0], micro):
        end = start + micro
        summed = lm_loss_sum(model, inputs[start:end], labels[start:end])
        (summed / tokens).backward()
        if checked:
            loss_sum += summed.detach()
    if checked and not _grads_finite_and_logged(model, loss_sum):
        return
    opt.step()


def _grads_finite_and_logged(model: nn.Module, loss_sum: torch.Tensor) -> bool:
    """What a careful hand loop adds: read the loss for logging, and skip a non-finite step."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))  # any torch >= 2.4
    return math.isfinite(float(loss_sum)) and math.isfinite(float(norm))


# --- cases ------------------------------------------------------------------------------------


@dataclass
class Case:
    """One benchmark configuration: a model, a fixed batch and both ways to step on it."""

    name: str
    description: str
    make_model: Callable[[], nn.Module]
    batch: Batch
    batch_size: int
    micro: int
    loss_fn: Callable[[nn.Module, Batch], Any]
    hand_step: StepFn


def make_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(64, 1, 28, 28, generator=gen)
    classes = torch.randint(0, 10, (64,), generator=gen)
    tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    lengths = torch.randint(SEQ // 2, SEQ + 1, (32,), generator=gen)
    labels[torch.arange(SEQ)[None, :] >= lengths[:, None]] = IGNORE  # right padding
    lm_batch = {"input": tokens[:, :-1].contiguous(), "labels": labels}
    return [
        Case(
            "cnn",
            "2 conv + linear, 1x28x28, batch 64, micro 16, mean CE",
            SmallCNN,
            (images, classes),
            64,
            16,
            cnn_loss,
            hand_step_cnn,
        ),
        Case(
            "lm",
            "transformer LM 2x64, seq 64, vocab 96, batch 32, micro 8, token CE",
            TinyLM,
            lm_batch,
            32,
            8,
            lm_loss,
            hand_step_lm,
        ),
    ]


def new_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def update_gap(case: Case) -> float:
    """Max |ours - hand| over the parameter update of one float64 SGD step from identical
    states, relative to the largest update: both loops follow the same gradient.

    Plain SGD makes the update proportional to the gradient. (AdamW would not do: it blows up
    gradients that are zero up to rounding, such as an attention layer's key bias, to a full
    learning-rate step, so its updates differ between any two float32 summation orders.)
    """
    torch.manual_seed(1)
    base = case.make_model().double()
    batch = map_tensors(case.batch, lambda t: t.double() if t.is_floating_point() else t)
    ours_model, hand_model = copy.deepcopy(base), copy.deepcopy(base)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.1)
    hand_opt = torch.optim.SGD(hand_model.parameters(), lr=0.1)
    Accumulator(ours_model, ours_opt, micro_batch_size=case.micro).step(batch, case.loss_fn)
    case.hand_step(hand_model, hand_opt, batch, case.micro)
    gap = scale = 0.0
    with torch.no_grad():
        for p0, p1, p2 in zip(
            base.parameters(), ours_model.parameters(), hand_model.parameters(), strict=True
        ):
            gap = max(gap, float((p1 - p2).abs().max()))
            scale = max(scale, float((p2 - p0).abs().max()))
    return gap / scale


def measure_memory(step: Callable[[], object], model: nn.Module, rounds: int) -> int:
    """Median over `rounds` of the peak bytes allocated during one step from a no-grad state."""
    peaks = []
    for _ in range(rounds):
        model.zero_grad(set_to_none=True)
        gc.collect()
        peaks.append(peak_allocated_bytes(step).peak_bytes)
    return int(statistics.median(peaks))


def run_case(case: Case, repeats: int, steps: int, warmup: int, mem_rounds: int) -> dict:
    gap = update_gap(case)
    torch.manual_seed(2)
    model = case.make_model()
    opt = new_optimizer(model)
    acc = Accumulator(model, opt, micro_batch_size=case.micro)

    def ours() -> None:
        acc.step(case.batch, case.loss_fn)

    def hand() -> None:
        case.hand_step(model, opt, case.batch, case.micro)

    def hand_checked() -> None:  # the hand loop plus loss logging and a finite-gradient check
        case.hand_step(model, opt, case.batch, case.micro, checked=True)

    def hand_again() -> None:  # the same loop under another name: the harness's noise floor
        case.hand_step(model, opt, case.batch, case.micro)

    def whole() -> None:  # no accumulation: the whole batch in one backward
        case.hand_step(model, opt, case.batch, case.batch_size)

    gc.collect()
    times = interleaved_times(
        {"ours": ours, "hand": hand, "hand_checked": hand_checked, "hand_again": hand_again},
        repeats=repeats,
        steps_per_repeat=steps,
        warmup=warmup,
    )
    q1, ratio, q3 = quartiles(paired_ratios(times["ours"], times["hand"]))
    aa_q1, aa_ratio, aa_q3 = quartiles(paired_ratios(times["hand_again"], times["hand"]))
    _, checked_ratio, _ = quartiles(paired_ratios(times["ours"], times["hand_checked"]))

    peak_ours = measure_memory(ours, model, mem_rounds)
    peak_hand = measure_memory(hand, model, mem_rounds)
    peak_whole = measure_memory(whole, model, mem_rounds)
    micro_batch = gradaccum.split_batch(case.batch, case.micro)[0]
    params = list(model.parameters())
    saved_micro = saved_for_backward_bytes(lambda: case.loss_fn(model, micro_batch), params)
    saved_whole = saved_for_backward_bytes(lambda: case.loss_fn(model, case.batch), params)
    model.zero_grad(set_to_none=True)
    return {
        "description": case.description,
        "batch_size": case.batch_size,
        "micro_batch_size": case.micro,
        "parameters": sum(p.numel() for p in model.parameters()),
        "update_gap_rel": gap,
        "ours_step_s_median": statistics.median(times["ours"]),
        "hand_step_s_median": statistics.median(times["hand"]),
        "ours_step_s": times["ours"],
        "hand_step_s": times["hand"],
        "time_ratio_median": ratio,
        "time_ratio_q1": q1,
        "time_ratio_q3": q3,
        "time_ratio_of_medians": statistics.median(times["ours"])
        / statistics.median(times["hand"]),
        "aa_ratio_median": aa_ratio,
        "checked_ratio_median": checked_ratio,
        "aa_ratio_q1": aa_q1,
        "aa_ratio_q3": aa_q3,
        "peak_bytes_ours": peak_ours,
        "peak_bytes_hand": peak_hand,
        "peak_bytes_whole_batch": peak_whole,
        "memory_ratio": peak_ours / peak_hand,
        "saved_activation_bytes_micro": saved_micro,
        "saved_activation_bytes_whole": saved_whole,
    }


def kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB"


def print_report(results: dict[str, dict], settings: dict) -> None:
    print(
        f"torch {torch.__version__} | Python {platform.python_version()} | CPU, "
        f"torch.set_num_threads({THREADS}) | {settings['repeats']} interleaved repeats x "
        f"{settings['steps_per_repeat']} steps each, after {settings['warmup']} warm-up steps"
    )
    if settings.get("processes", 1) > 1:
        print(
            f"timed in {settings['processes']} fresh processes; each figure is the median over "
            "processes of that process's median; IQR = over processes"
        )
    print("ratio = median over repeats of (ours block time / hand block time), same repeat;")
    print("A/A   = the same for the hand loop against itself: the harness's noise floor")
    print("peak  = max bytes of CPU tensor storage allocated during one step and alive at once")
    print()
    header = (
        f"{'model':<5} {'ours ms':>8} {'hand ms':>8} {'ratio':>6} {'IQR':>11} {'A/A':>6} "
        f"{'peak ours':>11} {'peak hand':>11} {'mem ratio':>9} {'no-accum peak':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        iqr = f"{r['time_ratio_q1']:.3f}-{r['time_ratio_q3']:.3f}"
        print(
            f"{name:<5} {r['ours_step_s_median'] * 1e3:>8.2f} {r['hand_step_s_median'] * 1e3:>8.2f}"
            f" {r['time_ratio_median']:>6.3f} {iqr:>11} {r['aa_ratio_median']:>6.3f}"
            f" {kib(r['peak_bytes_ours']):>11}"
            f" {kib(r['peak_bytes_hand']):>11} {r['memory_ratio']:>9.3f}"
            f" {kib(r['peak_bytes_whole_batch']):>13}"
        )
    print()
    for name, r in results.items():
        print(f"{name}: {r['description']}, {r['parameters']:,} parameters")
        print(
            f"  same update as the hand loop: max |ours - hand| / max |update| = "
            f"{r['update_gap_rel']:.1e} (one SGD step, float64)"
        )
        print(
            "  meter check: saved-for-backward activations "
            f"{kib(r['saved_activation_bytes_micro'])} per micro-batch of {r['micro_batch_size']}, "
            f"{kib(r['saved_activation_bytes_whole'])} for the batch of {r['batch_size']}; "
            f"peak without accumulation {kib(r['peak_bytes_whole_batch'])}"
        )
    print()
    for name, r in results.items():
        if "process_ratios" in r:
            listed = " ".join(f"{ratio:.3f}" for ratio in r["process_ratios"])
            print(f"{name} step-time ratio per process: {listed}")
    for name, r in results.items():
        verdict = "within" if r["time_ratio_median"] <= TARGET else "ABOVE"
        print(
            f"{name} step-time ratio (ours/hand): {r['time_ratio_median']:.3f} "
            f"({verdict} target {TARGET})"
        )
        print(
            f"{name} step-time ratio (ours/hand with loss logging and finite check): "
            f"{r['checked_ratio_median']:.3f}"
        )
        print(f"{name} peak-memory ratio (ours/hand): {r['memory_ratio']:.3f}")


def profile_targets(model: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[object, str, str]]:
    """What `--profile` times: the work both loops share (labels starting with `=`: the model's
    forward, the loss, backward, the optimizer), and the library's functions where they are
    looked up."""
    from gradaccum import _engine, accumulator, batchnorm, precision, sync, window

    targets: list[tuple[object, str, str]] = [
        (type(model), "forward", "= model forward"),
        (F, "cross_entropy", "= cross_entropy"),
        (torch.autograd, "backward", "= backward"),
        (type(opt), "step", "= optimizer.step"),
        (torch.nn.utils, "get_total_norm", "norms.py: torch get_total_norm"),
    ]
    targets = [t for t in targets if hasattr(t[0], t[1])]  # get_total_norm is new in torch 2.6
    owners = (
        (accumulator, accumulator.Accumulator),
        (_engine, _engine.Engine),
        (window, window.Window),
        (precision, precision.PrecisionRuntime),
        (sync, sync.LocalSync),
        (batchnorm, batchnorm.BatchNormControl),
    )
    for module, owner in owners:
        for name, value in vars(owner).items():
            if inspect.isfunction(value) and name not in ("__init__", "state_dict"):
                targets.append((owner, name, f"{module.__name__[10:]}.py: {name}"))
    for module in (accumulator, _engine, window):
        for name, value in vars(module).items():
            if inspect.isfunction(value) and value.__module__.startswith("gradaccum."):
                if value.__module__ == module.__name__:
                    continue
                targets.append((module, name, f"{value.__module__[10:]}.py: {name}"))
    return targets


def profile_case(case: Case, steps: int) -> None:
    """Self time per function inside real steps, ours and hand, with everything else at speed.

    The user's loss code other than the model and `cross_entropy` (unpacking the batch,
    counting tokens) runs inside `_engine.py: _micro_batch` for ours, and in the loop for hand.
    """
    torch.manual_seed(2)
    model = case.make_model()
    opt = new_optimizer(model)
    acc = Accumulator(model, opt, micro_batch_size=case.micro)
    loops = {
        "ours": lambda: acc.step(case.batch, case.loss_fn),
        "hand": lambda: case.hand_step(model, opt, case.batch, case.micro),
    }
    seconds: dict[str, dict[str, float]] = {name: {} for name in loops}
    totals = dict.fromkeys(loops, 0.0)
    missing: list[str] = []
    for loop in loops.values():
        for _ in range(3):
            loop()
    chunks = 4  # alternate ours and hand in chunks, so drift of the machine falls on both
    steps = max(chunks, steps - steps % chunks)
    for chunk in range(chunks):
        for name in loops if chunk % 2 == 0 else list(loops)[::-1]:
            with attributed_time(profile_targets(model, opt)) as calls:
                started = time.perf_counter()
                for _ in range(steps // chunks):
                    loops[name]()
                elapsed = time.perf_counter() - started
            totals[name] += elapsed
            calls.seconds["(loop code outside timed calls)"] = elapsed - sum(calls.seconds.values())
            for label, value in calls.seconds.items():
                seconds[name][label] = seconds[name].get(label, 0.0) + value
            missing = calls.missing
    labels = sorted(
        set(seconds["ours"]) | set(seconds["hand"]),
        key=lambda label: (not label.startswith("="), -seconds["ours"].get(label, 0.0)),
    )
    print(
        f"\n=== {case.name}: self time per step, us, over {steps} steps each "
        "(library functions in situ, everything else at full speed) ==="
    )
    print(f"  {'':<46} {'ours':>9} {'hand':>9}")
    for label in labels:
        ours_us, hand_us = (seconds[k].get(label, 0.0) / steps * 1e6 for k in ("ours", "hand"))
        print(f"  {label:<46} {ours_us:9.1f} {hand_us:9.1f}")
    shared = {k: sum(t for lb, t in seconds[k].items() if lb.startswith("=")) for k in loops}
    rest = {k: (totals[k] - shared[k]) / steps * 1e6 for k in loops}
    print(
        f"  {'total per step':<46} {totals['ours'] / steps * 1e6:9.1f} "
        f"{totals['hand'] / steps * 1e6:9.1f}"
    )
    print(
        f"  {'all but the = lines':<46} {rest['ours']:9.1f} {rest['hand']:9.1f}"
        f"   difference {rest['ours'] - rest['hand']:.1f} us/step"
    )
    if missing:
        print(f"  (not found, not timed: {', '.join(missing)})")


def run_in_process(repeats: int, steps: int, quick: bool) -> dict[str, dict]:
    """Every case timed in a fresh interpreter (`--processes 1`): its results, from JSON.

    A process's memory layout (where the allocator puts activations and gradients) moves a
    step's time by a few percent, and it is fixed for the process's life: alternating inside one
    process cannot average it out, fresh processes do.
    """
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "figures.json"
        command = [sys.executable, __file__, "--processes", "1", "--repeats", str(repeats)]
        command += ["--steps", str(steps), "--json", str(out), *(["--quick"] if quick else [])]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        results: dict[str, dict] = json.loads(out.read_text())["results"]
        return results


def combine_processes(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """The first process's figures, with each timing replaced by its median over processes."""
    combined = {}
    for name, first in runs[0].items():
        merged = dict(first)
        for key in (
            "time_ratio_median",
            "aa_ratio_median",
            "checked_ratio_median",
            "ours_step_s_median",
            "hand_step_s_median",
        ):
            merged[key] = statistics.median(run[name][key] for run in runs)
        ratios = [run[name]["time_ratio_median"] for run in runs]
        merged["process_ratios"] = ratios
        merged["time_ratio_q1"], _, merged["time_ratio_q3"] = quartiles(ratios)
        merged["time_ratio_of_medians"] = (
            merged["ours_step_s_median"] / merged["hand_step_s_median"]
        )
        merged["ours_step_s"] = [t for run in runs for t in run[name]["ours_step_s"]]
        merged["hand_step_s"] = [t for run in runs for t in run[name]["hand_step_s"]]
        combined[name] = merged
    return combined


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed blocks per loop")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--profile", action="store_true", help="also time the library's functions in situ"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="fresh processes to time in, the median of their ratios reported (default 5)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        repeats, steps, warmup, mem_rounds, processes = 2, 1, 1, 1, 1
    else:
        repeats, steps, warmup, mem_rounds, processes = 10, 10, 5, 3, 5
    if args.processes is not None:
        if args.processes < 1:
            parser.error("--processes must be >= 1")
        processes = args.processes
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error("--repeats must be >= 1")
        repeats = args.repeats
    if args.steps is not None:
        if args.steps < 1:
            parser.error("--steps must be >= 1")
        steps = args.steps

    torch.set_num_threads(THREADS)
    cases = make_cases()
    started = time.perf_counter()
    if processes == 1:
        results = {c.name: run_case(c, repeats, steps, warmup, mem_rounds) for c in cases}
    else:
        runs = [run_in_process(repeats, steps, args.quick) for _ in range(processes)]
        results = combine_processes(runs)
    settings = {
        "processes": processes,
        "repeats": repeats,
        "steps_per_repeat": steps,
        "warmup": warmup,
        "memory_rounds": mem_rounds,
        "threads": THREADS,
        "target_time_ratio": TARGET,
    }
    print_report(results, settings)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    if args.profile:
        for case in cases:
            profile_case(case, steps=max(20, repeats * steps // 3))
    if args.json:
        payload = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "settings": settings,
            "results": results,
        }
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(payload, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
