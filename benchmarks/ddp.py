"""DDP accumulation: one gradient all-reduce per window (gradaccum) or one per micro-batch.

Two ranks on CPU, joined in a gloo process group on 127.0.0.1 (started with
`torch.multiprocessing`, start method "spawn"), train a small MLP wrapped in
`DistributedDataParallel`. Each window is N micro-batches of 8 samples per rank, for N in
{1, 4, 16}. Three loops take the same optimizer step per window:

- `gradaccum`: `Accumulator(ddp, opt, micro_batch_size=8).step(batch, loss_fn)`, which runs every
  micro-batch under `ddp.no_sync()` and all-reduces the window's gradients itself, once, in flat
  buckets (so no rank can wait on another's backward);
- `hand, no_sync`: a hand-written loop with the same sync control (`no_sync()` on all but the last
  micro-batch, `loss * n_i / B`), for the library's own cost;
- `hand, sync each`: the same hand loop WITHOUT `no_sync()`, so DDP all-reduces the gradients after
  every micro-batch's backward (what a loop that ignores DDP does).

Counted per window, on rank 0:

- gradient all-reduces: calls of a DDP communication hook registered on the model, which counts each
  bucket and its bytes, then all-reduces it exactly as DDP's default hook does (DDP splits these
  1.6 MB of gradient into 2 buckets once it has rebuilt them after the first backward, so counts
  are taken after warm-up), plus the library's own `all_reduce` calls; "syncs" is the number of
  backward passes (or library reductions) that reduced gradients;
- other collectives: calls to `torch.distributed` collectives other than those (the library
  exchanges the window's item counts in one small all-gather, and after `optimizer.step()` all
  ranks all-reduce three integers: did the step raise anywhere).

Timed: seconds per window (forward, backward, communication and optimizer step), in blocks of
several windows. Loops alternate block by block, in an order reversed every other repeat, after
untimed warm-up windows. Before each block both ranks meet at a barrier; a block's time is the
slower rank's. Reported: the median over blocks and the interquartile range.

Before timing, the three loops take one window from identical copies of the model, and the largest
parameter gap between them, relative to the update, is printed (float32 rounding: small, not 0).

Usage:
    .venv/bin/python benchmarks/ddp.py [--quick] [--repeats R] [--windows W] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import gradaccum

WORLD_SIZE = 2
MICRO_BATCH = 8
FEATURES, HIDDEN, CLASSES = 256, 512, 16
LOOPS = ("gradaccum", "hand, no_sync", "hand, sync each")
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier")


def make_model() -> nn.Module:
    """A 3-layer MLP: 256 -> 512 -> 512 -> 16, 402,448 float32 parameters (1.6 MB of gradient)."""
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over the micro-batch's samples."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def rank_batch(rank: int, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    size = micro_batches * MICRO_BATCH
    x = torch.randn(size, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (size,), generator=generator)
    return x, y


# --------------------------------------------------------------------------------------------
# Counting communication
# --------------------------------------------------------------------------------------------


@dataclass
class CommCounter:
    """Gradient buckets all-reduced by DDP's hook, and other collectives, since the last reset."""

    allreduces: int = 0
    allreduce_bytes: int = 0
    syncs: int = 0  # backward passes that reduced gradients (hook calls on the last bucket)
    other: dict[str, int] = field(default_factory=dict)
    other_bytes: int = 0
    in_hook: bool = False
    library_reduced: bool = False  # the window's gradients were all-reduced outside DDP's hook

    def reset(self) -> None:
        self.allreduces, self.allreduce_bytes, self.syncs = 0, 0, 0
        self.other, self.other_bytes, self.library_reduced = {}, 0, False


def counting_hook(state: CommCounter, bucket):  # no annotations: DDP checks them by identity
    """Count one gradient bucket, then all-reduce it as DDP's default hook does."""
    buffer = bucket.buffer()
    state.allreduces += 1
    state.syncs += int(bucket.is_last())
    state.allreduce_bytes += buffer.numel() * buffer.element_size()
    state.in_hook = True
    try:
        return default_hooks.allreduce_hook(None, bucket)
    finally:
        state.in_hook = False


