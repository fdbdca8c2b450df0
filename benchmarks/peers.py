"""gradaccum against its peers: step time, peak memory and exactness, in one run.

Five ways to take one optimizer step over a window of micro-batches, each written the way its own
documentation teaches, on the two models of `benchmarks/overhead.py` (imported from it: the CNN,
batch 64 in micro-batches of 16, and the tiny transformer LM, batch 32 in micro-batches of 8,
padded labels, token-level loss), AdamW, on CPU with `torch.set_num_threads(1)`:

1. `gradaccum step`: `Accumulator(model, opt, micro_batch_size=m).step(batch, loss_fn)`, the
   whole batch given at once (`loss_fn` returns a mean for the CNN, `LossSum(sum, tokens)` for
   the LM);
2. `gradaccum micro_step`: `Accumulator(model, opt, accumulation_steps=4)` fed the same
   micro-batches one `micro_step(micro_batch, loss_fn)` at a time (the streaming drive);
3. `hand`: the correct hand-written loop of overhead.py (`loss * n_i / B`, or the LM's summed
   loss over the window's token count), nothing read back;
4. `accelerate`: Hugging Face Accelerate's recipe, `Accelerator(gradient_accumulation_steps=4)`,
   `prepare(model, optimizer)`, and per micro-batch `with accelerator.accumulate(model):` forward,
   `accelerator.backward(loss)`, `optimizer.step()`, `optimizer.zero_grad()`. The CNN's loss is the
   micro-batch mean (`backward` divides it by 4); the LM's is the documented handling for token
   losses ("gradient accumulation on training samples of variable size"): the window's token
   count `num_items_in_batch` is counted first, and each summed loss is multiplied by
   `gradient_accumulation_steps * num_processes` and divided by it;
5. `fabric`: Lightning Fabric's recipe, `fabric.setup(model, optimizer)`, and per micro-batch
   `with fabric.no_backward_sync(model, enabled=is_accumulating):` forward and
   `fabric.backward(loss)`, then `optimizer.step()` and `optimizer.zero_grad()` at the end of the
   window. Fabric does not scale the loss: the CNN's mean is divided by 4, and the LM's summed
   loss by the window's token count (Fabric's docs give no token-loss recipe; this is the
   correct one). The docs write `is_accumulating = iteration % 8 != 0`, which steps after the
   very first micro-batch; the windows here use `(iteration + 1) % 4 != 0` so that they line up
   with the others (the exactness section also runs the loop as printed).

Before timing, each contender takes one float64 SGD step from identical copies; its parameter
difference to the hand loop's step is printed relative to the largest update (all take the same
step).

Table 1, speed and memory, per model:
- time: every contender, plus the hand loop again under another name (A/A, the harness's noise
  floor), runs `--steps` timed optimizer steps per repeat, the contenders interleaved call by
  call, their order shuffled every round (`_measure.interleaved_times`), on ONE shared model
  and optimizer (so all see the same memory layout). Printed: median seconds per optimizer step,
  and the median over repeats of (contender time / hand time in the same repeat),
  with its interquartile range;
- tensor peak: `_measure.peak_allocated_bytes`, the largest number of bytes of CPU tensor storage
  allocated during one step and alive at once (profiler allocator events), gradients set to None
  first, median of a few steps;
- RSS growth: in a fresh subprocess per (model, contender), after imports, data and a warm-up of
  the contender on another copy of the model, the resident size is read (`VmRSS`), the high-water
  mark reset (`5` written to /proc/self/clear_refs), then the model, optimizer and the
  contender's wrappers are built and 3 steps run; printed: `VmHWM` minus that baseline (so it
  includes parameters, gradients, AdamW state and activations), median over rounds. The
  subprocesses run with `MALLOC_MMAP_THRESHOLD_=131072` so that glibc returns freed tensor memory
  at once and RSS follows live memory (see docs/memory.md);
- CUDA peak: `n/a`, the contenders run on CPU here.

Table 2, exactness: the LM in float64, 3 windows of 30 rows split 8 + 8 + 8 + 6, the rows of
each micro-batch drawn from a different length range, so the micro-batches count very different
numbers of tokens (printed). Each contender (and each documented loss variant of the peers, and
Fabric's loop exactly as its docs print it) runs 3 AdamW steps from the same initial parameters;
the reference is plain PyTorch taking one step per window on the whole batch with the token-mean
loss. Printed: the optimizer steps taken; `param gap`, ||params - reference|| / ||reference|| over
all parameters; `worst tensor`, the largest over tensors of max |p - p_ref| / max |p_ref|; and
the same for the gradient the optimizer saw at its first step. The default dtype is float64
during these runs: Fabric's `64-true` precision casts a model's outputs back to the default
dtype, which would otherwise put float32 rounding into its loss.

Usage (from the repository root; needs the `bench` extra: `pip install -e '.[bench]'`):
    python benchmarks/peers.py [--quick] [--repeats N] [--steps N] [--json PATH]

`--quick` runs 2 repeats of 1 step and one RSS round (a smoke test, seconds of timing). The
default is 20 repeats of 10 steps and 3 RSS rounds. docs/benchmarks.md ("Peers") shows a run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradaccum
from _measure import interleaved_times, paired_ratios, peak_allocated_bytes, quartiles
from gradaccum import Accumulator, LossSum, split_batch
from gradaccum.batching import map_tensors
from overhead import IGNORE, SEQ, VOCAB, Case, TinyLM, lm_loss_sum, make_cases, new_optimizer

ROOT = Path(__file__).resolve().parents[1]
THREADS = 1
WINDOW = 4  # micro-batches per optimizer step, for every model and the exactness windows
EXACT = 1e-10  # a gap below this is float64 rounding
RSS_STEPS = 3
MMAP_THRESHOLD = "131072"
RSS_PARALLEL = 2
CONTENDERS = ("gradaccum step", "gradaccum micro_step", "hand", "accelerate", "fabric")
AA = "hand (A/A)"
PEER_PACKAGES = ("accelerate", "lightning")

Batch = Any
Step = Callable[[], object]


# --- the peers' objects, created once per process -------------------------------------------


class Peers:
    """One Accelerator and one Fabric per precision, created on first use.

    Accelerate keeps its accumulation state (`GradientState`) process-wide, so one Accelerator
    serves every model; every window here is exactly `WINDOW` micro-batches, which keeps its
    step counter aligned with the windows (checked after timing).
    """

    def __init__(self) -> None:
        self._accelerator: Any = None
        self._fabrics: dict[torch.dtype, Any] = {}

    @property
    def accelerator(self) -> Any:
        if self._accelerator is None:
            from accelerate import Accelerator

            self._accelerator = Accelerator(cpu=True, gradient_accumulation_steps=WINDOW)
            torch.set_num_threads(THREADS)
        return self._accelerator

    def fabric(self, dtype: torch.dtype) -> Any:
        if dtype not in self._fabrics:
            from lightning.fabric import Fabric

            precision = "64-true" if dtype == torch.float64 else "32-true"
            self._fabrics[dtype] = Fabric(accelerator="cpu", devices=1, precision=precision)
            torch.set_num_threads(THREADS)
        return self._fabrics[dtype]


# --- losses as the peers' recipes write them ------------------------------------------------


def micro_mean(model: nn.Module, micro_batch: Batch) -> torch.Tensor:
    """The micro-batch's own mean: per sample (CNN) or per counted token (LM)."""
    if isinstance(micro_batch, dict):
        logits = model(micro_batch["input"])
        labels = micro_batch["labels"]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    x, y = micro_batch
    return F.cross_entropy(model(x), y)


