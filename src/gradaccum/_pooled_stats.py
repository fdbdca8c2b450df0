"""Exact per-channel statistics of BatchNorm inputs, pooled over micro-batches.

Each micro-batch gives (count, mean, M2) per channel; Chan et al.'s parallel formula merges them
into the statistics of the whole window, from which one running-statistics update is made
exactly as a full-batch BatchNorm forward would make it.

Example:
    >>> import torch
    >>> x = torch.randn(10, 3, dtype=torch.float64)
    >>> n, mean, m2 = merge(channel_stats(x[:4]), channel_stats(x[4:]))
    >>> n, torch.allclose(mean, x.mean(0)), torch.allclose(m2 / (n - 1), x.var(0))
    (10, True, True)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import UninitializedBuffer

__all__ = [
    "Record",
    "Stats",
    "channel_stats",
    "merge",
    "recording",
    "stat_dtype",
    "tracked",
    "update_running",
]

# (count, mean, M2) per channel: items seen, their mean, the sum of squared deviations from it.
Stats = tuple[int, torch.Tensor, torch.Tensor]
Record = dict[str, list[Stats | None]]  # per module name, per call in a forward


def stat_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def channel_stats(x: torch.Tensor) -> Stats | None:
    """Per-channel (count, mean, M2) of a BatchNorm input `(N, C, *)`, or None if it has none."""
    count = x.numel() // x.shape[1] if x.dim() >= 2 and x.shape[1] else 0
    if count == 0:
        return None
    with torch.no_grad():
        x = x.detach()
        work = x if x.dtype in (torch.float32, torch.float64) else x.float()  # bf16, fp16: upcast
        dims, dtype = [0, *range(2, x.dim())], stat_dtype(x.device)
        # Two passes (the mean, then squared deviations from it) are numerically stable, and on
        # CPU ~10x faster than torch.var_mean over several dimensions.
        mean = work.mean(dims, keepdim=True)
        return count, mean.flatten().to(dtype), (work - mean).square_().sum(dims).to(dtype)


def merge(a: Stats | None, b: Stats | None) -> Stats | None:
    """Chan et al.'s parallel formula: the statistics of the union of two disjoint sets."""
    if a is None or b is None:
        return b if a is None else a
    (n_a, mean_a, m2_a), (n_b, mean_b, m2_b) = a, b
    n = n_a + n_b
    delta = mean_b - mean_a
    return n, mean_a + delta * (n_b / n), m2_a + m2_b + delta.square() * (n_a * n_b / n)


@contextlib.contextmanager
def recording(modules: list[tuple[str, _BatchNorm]], per_call: bool) -> Iterator[Record]:
    """Record input statistics of `modules` as `{name: [call 0, call 1, ...]}` (or one entry)."""
    record: Record = {}

    def make_hook(name: str, bn: _BatchNorm) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not bn.training:  # eval mode: running statistics, nothing to record
                return
            # Set here, after a lazy module's own pre-hook has created its running buffers.
            bn.track_running_stats = False  # bn is module, the one the hook is registered on
            # Inside a backward, activation checkpointing recomputes a forward: counted already.
            # Compiled, the hook is traced into the forward's graph (asking autograd would break
            # it at every BatchNorm, each break recompiled per layer).
            in_backward = not torch.compiler.is_compiling() and (
                torch._C._current_graph_task_id() != -1
            )
            if in_backward or not args or not isinstance(args[0], torch.Tensor):
                return
            stats = channel_stats(args[0])
            calls = record.setdefault(name, [])
            if per_call or not calls:
                calls.append(stats)
            else:
                calls[0] = merge(calls[0], stats)

        return hook

    # Off before the forward too, not only in the hook: Dynamo does not guard on module hooks,
    # so a torch.compile graph traced without them (a plain step earlier in the process, even
    # of another instance of the class) would run them never, and BatchNorm would update its
    # running statistics itself. It does guard on this flag: the change makes it retrace.
    # A lazy module's running buffers are created by its first forward only while it is True.
    preset = [m for _, m in modules if not isinstance(m.running_mean, UninitializedBuffer)]
    for module in preset:
        module.track_running_stats = False
    handles = [m.register_forward_pre_hook(make_hook(name, m)) for name, m in modules]
    try:
        with _traced_inside_checkpoint():
            yield record
    finally:
        for handle in handles:
            handle.remove()
        for module in preset:
            module.track_running_stats = True


_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"  # newer torch only


@contextlib.contextmanager
def _traced_inside_checkpoint() -> Iterator[None]:
    """Let Dynamo trace the hook's recording inside `torch.utils.checkpoint` (compiled models).

    Eager checkpointing replays a forward's Python side effects when it recomputes the forward
    in the backward, which a compiled graph cannot, so Dynamo refuses them there: each
    checkpointed BatchNorm broke the graph, and a break inside a loop over the blocks ran the
    whole forward eagerly. The recording must not be replayed (a recompute is counted already),
    which is what this flag tells Dynamo. Untouched when nothing imported Dynamo (no compile).
    """
    config = getattr(sys.modules.get("torch._dynamo"), "config", None)
    if config is None or getattr(config, _SKIP_REPLAY, True):  # older torch, or set already
        yield
        return
    setattr(config, _SKIP_REPLAY, True)
    try:
        yield
    finally:
        setattr(config, _SKIP_REPLAY, False)


def tracked(module: _BatchNorm) -> bool:
    """Whether `module` keeps running statistics."""
    return module.track_running_stats and module.running_mean is not None


def update_running(module: _BatchNorm, stats: Stats | None) -> None:
    """One running-statistics update from `stats`, exactly as BatchNorm's forward makes it."""
    if stats is None:
        return
    count, mean, m2 = stats
    running_mean, running_var = module.running_mean, module.running_var
    assert running_mean is not None  # only tracked modules get here
    assert running_var is not None
    with torch.no_grad():
        batches = module.num_batches_tracked
        if batches is not None:
            batches.add_(1)
        # momentum=None is a cumulative average: the factor is 1 / batches seen, this one included.
        factor: float | torch.Tensor
        if module.momentum is not None:
            factor = module.momentum
        else:
            assert batches is not None  # a tracked BatchNorm counts its batches
            factor = 1.0 / batches.to(mean.dtype)
        unbiased = m2 / (count - 1) if count > 1 else m2
        for buffer, value in ((running_mean, mean), (running_var, unbiased)):
            buffer.copy_(buffer.to(mean.dtype) * (1 - factor) + value.to(buffer.device) * factor)