def _is_integer(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and not tensor.is_floating_point()


@contextlib.contextmanager
def count_collectives(counter: CommCounter) -> Iterator[None]:
    """Count `torch.distributed` collectives called outside the hook; each still runs for real."""
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[1] if name == "all_gather" else (args[0] if args else None)
            nbytes = (
                tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            )
            if counter.in_hook:
                pass
            elif name == "all_reduce" and not _is_integer(tensor):  # the library's own gradient
                # reduction (no DDP hook); integer all-reduces are agreements (the step's: did
                # optimizer.step() raise on any rank), counted with the other collectives
                counter.allreduces += 1
                counter.allreduce_bytes += nbytes
                counter.library_reduced = True
            else:
                counter.other[name] = counter.other.get(name, 0) + 1
                counter.other_bytes += nbytes
            return real(*args, **kwargs)

        return counted

    for name, real in originals.items():
        setattr(dist, name, wrap(name, real))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)


# --------------------------------------------------------------------------------------------
# The three loops
# --------------------------------------------------------------------------------------------


def hand_window(
    ddp: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    use_no_sync: bool,
) -> None:
    """Correct mean-loss accumulation by hand: `loss * n_i / B`, one step per window."""
    x, y = batch
    total = x.shape[0]
    optimizer.zero_grad(set_to_none=True)
    starts = range(0, total, MICRO_BATCH)
    for start in starts:
        last = start + MICRO_BATCH >= total
        micro = (x[start : start + MICRO_BATCH], y[start : start + MICRO_BATCH])
        context = ddp.no_sync() if use_no_sync and not last else contextlib.nullcontext()
        with context:
            (loss_fn(ddp, micro) * (micro[0].shape[0] / total)).backward()
    optimizer.step()


@dataclass
class Loop:
    """One training loop under test, with its own model copy, optimizer and counter."""

    name: str
    ddp: DistributedDataParallel
    window: Callable[[], None]
    counter: CommCounter


def make_loops(rank: int, micro_batches: int, init: dict[str, torch.Tensor]) -> list[Loop]:
    batch = rank_batch(rank, micro_batches)
    loops = []
    for name in LOOPS:
        model = make_model()
        model.load_state_dict(init)
        ddp = DistributedDataParallel(model)
        counter = CommCounter()
        ddp.register_comm_hook(counter, counting_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        if name == "gradaccum":
            acc = gradaccum.Accumulator(ddp, optimizer, micro_batch_size=MICRO_BATCH)

            def window(acc: gradaccum.Accumulator = acc) -> None:
                acc.step(batch, loss_fn)
        else:

            def window(
                ddp: DistributedDataParallel = ddp,
                optimizer: torch.optim.Optimizer = optimizer,
                no_sync: bool = name == "hand, no_sync",
            ) -> None:
                hand_window(ddp, optimizer, batch, use_no_sync=no_sync)

        loops.append(Loop(name, ddp, window, counter))
    return loops


def update_gap(loops: list[Loop], init: dict[str, torch.Tensor]) -> float:
    """Largest parameter gap between the loops after one window, relative to the update."""
    params = [torch.cat([p.detach().flatten() for p in loop.ddp.parameters()]) for loop in loops]
    start = torch.cat([t.flatten() for t in init.values()])
    update = float((params[0] - start).abs().max())
    gap = max(float((p - params[0]).abs().max()) for p in params[1:])
    return gap / update


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------


def slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (a window is done when the slowest rank is)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def bench_n(rank: int, micro_batches: int, repeats: int, windows: int, warmup: int) -> dict:
    """Every figure for one N: update gap, counts, block times per loop."""
    torch.manual_seed(0)
    init = copy.deepcopy(make_model().state_dict())
    loops = make_loops(rank, micro_batches, init)
    for loop in loops:  # one window each from identical copies: they must take the same step
        loop.window()
    gap = update_gap(loops, init)
    for loop in loops:
        for _ in range(warmup):
            loop.window()
    # Counted after warm-up: DDP rebuilds its buckets after the first backward that syncs.
    counts = {}
    for loop in loops:
        loop.counter.reset()
        with count_collectives(loop.counter):
            loop.window()
        counts[loop.name] = {
            "allreduces": loop.counter.allreduces,
            "syncs": loop.counter.syncs + int(loop.counter.library_reduced),
            "allreduce_bytes": loop.counter.allreduce_bytes,
            "other": dict(loop.counter.other),
            "other_bytes": loop.counter.other_bytes,
        }
    times: dict[str, list[float]] = {loop.name: [] for loop in loops}
    for repeat in range(repeats):
        order = loops if repeat % 2 == 0 else loops[::-1]
        for loop in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(windows):
                loop.window()
            times[loop.name].append(slowest((time.perf_counter() - start) / windows))
    return {"counts": counts, "update_gap": gap, "times": times}


def rank_main(
    rank: int, port: int, settings: dict[str, Any], queue: mp.SimpleQueue
) -> None:  # pragma: no cover - runs in the spawned processes
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    # A client of the store the parent listens with (see `rendezvous_store`).
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timeout)
    try:
        results = {}
        for n in settings["n"]:
            results[str(n)] = bench_n(
                rank, n, settings["repeats"], settings["windows"], settings["warmup"]
            )
        if rank == 0:
            queue.put(results)
        # Every rank done with its collectives before any tears the group down.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # torch's gloo threads torn down during interpreter finalization abort a rank now and then
    # (SIGABRT, "terminate called without an active exception"), even after
    # destroy_process_group(): the results are in the queue, so leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def summarize(results: dict[str, dict]) -> dict[str, dict]:
    summary: dict[str, dict] = {}
    for n, result in results.items():
        rows = {}
        base = statistics.median(result["times"]["hand, sync each"])
        for name in LOOPS:
            block_times = result["times"][name]
            q = (
                statistics.quantiles(block_times, n=4, method="inclusive")
                if len(block_times) > 1
                else [block_times[0]] * 3
            )
            count = result["counts"][name]
            rows[name] = {
                "ms_median": 1000 * q[1],
                "ms_q1": 1000 * q[0],
                "ms_q3": 1000 * q[2],
                "speedup_vs_sync_each": base / q[1],
                "allreduces": count["allreduces"],
                "syncs": count["syncs"],
                "allreduce_bytes": count["allreduce_bytes"],
                "other": count["other"],
                "other_bytes": count["other_bytes"],
            }
        summary[n] = {"rows": rows, "update_gap": result["update_gap"]}
    return summary