def micro_sum(model: nn.Module, micro_batch: Batch) -> torch.Tensor:
    """The LM's summed token loss over one micro-batch."""
    return lm_loss_sum(model, micro_batch["input"], micro_batch["labels"])


def window_tokens(micro_batches: Sequence[Batch]) -> torch.Tensor:
    """Counted (non-ignored) labels over a window's micro-batches."""
    return sum(((mb["labels"] != IGNORE).sum() for mb in micro_batches), torch.tensor(0))


# --- the windows: one optimizer step each ----------------------------------------------------


def accelerate_window(
    accelerator: Any, model: nn.Module, opt: Any, micro_batches: Sequence[Batch], loss: str
) -> None:
    """Accelerate's `accumulate()` recipe over one window.

    `loss="mean"`: each micro-batch's own mean (the recipe's `loss_function`);
    `loss="count"`: the docs' handling for token losses (`num_items_in_batch`).
    """
    if loss == "count":
        local = window_tokens(micro_batches)
        num_items = accelerator.gather(local).sum().item()
        factor = accelerator.gradient_accumulation_steps * accelerator.num_processes
    for micro_batch in micro_batches:
        with accelerator.accumulate(model):
            if loss == "count":
                value = (micro_sum(model, micro_batch) * factor) / num_items
            else:
                value = micro_mean(model, micro_batch)
            accelerator.backward(value)
            opt.step()
            opt.zero_grad()


