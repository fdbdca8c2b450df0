"""FSDP2 sync policies: peak memory per rank and time per window, "window" vs "micro".

Two ranks on CPU, joined in a gloo process group on 127.0.0.1 (`torch.multiprocessing`, start
method "spawn"), train an MLP of 8 blocks of 1024x1024 (8.4M parameters, 34 MB in float32),
`fully_shard` on each block and on the root. Each window is N micro-batches of 8 items per rank,
for N in {1, 4, 8}, through `Accumulator(model, opt, micro_batch_size=8, sync_policy=P).step()`:

- `"window"`: every backward but the window's last runs with the reduce-scatter off, so each rank
  holds the unsharded gradient sums of the whole model for the window, and reduce-scatters once;
- `"micro"`: every backward reduce-scatters, so each rank holds only its gradient shard, and
  communicates N times as much.

Measured per policy and N:

- peak memory per rank: the largest number of CPU tensor bytes allocated during one window and
  alive at once (`_measure.peak_allocated_bytes`: allocator events from the profiler), on the
  rank that saw more;
- seconds per window: blocks of several windows, policies alternating in an order reversed every
  other repeat, both ranks meeting at a barrier before each block; a block's time is the slower
  rank's; the median over blocks, and the interquartile range;
- reduce-scatter calls per window (counted by wrapping `dist.reduce_scatter_single`).

Before timing, both policies take one window from the same weights; the largest parameter gap
between them is printed (float32 rounding: small, not 0).

Usage:
    .venv/bin/python benchmarks/fsdp.py [--quick] [--repeats R] [--windows W] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _measure import peak_allocated_bytes
from gradaccum import Accumulator

WORLD_SIZE = 2
WIDTH, BLOCKS, MICRO = 1024, 8, 8
POLICIES = ("window", "micro")


class MLP(nn.Module):
    """Blocks a user shards one by one, and a head on the root."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_sharded(width: int, blocks: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = MLP(width, blocks)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def rank_batch(rank: int, micro_batches: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    items = MICRO * micro_batches
    return torch.randn(items, width, generator=generator), torch.randint(0, 10, (items,))


def count_reduce_scatters() -> list[int]:
    calls = [0]
    real = dist.reduce_scatter_single

    @functools.wraps(real)
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counted  # this spawned rank only
    return calls


def slowest(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def bench_n(rank: int, n: int, settings: dict[str, Any], calls: list[int]) -> dict[str, Any]:
    width, blocks = settings["width"], settings["blocks"]
    batch = rank_batch(rank, n, width)
    runs = {}
    for policy in POLICIES:
        model = make_sharded(width, blocks)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        acc = Accumulator(model, optimizer, micro_batch_size=MICRO, sync_policy=policy)
        runs[policy] = (model, acc)
    for _model, acc in runs.values():  # one window from the same weights: the same step
        acc.step(batch, loss_fn)
    full = {
        policy: [p.full_tensor() for p in model.parameters()] for policy, (model, _) in runs.items()
    }
    gap = max(
        (a - b).abs().max().item() for a, b in zip(full["window"], full["micro"], strict=True)
    )
    out: dict[str, Any] = {"gap": gap, "calls": {}, "peak": {}, "times": {}}
    for policy, (_, acc) in runs.items():
        for _ in range(settings["warmup"]):
            acc.step(batch, loss_fn)
        before = calls[0]
        acc.step(batch, loss_fn)
        out["calls"][policy] = calls[0] - before
        peak = peak_allocated_bytes(lambda acc=acc: acc.step(batch, loss_fn)).peak_bytes
        out["peak"][policy] = int(slowest(float(peak)))
        out["times"][policy] = []
    for repeat in range(settings["repeats"]):
        order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]
        for policy in order:
            _, acc = runs[policy]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(settings["windows"]):
                acc.step(batch, loss_fn)
            seconds = (time.perf_counter() - start) / settings["windows"]
            out["times"][policy].append(slowest(seconds))
    return out


def rank_main(
    rank: int, port: int, settings: dict[str, Any], queue: Any
) -> None:  # pragma: no cover - runs in the spawned processes
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=300)
    # A client of the store the parent listens with (see `rendezvous_store`).
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timeout)
    try:
        calls = count_reduce_scatters()
        results = {str(n): bench_n(rank, n, settings, calls) for n in settings["n"]}
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


def print_report(results: dict[str, Any], settings: dict[str, Any]) -> None:
    params = settings["blocks"] * (settings["width"] ** 2 + settings["width"])
    print(f"$ {' '.join(['python', *sys.argv])}")
    print(
        f"FSDP2 on {WORLD_SIZE} CPU ranks (gloo), MLP of {settings['blocks']} blocks of "
        f"{settings['width']}x{settings['width']} ({params / 1e6:.1f}M params, "
        f"{4 * params / 2**20:.0f} MiB fp32), micro-batches of {MICRO} per rank, AdamW; "
        f"{settings['repeats']} repeats x {settings['windows']} windows, torch {torch.__version__}"
    )
    print()
    print("| N | policy | peak MiB / rank | ms / window | IQR | reduce-scatters / window |")
    print("|---:|:---|---:|---:|---:|---:|")
    for n, result in results.items():
        for policy in POLICIES:
            times = result["times"][policy]
            quart = (
                statistics.quantiles(times, n=4, method="inclusive")
                if len(times) > 1
                else [times[0]] * 3
            )
            print(
                f"| {n} | {policy} | {result['peak'][policy] / 2**20:.1f} | "
                f"{1000 * quart[1]:.1f} | {1000 * quart[0]:.1f}-{1000 * quart[2]:.1f} | "
                f"{result['calls'][policy]} |"
            )
    gaps = ", ".join(f"N={n}: {r['gap']:.1e}" for n, r in results.items())
    print(f"\nlargest parameter gap between the policies after one window: {gaps}")


def rendezvous_store() -> dist.TCPStore:
    """The ranks' rendezvous store, listening on a port of 127.0.0.1 that the system picks.

    The parent holds it from before the spawn: a port merely found free, then bound by rank 0
    only after it imported torch, could be taken in between by another process of a busy machine.
    """
    return dist.TCPStore("127.0.0.1", 0, WORLD_SIZE, is_master=True, wait_for_workers=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, N in {1, 4}")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--windows", type=int, default=None)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    settings = {
        "n": [1, 4] if args.quick else [1, 4, 8],
        "width": 128 if args.quick else WIDTH,
        "blocks": 2 if args.quick else BLOCKS,
        "repeats": args.repeats or (2 if args.quick else 7),
        "windows": args.windows or (1 if args.quick else 3),
        "warmup": 1,
    }
    queue = mp.get_context("spawn").SimpleQueue()
    store = rendezvous_store()
    mp.spawn(rank_main, args=(store.port, settings, queue), nprocs=WORLD_SIZE, join=True)
    del store
    results = queue.get()
    print_report(results, settings)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"settings": settings, "results": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
