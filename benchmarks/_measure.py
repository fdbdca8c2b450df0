"""Measurement helpers shared by the benchmarks: interleaved step timing and CPU peak memory.

Timing:
    `interleaved_times` runs several candidates (for example the library and a hand-written
    loop) in alternating blocks within one process, so slow drift of the machine (other jobs,
    thermal state, allocator state) falls on every candidate alike. Compare candidates with
    `paired_ratios` and `statistics.median`.

Memory:
    `peak_allocated_bytes` records every CPU allocation and free made by the PyTorch allocator
    while a function runs (`torch.profiler` with `profile_memory=True`, read back from the
    profiler's exported trace, which names the address of each block). It replays those events
    in order and returns the largest number of bytes that were allocated *inside the function*
    and alive at the same moment. Blocks that existed before the call (parameters, optimizer
    state, the input batch) are not counted, and neither are their frees. This is tensor storage
    as the allocator sees it, not process RSS.

    `saved_for_backward_bytes` is an independent cross-check for the activation part: it counts
    the distinct storages that autograd saves for backward during a forward pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = [
    "PeakMemory",
    "interleaved_times",
    "paired_ratios",
    "peak_allocated_bytes",
    "quartiles",
    "saved_for_backward_bytes",
]


@dataclass(frozen=True)
class PeakMemory:
    """What `peak_allocated_bytes` saw while one function ran.

    Attributes:
        peak_bytes: Largest number of bytes allocated inside the function and alive at once.
        allocated_bytes: Sum of all allocations made inside the function (churn, not a peak).
        allocations: Number of allocations made inside the function.
        end_bytes: Bytes allocated inside the function and still alive when it returned.
    """

    peak_bytes: int
    allocated_bytes: int
    allocations: int
    end_bytes: int


def peak_allocated_bytes(fn: Callable[[], object]) -> PeakMemory:
    """Run `fn()` once under the PyTorch profiler and replay its CPU allocator events.

    Only blocks allocated during the call are tracked, matched to their frees by address, so
    the result does not depend on what was allocated before (or on earlier profiler sessions).
    The profiler slows `fn` down; never time a function while measuring its memory.

    Args:
        fn: The work to measure, for example one training step.

    Returns:
        The peak, the total churn and the number of allocations, in bytes.

    Raises:
        RuntimeError: If the profiler reported no memory event at all (nothing allocated, or
            this PyTorch build does not report CPU memory), so a zero would not be a measurement.
    """
    with _profiler_chatter_filtered(), profile(
        activities=[ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    events = _memory_events(prof)
    if not events:
        raise RuntimeError(
            "the profiler reported no CPU memory event; peak memory cannot be measured here."
        )
    live: dict[int, int] = {}
    current = peak = allocated = allocations = 0
    for _, _, address, nbytes in events:
        if nbytes > 0:
            # A block is freed before its address is handed out again; a repeat means a missed
            # free, so forget the old size rather than counting the address twice.
            current -= live.get(address, 0)
            live[address] = nbytes
            current += nbytes
            allocated += nbytes
            allocations += 1
            peak = max(peak, current)
        elif nbytes < 0 and address in live:
            current -= live.pop(address)
    return PeakMemory(peak, allocated, allocations, current)


@contextlib.contextmanager
def _profiler_chatter_filtered() -> Iterator[None]:
    """Drop the profiler's start/stop log lines (written to fd 2 by C++); keep anything else."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines(keepends=True):
                if not _PROFILER_CHATTER.search(line):
                    sys.stderr.write(line)
            sys.stderr.flush()


_PROFILER_CHATTER = re.compile(r"profiler_(start|stop)\s*$")


def _memory_events(prof: profile) -> list[tuple[float, int, int, int]]:
    """(timestamp, event index, address, signed bytes) of every CPU memory event, in order."""
    handle, path = tempfile.mkstemp(suffix=".json", prefix="gradaccum-mem-")
    os.close(handle)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as trace_file:
            trace = json.load(trace_file)
    finally:
        os.unlink(path)
    events = []
    for event in trace.get("traceEvents", []):
        args = event.get("args", {})
        if event.get("name") != "[memory]" or args.get("Device Type") != 0:  # 0: CPU
            continue
        events.append(
            (float(event["ts"]), int(args.get("Ev Idx", 0)), int(args["Addr"]), int(args["Bytes"]))
        )
    events.sort()
    return events


def saved_for_backward_bytes(forward: Callable[[], object]) -> int:
    """Bytes of the distinct non-parameter storages that autograd saves during `forward()`.

    This is the activation memory that must survive until backward; a peak measured around a
    forward and backward should be at least this large. Parameters saved for backward (for
    example a linear layer's weight) are excluded: they are not new memory.

    Args:
        forward: Runs a forward pass that builds an autograd graph; its result is discarded.

    Returns:
        The number of bytes.
    """
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(seen.values())


def interleaved_times(
    candidates: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    steps_per_repeat: int,
    warmup: int,
) -> dict[str, list[float]]:
    """Time each candidate in alternating blocks; return seconds per call, one per block.

    Each candidate first runs `warmup` untimed calls. Then, `repeats` times, every candidate
    runs `steps_per_repeat` timed calls in a row; the order of the candidates is reversed on
    every other repeat so neither always runs first.

    Args:
        candidates: Name -> a function doing one step.
        repeats: Number of timed blocks per candidate.
        steps_per_repeat: Calls per timed block.
        warmup: Untimed calls per candidate before timing.

    Returns:
        Name -> `repeats` times, each the mean seconds per call of one block.
    """
    names = list(candidates)
    for name in names:
        for _ in range(warmup):
            candidates[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        for name in order:
            fn = candidates[name]
            start = time.perf_counter()
            for _ in range(steps_per_repeat):
                fn()
            times[name].append((time.perf_counter() - start) / steps_per_repeat)
    return times


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Ratios of block times taken in the same repeat, which cancels drift between repeats."""
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) of `values`."""
    if len(values) < 2:
        only = float(values[0])
        return only, only, only
    low, mid, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, mid, high