def accelerate_skeleton(
    accelerator: Any, model: nn.Module, opt: Any, micro_batches: Sequence[Batch]
) -> None:
    """The docs' "training samples of variable size" skeleton as printed: no `accumulate()`,
    `no_sync` on all but the last micro-batch when there are several processes."""
    local = window_tokens(micro_batches)
    num_items = accelerator.gather(local).sum().item()
    for i, micro_batch in enumerate(micro_batches):
        several = i < len(micro_batches) - 1 and accelerator.num_processes > 1
        ctx = model.no_sync if several else contextlib.nullcontext
        with ctx():
            value = micro_sum(model, micro_batch)
            value = (
                value * accelerator.gradient_accumulation_steps * accelerator.num_processes
            ) / num_items
            accelerator.backward(value)
    opt.step()
    opt.zero_grad()


def fabric_loop(
    fabric: Any,
    model: nn.Module,
    opt: Any,
    micro_batches: Sequence[Batch],
    loss: str,
    as_printed: bool = False,
) -> None:
    """Fabric's `no_backward_sync` recipe over `micro_batches` (one window or several).

    `loss="mean"`: each micro-batch's mean / WINDOW; `loss="count"`: the summed loss over its
    window's token count. `as_printed=True` keeps the docs' `iteration % k != 0`.
    """
    counts: list[torch.Tensor] = []
    if loss == "count":
        for start in range(0, len(micro_batches), WINDOW):
            window = micro_batches[start : start + WINDOW]
            counts += [window_tokens(window)] * len(window)
    for iteration, micro_batch in enumerate(micro_batches):
        # The docs print `iteration % 8 != 0`, which steps after the first micro-batch.
        position = iteration if as_printed else iteration + 1
        is_accumulating = position % WINDOW != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            if loss == "count":
                value = micro_sum(model, micro_batch) / counts[iteration]
            else:
                value = micro_mean(model, micro_batch) / WINDOW
            fabric.backward(value)
        if not is_accumulating:
            opt.step()
            opt.zero_grad()


def build_contender(
    name: str, case: Case, model: nn.Module, opt: torch.optim.Optimizer, peers: Peers
) -> Step:
    """One optimizer step on `case.batch` by contender `name`, on `model` and `opt`.

    The micro-batches of the streaming contenders are split beforehand, as a data loader would
    hand them over; `gradaccum step` splits the batch itself and the hand loop slices it.
    """
    dtype = next(model.parameters()).dtype
    batch = case.batch
    if dtype == torch.float64:
        batch = map_tensors(batch, lambda t: t.double() if t.is_floating_point() else t)
    micro_batches = split_batch(batch, case.micro)
    assert len(micro_batches) == WINDOW, (case.name, len(micro_batches))
    token_loss = isinstance(batch, dict)
    if name == "gradaccum step":
        acc = Accumulator(model, opt, micro_batch_size=case.micro)
        return lambda: acc.step(batch, case.loss_fn)
    if name == "gradaccum micro_step":
        streamed = Accumulator(model, opt, accumulation_steps=WINDOW)

        def micro_steps() -> None:
            for micro_batch in micro_batches:
                streamed.micro_step(micro_batch, case.loss_fn)

        return micro_steps
    if name in ("hand", AA):
        return lambda: case.hand_step(model, opt, batch, case.micro)
    if name == "accelerate":
        accelerator = peers.accelerator
        prepared_model, prepared_opt = accelerator.prepare(model, opt)
        loss = "count" if token_loss else "mean"
        return lambda: accelerate_window(
            accelerator, prepared_model, prepared_opt, micro_batches, loss
        )
    if name == "fabric":
        fabric = peers.fabric(dtype)
        fabric_model, fabric_opt = fabric.setup(model, opt)
        loss = "count" if token_loss else "mean"
        return lambda: fabric_loop(fabric, fabric_model, fabric_opt, micro_batches, loss)
    raise ValueError(f"unknown contender {name!r}")