def print_report(summary: dict[str, dict], settings: dict[str, Any]) -> None:
    print(
        f"DDP, {WORLD_SIZE} ranks, gloo on 127.0.0.1, CPU, 1 thread per rank; "
        f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES} (float32), "
        f"micro-batch {MICRO_BATCH} per rank; "
        f"{settings['repeats']} blocks of {settings['windows']} windows per loop "
        f"after {settings['warmup']} warm-up windows"
    )
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}")
    print()
    header = (
        f"{'N':>3}  {'loop':<16} {'ms/window':>10} {'IQR':>17}  {'syncs':>5} {'all-reduces':>11}"
        f"  {'MB':>7}  {'other collectives':<36} {'speedup':>8}"
    )
    print(header)
    print("-" * len(header))
    for n, entry in summary.items():
        for name, row in entry["rows"].items():
            other = ", ".join(f"{k} x{v}" for k, v in sorted(row["other"].items())) or "-"
            if row["other_bytes"]:
                other += f" ({row['other_bytes']} B)"
            iqr = f"{row['ms_q1']:.2f}-{row['ms_q3']:.2f}"
            print(
                f"{n:>3}  {name:<16} {row['ms_median']:>10.2f} {iqr:>17}  {row['syncs']:>5}"
                f" {row['allreduces']:>11}"
                f"  {row['allreduce_bytes'] / 1e6:>7.2f}  {other:<36} "
                f"{row['speedup_vs_sync_each']:>7.2f}x"
            )
        print(f"     same step: largest parameter gap / update = {entry['update_gap']:.1e}")
    print()
    print(
        "Per window, on rank 0: syncs = backward passes that reduced gradients; all-reduces and "
        "MB = gradient\nbuckets all-reduced and their bytes (DDP comm hook); other collectives = "
        "called outside the hook.\nspeedup = median time of 'hand, sync each' / this loop's. "
        "IQR: interquartile range over timed blocks."
    )


def rendezvous_store() -> dist.TCPStore:
    """The ranks' rendezvous store, listening on a port of 127.0.0.1 that the system picks.

    The parent holds it from before the spawn: a port merely found free, then bound by rank 0
    only after it imported torch, could be taken in between by another process of a busy machine.
    """
    return dist.TCPStore("127.0.0.1", 0, WORLD_SIZE, is_master=True, wait_for_workers=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N in {1, 4}, few windows (smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed blocks per loop and N")
    parser.add_argument("--windows", type=int, default=None, help="windows per timed block")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    args = parser.parse_args(argv)
    for option in ("repeats", "windows"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option} must be >= 1")
    settings = {
        "n": [1, 4] if args.quick else [1, 4, 16],
        "repeats": args.repeats or (2 if args.quick else 9),
        "windows": args.windows or (2 if args.quick else 5),
        "warmup": 1 if args.quick else 3,
    }
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    store = rendezvous_store()
    mp.spawn(rank_main, args=(store.port, settings, queue), nprocs=WORLD_SIZE, join=True)
    del store
    results = queue.get()
    summary = summarize(results)
    print_report(summary, settings)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"settings": settings, "summary": summary, "raw": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
