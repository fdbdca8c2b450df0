"""Measurement helpers shared by the benchmarks: interleaved step timing and CPU peak memory.

Timing:
    `interleaved_times` runs several candidates (for example the library and a hand-written
    loop) interleaved call by call within one process, the order shuffled every round, so slow
    drift of the machine (other jobs, thermal state, allocator state) falls on every candidate
    alike. Compare candidates with `paired_ratios` and `statistics.median`.

    Before timing, `steady_allocator` stops glibc's malloc from giving freed memory back to the
    system between steps. Left alone it does (a freed block at the top of the heap past a
    threshold that moves with the process's history), and the next step takes the pages back
    as page faults: 0 to 300 per CNN step, about 3.5 us each on this machine, landing on
    whichever candidate allocates next. The hand loop timed alone read 17 to 28 ms per step
    (median 22.7) that way, and 17 to 20 ms (median 18.6) with the allocator steady.

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

Attribution:
    `attributed_time` wraps chosen functions and methods for a block and sums each one's SELF
    wall time (its own time minus that of the other wrapped calls it made). Unlike cProfile it
    leaves every other call alone, so the work around the wrapped calls runs at full speed and
    with the caches as they really are (warm-loop micro-benchmarks of the same code read low).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import inspect
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = [
    "CallTimes",
    "PeakMemory",
    "attributed_time",
    "interleaved_times",
    "paired_ratios",
    "peak_allocated_bytes",
    "quartiles",
    "saved_for_backward_bytes",
    "steady_allocator",
]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


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
    with (
        _profiler_chatter_filtered(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
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


def saved_for_backward_bytes(
    forward: Callable[[], object], exclude: Iterable[torch.Tensor] = ()
) -> int:
    """Bytes of the distinct storages that autograd saves during `forward()`, less `exclude`.

    This is the activation memory that must survive until backward; a peak measured around a
    forward and backward should be at least this large. Pass the model's parameters as
    `exclude`: a layer saves its weight (or a view of it) for backward, but that is not new
    memory.

    Args:
        forward: Runs a forward pass that builds an autograd graph; its result is discarded.
        exclude: Tensors whose storages are not counted (matched by storage address).

    Returns:
        The number of bytes.
    """
    skip = {tensor.untyped_storage().data_ptr() for tensor in exclude}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(seen.values())


def steady_allocator() -> bool:
    """Keep freed heap memory in the process (glibc), so steps do not page it back in.

    Sets a trim threshold of 1 GiB, a top pad of 16 MiB and a fixed mmap threshold of 32 MiB
    (the largest glibc takes; fixing it also stops it from moving). Process-wide and for the
    benchmark's own process only. A no-op where the C library is not glibc.

    Returns:
        Whether the settings were applied.
    """
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    settings = ((_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 16 << 20), (_M_MMAP_THRESHOLD, 32 << 20))
    return all(mallopt(option, value) == 1 for option, value in settings)


def interleaved_times(
    candidates: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    steps_per_repeat: int,
    warmup: int,
) -> dict[str, list[float]]:
    """Time each candidate call by call, interleaved; return seconds per call, one per repeat.

    Each candidate first runs `warmup` untimed calls. Then, `repeats` times, every candidate
    makes `steps_per_repeat` timed calls, interleaved one call at a time: each round runs every
    candidate once, in an order shuffled afresh every round (a seeded generator, so runs
    repeat), so no candidate keeps a position or always follows the same other one (a call
    leaves caches and the allocator to the next: a fixed or rotated order gives each candidate
    a fixed predecessor, which read up to 3% in the A/A control). Block-wise alternation (ten
    calls of one, then ten of the next, reversed every other repeat) read 0.94 to 1.06 in A/A
    on a busy machine. It first calls `steady_allocator`.

    Args:
        candidates: Name -> a function doing one step.
        repeats: Number of timed blocks per candidate.
        steps_per_repeat: Timed calls per candidate per block.
        warmup: Untimed calls per candidate before timing.

    Returns:
        Name -> `repeats` times, each the mean seconds per call of that repeat's calls.
    """
    steady_allocator()  # before the warm-up, which then grows the heap to what a step needs
    names = list(candidates)
    for name in names:
        for _ in range(warmup):
            candidates[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    clock, order = time.perf_counter, random.Random(0)  # its own generator: no global state
    for _ in range(repeats):
        spent = dict.fromkeys(names, 0.0)
        for _ in range(steps_per_repeat):
            for name in order.sample(names, len(names)):
                fn = candidates[name]
                start = clock()
                fn()
                spent[name] += clock() - start
        for name in names:
            times[name].append(spent[name] / steps_per_repeat)
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


@dataclass
class CallTimes:
    """Self wall time and call counts gathered by `attributed_time`.

    Attributes:
        seconds: Label -> summed self seconds (time in the call minus wrapped calls inside it).
        calls: Label -> number of calls.
        missing: `"owner.name"` of targets that did not exist and were not wrapped.
    """

    seconds: dict[str, float]
    calls: dict[str, int]
    missing: list[str]


@contextlib.contextmanager
def attributed_time(targets: Sequence[tuple[object, str, str]]) -> Iterator[CallTimes]:
    """Wrap `getattr(owner, name)` for each `(owner, name, label)` inside the block.

    Each call's self time goes to its label. A function imported by name into another module
    must be wrapped where it is looked up (`(that_module, "name", ...)`). Everything is put
    back on exit, inherited attributes included. Each wrapped call costs well under a
    microsecond of extra time, charged to its caller.

    Args:
        targets: `(module or class, attribute name, label)` triples. Several targets may share
            a label; missing attributes are skipped and listed in `CallTimes.missing`.

    Yields:
        The `CallTimes` being filled; read it after the block.
    """
    times = CallTimes({}, {}, [])
    open_frames: list[float] = []  # time spent in wrapped children of each open wrapped call
    restore: list[tuple[object, str, object, bool]] = []

    def wrapper_for(original: Callable[..., object], label: str) -> Callable[..., object]:
        def wrapped(*args: object, **kwargs: object) -> object:
            open_frames.append(0.0)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = open_frames.pop()
                times.seconds[label] = times.seconds.get(label, 0.0) + elapsed - children
                times.calls[label] = times.calls.get(label, 0) + 1
                if open_frames:
                    open_frames[-1] += elapsed

        return wrapped

    try:
        for owner, name, label in targets:
            original = getattr(owner, name, None)
            if not callable(original):
                times.missing.append(f"{getattr(owner, '__name__', owner)}.{name}")
                continue
            owned = name in vars(owner)
            restore.append((owner, name, vars(owner).get(name), owned))
            wrapped = wrapper_for(original, label)
            if isinstance(inspect.getattr_static(owner, name), (staticmethod, classmethod)):
                wrapped = staticmethod(wrapped)  # `original` is already bound where it needs be
            setattr(owner, name, wrapped)
        yield times
    finally:
        for owner, name, previous, owned in reversed(restore):
            if owned:
                setattr(owner, name, previous)
            else:
                delattr(owner, name)