# --- table 1: time and memory -----------------------------------------------------------------


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Float64 runs: Fabric's `64-true` casts a model's outputs back to the default dtype, so
    with float32 as the default its loss (and every gradient) would carry float32 rounding."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def update_gaps(case: Case, peers: Peers) -> dict[str, float]:
    """Per contender, max |its step - hand's step| / max |hand's update|: one float64 SGD step
    from identical copies (SGD keeps the update proportional to the gradient)."""
    torch.manual_seed(1)
    base = case.make_model().double()
    after: dict[str, list[torch.Tensor]] = {}
    with default_dtype(torch.float64):
        for name in CONTENDERS:
            model = copy.deepcopy(base)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            build_contender(name, case, model, opt, peers)()
            after[name] = [p.detach().clone() for p in model.parameters()]
    scale = max(
        float((p - p0.detach()).abs().max())
        for p, p0 in zip(after["hand"], base.parameters(), strict=True)
    )
    return {
        name: max(float((p - h).abs().max()) for p, h in zip(params, after["hand"], strict=True))
        / scale
        for name, params in after.items()
    }


def tensor_peak(step: Step, model: nn.Module, rounds: int) -> int:
    """Median over `rounds` of the peak CPU tensor bytes allocated during one step."""
    peaks = []
    for _ in range(rounds):
        model.zero_grad(set_to_none=True)
        gc.collect()
        peaks.append(peak_allocated_bytes(step).peak_bytes)
    return int(statistics.median(peaks))


def run_case(case: Case, peers: Peers, repeats: int, steps: int, warmup: int, rounds: int) -> dict:
    gaps = update_gaps(case, peers)
    torch.manual_seed(2)
    model = case.make_model()
    opt = new_optimizer(model)
    candidates = {name: build_contender(name, case, model, opt, peers) for name in CONTENDERS}
    candidates[AA] = build_contender(AA, case, model, opt, peers)
    torch.set_num_threads(THREADS)
    gc.collect()
    times = interleaved_times(candidates, repeats=repeats, steps_per_repeat=steps, warmup=warmup)
    if peers.accelerator.step % WINDOW != 0:
        raise RuntimeError("Accelerate's step counter left its windows: a step was skipped")
    peaks = {name: tensor_peak(candidates[name], model, rounds) for name in CONTENDERS}
    model.zero_grad(set_to_none=True)
    rows = {}
    for name in (*CONTENDERS, AA):
        q1, ratio, q3 = quartiles(paired_ratios(times[name], times["hand"]))
        rows[name] = {
            "step_s_median": statistics.median(times[name]),
            "step_s": times[name],
            "ratio_median": ratio,
            "ratio_q1": q1,
            "ratio_q3": q3,
            "tensor_peak_bytes": peaks.get(name),
            "update_gap_vs_hand": gaps.get(name),
        }
    return {
        "description": case.description,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch_size": case.batch_size,
        "micro_batch_size": case.micro,
        "contenders": rows,
    }


# --- resident memory, in fresh subprocesses ---------------------------------------------------


def status_bytes(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert match is not None, field
    return int(match.group(1)) * 1024


def rss_child(spec: dict[str, str]) -> None:
    """In a fresh process: the RSS high-water growth of RSS_STEPS steps of one contender."""
    torch.set_num_threads(THREADS)
    case = next(c for c in make_cases() if c.name == spec["case"])
    peers = Peers()
    torch.manual_seed(3)
    warm = case.make_model()
    warm_step = build_contender(spec["contender"], case, warm, new_optimizer(warm), peers)
    for _ in range(2):
        warm_step()
    del warm_step
    gc.collect()
    baseline = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here
    torch.manual_seed(2)
    model = case.make_model()
    step = build_contender(spec["contender"], case, model, new_optimizer(model), peers)
    for _ in range(RSS_STEPS):
        step()
    print(json.dumps({"peak": status_bytes("VmHWM") - baseline}))


def rss_growth(case: str, contender: str) -> int | None:
    if not os.access("/proc/self/clear_refs", os.W_OK):
        return None
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    spec = json.dumps({"case": case, "contender": contender})
    proc = subprocess.run(
        [sys.executable, __file__, "--rss-child", spec],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"RSS subprocess {case}/{contender} failed:\n{proc.stderr[-3000:]}")
    peak: int = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
    return peak


def add_rss(results: dict[str, dict], rounds: int) -> None:
    """RSS growth per (model, contender): median over `rounds`, two subprocesses at a time.

    Resident memory does not depend on what else runs, so the subprocesses may overlap (they
    run after the timing, never during it).
    """
    pairs = [(case, name) for case in results for name in CONTENDERS]
    jobs = [
        pair for round_ in range(rounds) for pair in (pairs if round_ % 2 == 0 else pairs[::-1])
    ]
    with ThreadPoolExecutor(max_workers=RSS_PARALLEL) as pool:
        peaks = list(pool.map(lambda job: rss_growth(*job), jobs))
    samples: dict[tuple[str, str], list[int]] = {}
    for job, peak in zip(jobs, peaks, strict=True):
        if peak is not None:
            samples.setdefault(job, []).append(peak)
    for case, name in pairs:
        values = samples.get((case, name))
        row = results[case]["contenders"][name]
        row["rss_growth_bytes"] = int(statistics.median(values)) if values else None
        row["rss_growth_samples"] = values


# --- table 2: exactness on ragged token micro-batches ----------------------------------------

# Rows per micro-batch and the length range of its rows: the micro-batches of one window count
# very different numbers of tokens, as length-bucketed or unsorted real data does.
RAGGED_ROWS = (8, 8, 8, 6)
RAGGED_LENGTHS = ((4, 12), (16, 32), (40, 64), (8, 64))
RAGGED_MICRO = 8


def ragged_windows(windows: int = 3, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """`windows` LM batches of 30 right-padded rows (labels -100 past each row's length)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for w in range(windows):
        ranges = RAGGED_LENGTHS[w % 4 :] + RAGGED_LENGTHS[: w % 4]
        lengths = torch.cat(
            [
                torch.randint(lo, hi + 1, (n,), generator=gen)
                for (lo, hi), n in zip(ranges, RAGGED_ROWS, strict=True)
            ]
        )
        rows = sum(RAGGED_ROWS)
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
        labels = tokens[:, 1:].clone()
        labels[torch.arange(SEQ)[None, :] >= lengths[:, None]] = IGNORE
        batches.append({"input": tokens[:, :-1].contiguous(), "labels": labels})
    return batches


def lm_token_sum(model: nn.Module, batch: Batch) -> LossSum:
    labels = batch["labels"]
    return LossSum(micro_sum(model, batch), (labels != IGNORE).sum())


Variant = Callable[[nn.Module, torch.optim.Optimizer, list[dict[str, torch.Tensor]]], None]


def exactness_variants(peers: Peers) -> dict[str, tuple[str, Variant]]:
    """Name -> (the loss as written, a function running every window on model and optimizer)."""

    def split(batches: list[dict[str, torch.Tensor]]) -> list[list[dict[str, torch.Tensor]]]:
        windows = [split_batch(b, RAGGED_MICRO) for b in batches]
        assert all(len(w) == WINDOW for w in windows)
        return windows

    def ours_step(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
        acc = Accumulator(model, opt, micro_batch_size=RAGGED_MICRO)
        for batch in batches:
            acc.step(batch, lm_token_sum)

    def ours_micro(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
        acc = Accumulator(model, opt, accumulation_steps=WINDOW)
        for window in split(batches):
            for micro_batch in window:
                acc.micro_step(micro_batch, lm_token_sum)

    def hand(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
        for window in split(batches):
            tokens = window_tokens(window)
            opt.zero_grad(set_to_none=True)
            for micro_batch in window:
                (micro_sum(model, micro_batch) / tokens).backward()
            opt.step()

    def accelerate(loss: str) -> Variant:
        def run(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
            prepared_model, prepared_opt = peers.accelerator.prepare(model, opt)
            for window in split(batches):
                accelerate_window(peers.accelerator, prepared_model, prepared_opt, window, loss)

        return run

    def skeleton(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
        prepared_model, prepared_opt = peers.accelerator.prepare(model, opt)
        for window in split(batches):
            accelerate_skeleton(peers.accelerator, prepared_model, prepared_opt, window)

    def fabric(loss: str, as_printed: bool = False) -> Variant:
        def run(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
            fab = peers.fabric(torch.float64)
            fabric_model, fabric_opt = fab.setup(model, opt)
            stream = [mb for window in split(batches) for mb in window]
            fabric_loop(fab, fabric_model, fabric_opt, stream, loss, as_printed)

        return run

    return {
        "gradaccum step": ("LossSum(sum, tokens)", ours_step),
        "gradaccum micro_step": ("LossSum(sum, tokens)", ours_micro),
        "hand": ("sum / window tokens", hand),
        "accelerate, token mean": ("micro-batch token mean", accelerate("mean")),
        "accelerate, num_items": ("sum * 4 / window tokens", accelerate("count")),
        "accelerate, skeleton": ("sum * 4 / window tokens", skeleton),
        "fabric, token mean / 4": ("micro-batch token mean / 4", fabric("mean")),
        "fabric, sum / tokens": ("sum / window tokens", fabric("count")),
        "fabric, as printed": ("sum / window tokens", fabric("count", as_printed=True)),
    }


EXACTNESS_NOTES = {
    "gradaccum step": "Accumulator.step(batch), micro_batch_size=8",
    "gradaccum micro_step": "Accumulator.micro_step, accumulation_steps=4",
    "hand": "correct hand loop (table 1's)",
    "accelerate, token mean": "accumulate() recipe, its loss_function a mean",
    "accelerate, num_items": "accumulate() + docs' token-loss handling (table 1's)",
    "accelerate, skeleton": "docs' variable-size skeleton, no accumulate()",
    "fabric, token mean / 4": "no_backward_sync recipe, mean / steps",
    "fabric, sum / tokens": "no_backward_sync, tokens counted by hand (table 1's)",
    "fabric, as printed": "docs' loop as printed: iteration % 4 != 0",
}


def worst_tensor_gap(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """Largest over tensors of max |actual - expected| / max |expected| (absolute where 0)."""
    worst = 0.0
    for got, want in zip(actual, expected, strict=True):
        diff = float((got.double() - want.double()).abs().max())
        scale = float(want.double().abs().max())
        gap = diff / scale if scale > 0 else diff
        worst = max(worst, math.inf if math.isnan(gap) else gap)
    return worst


def global_gap(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """||actual - expected|| / ||expected||, all tensors taken as one vector."""
    diff = torch.cat(
        [(a.double() - e.double()).flatten() for a, e in zip(actual, expected, strict=True)]
    )
    scale = float(torch.cat([e.double().flatten() for e in expected]).norm())
    gap = float(diff.norm()) / scale
    return math.inf if math.isnan(gap) else gap


def run_recorded(
    base: nn.Module, run: Callable[[nn.Module, torch.optim.Optimizer], None]
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Parameters after `run` on a copy of `base`, and the gradients at each optimizer step."""
    model = copy.deepcopy(base)
    opt = new_optimizer(model)
    grads: list[list[torch.Tensor]] = []

    def record(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads.append(
            [
                torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                for p in model.parameters()
            ]
        )

    opt.register_step_pre_hook(record)
    run(model, opt)
    return [p.detach().clone() for p in model.parameters()], grads


def exactness(peers: Peers) -> dict:
    batches = ragged_windows()
    torch.manual_seed(4)
    base = TinyLM().double()

    def reference(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            logits = model(batch["input"])
            F.cross_entropy(
                logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE
            ).backward()
            opt.step()

    with default_dtype(torch.float64):
        ref_params, ref_grads = run_recorded(base, reference)
        runs = {
            name: run_recorded(base, lambda m, o, v=variant: v(m, o, batches))
            for name, (_, variant) in exactness_variants(peers).items()
        }
    rows = {}
    for name, (loss, _) in exactness_variants(peers).items():
        params, grads = runs[name]
        rows[name] = {
            "loss": loss,
            "how": EXACTNESS_NOTES[name],
            "optimizer_steps": len(grads),
            "grad_gap_window_1": worst_tensor_gap(grads[0], ref_grads[0]) if grads else math.inf,
            "param_gap": global_gap(params, ref_params),
            "param_gap_worst_tensor": worst_tensor_gap(params, ref_params),
        }
    tokens = [
        [int((mb["labels"] != IGNORE).sum()) for mb in split_batch(b, RAGGED_MICRO)]
        for b in batches
    ]
    return {"tokens_per_micro_batch": tokens, "rows": rows}


# --- report -------------------------------------------------------------------------------------


def kib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 1024:,.0f} KiB"


def versions() -> dict[str, str]:
    import accelerate
    import lightning

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gradaccum": gradaccum.__version__ if hasattr(gradaccum, "__version__") else "dev",
        "accelerate": accelerate.__version__,
        "lightning": lightning.__version__,
    }


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_speed(results: dict[str, dict], settings: dict) -> None:
    print(
        f"Table 1: time and memory per optimizer step (4 micro-batches), AdamW, CPU, "
        f"{settings['repeats']} interleaved repeats x {settings['steps']} steps after "
        f"{settings['warmup']} warm-up steps"
    )
    header = (
        f"{'model':<5} {'contender':<21} {'ms/step':>8} {'vs hand':>7} {'IQR':>11} "
        f"{'tensor peak':>11} {'RSS growth':>11} {'CUDA peak':>9}"
    )
    print(header)
    print("-" * len(header))
    for case, r in results.items():
        for name in (*CONTENDERS, AA):
            row = r["contenders"][name]
            iqr = f"{row['ratio_q1']:.3f}-{row['ratio_q3']:.3f}"
            print(
                f"{case:<5} {name:<21} {row['step_s_median'] * 1e3:>8.2f} "
                f"{row['ratio_median']:>7.3f} {iqr:>11} {kib(row['tensor_peak_bytes']):>11} "
                f"{kib(row.get('rss_growth_bytes')):>11} {'n/a':>9}"
            )
    print()
    print("vs hand = median over repeats of (block time / hand block time, same repeat);")
    print(f"{AA} = the hand loop timed again under another name: the harness's noise floor.")
    print("tensor peak = max bytes of CPU tensor storage allocated during one step, alive at once")
    print(
        f"RSS growth = VmHWM over {RSS_STEPS} steps minus VmRSS before the model was built, in a "
        f"fresh process per row (MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}), median of "
        f"{settings['rss_rounds']} round(s)"
    )
    print("CUDA peak = n/a: the contenders run on CPU (no GPU on this machine).")
    for case, r in results.items():
        gaps = ", ".join(
            f"{name} {r['contenders'][name]['update_gap_vs_hand']:.1e}" for name in CONTENDERS
        )
        print(f"{case}: {r['description']}, {r['parameters']:,} parameters")
        print(f"  same step as the hand loop (float64 SGD, gap / update): {gaps}")


def print_exactness(report: dict) -> None:
    print(
        "Table 2: exactness on ragged token micro-batches: tiny LM, float64, 3 AdamW steps, "
        "windows of 30 rows split 8+8+8+6"
    )
    tokens = "; ".join(
        "+".join(str(t) for t in window) for window in report["tokens_per_micro_batch"]
    )
    print(f"tokens counted per micro-batch, windows 1-3: {tokens}")
    print("reference: plain PyTorch, one step per window on the whole batch, token-mean loss")
    header = (
        f"{'contender':<24} {'loss as written':<27} {'steps':>5} {'grad gap w1':>11} "
        f"{'param gap':>9} {'worst tensor':>12}  verdict"
    )
    print(header)
    print("-" * (len(header) + 8))
    for name, row in report["rows"].items():
        verdict = "exact" if row["param_gap_worst_tensor"] < EXACT else "NOT exact"
        print(
            f"{name:<24} {row['loss']:<27} {row['optimizer_steps']:>5} "
            f"{row['grad_gap_window_1']:>11.1e} {row['param_gap']:>9.1e} "
            f"{row['param_gap_worst_tensor']:>12.1e}  {verdict}"
        )
    print()
    for name, row in report["rows"].items():
        print(f"  {name}: {row['how']}")
    print("param gap = ||params - reference|| / ||reference||, all parameters as one vector;")
    print("worst tensor = largest over tensors of max |p - p_ref| / max |p_ref|;")
    print("grad gap w1 = the same for the gradient the optimizer saw at its first step;")
    print(f"exact = worst tensor < {EXACT:.0e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed blocks per contender")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per timed block")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--rss-child", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    missing = [name for name in PEER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        parser.error(
            f"{', '.join(missing)} not installed: pip install -e '.[bench]' (or `make bench`)"
        )
    if args.rss_child:
        rss_child(json.loads(args.rss_child))
        return 0
    if args.quick:
        repeats, steps, warmup, rounds, rss_rounds = 2, 1, 1, 1, 1
    else:
        repeats, steps, warmup, rounds, rss_rounds = 20, 10, 5, 3, 3
    for flag, value in (("--repeats", args.repeats), ("--steps", args.steps)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1")
    repeats = args.repeats or repeats
    steps = args.steps or steps

    print("command: " + shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])))
    torch.set_num_threads(THREADS)
    started = time.perf_counter()
    load_before = load()
    peers = Peers()
    info = versions()
    print(
        " | ".join(f"{k} {v}" for k, v in info.items())
        + f" | {platform.machine()}, {os.cpu_count()} CPUs, torch.set_num_threads({THREADS})"
    )
    print(f"load average (1, 5, 15 min) at start: {load_before}")
    print()
    cases = make_cases()
    seconds = {}
    mark = time.perf_counter()
    results = {c.name: run_case(c, peers, repeats, steps, warmup, rounds) for c in cases}
    if torch.get_num_threads() != THREADS:
        raise RuntimeError(f"a library changed torch's threads to {torch.get_num_threads()}")
    seconds["time and tensor peak"], mark = time.perf_counter() - mark, time.perf_counter()
    add_rss(results, rss_rounds)
    seconds["RSS subprocesses"], mark = time.perf_counter() - mark, time.perf_counter()
    exact = exactness(peers)
    seconds["exactness"] = time.perf_counter() - mark
    settings = {
        "repeats": repeats,
        "steps": steps,
        "warmup": warmup,
        "tensor_peak_rounds": rounds,
        "rss_rounds": rss_rounds,
        "rss_steps": RSS_STEPS,
        "threads": THREADS,
        "window": WINDOW,
        "seconds": seconds,
    }
    print_speed(results, settings)
    print()
    print_exactness(exact)
    load_after = load()
    print()
    print(f"load average (1, 5, 15 min) at end: {load_after}")
    parts = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
    print(f"(total {time.perf_counter() - started:.0f} s: {parts})")
    if args.json:
        payload = {
            "command": getattr(sys, "orig_argv", sys.argv),
            "versions": info,
            "machine": platform.machine(),
            "load_before": load_before,
            "load_after": load_after,
            "settings": settings,
            "results": results,
            "exactness": exact,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
