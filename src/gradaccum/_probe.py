"""Measuring a training step's memory on the model itself, leaving it exactly as it was.

`Probe` backs `gradaccum.sizing.plan_micro_batch`: fixed bytes counted from the tensors, one
forward+backward per probed size measured with `track_tensor_bytes` (and CUDA's allocator
statistics), and the optimizer replayed on the meta device.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(1000, 10)
    >>> probe = Probe(model, torch.optim.AdamW(model.parameters()),
    ...               lambda m, x: m(x).sum(), torch.randn(8, 1000), Precision.FP32, None)
    >>> probe.optimizer_bytes  # two moments per weight and a 4-byte step count per tensor
    80088
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from gradaccum._averaged import averaged_parameter_ids
from gradaccum._dtensor import local_tensor
from gradaccum._forward_state import ForwardState
from gradaccum._loss_call import call_loss_fn
from gradaccum._outputs import backward
from gradaccum._sync_base import is_fsdp
from gradaccum.batching import batch_size, slice_batch, to_device
from gradaccum.loss import read_loss
from gradaccum.memory import track_tensor_bytes
from gradaccum.options import Precision, SyncPolicy
from gradaccum.precision import PrecisionRuntime
from gradaccum.sync import sync_context

__all__ = ["CudaAllocatorPeak", "ForwardState", "Probe", "resident_bytes"]


class _AllocatorStatistics(Protocol):
    """The part of `torch.cuda` that `CudaAllocatorPeak` reads (a module satisfies it)."""

    def synchronize(self, device: torch.device) -> None: ...
    def reset_peak_memory_stats(self, device: torch.device) -> None: ...
    def memory_allocated(self, device: torch.device) -> int: ...
    def max_memory_allocated(self, device: torch.device) -> int: ...


class Probe:
    """Measurements on the model itself, each leaving it exactly as it was.

    The parameters are not copied: that would double the memory being planned. Each probe sets
    the gradients aside (putting zeros in their place, as in a window's steady state), runs one
    forward and backward without a cross-rank reduction, and puts back the gradients and what
    the forward changed (`ForwardState`: every buffer, a max-norm embedding's weight); the
    planner puts back the random number generators. The optimizer is replayed on the
    meta device, where its state and temporaries have sizes but take no memory.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, Any], object],
        sample_batch: Any,
        precision: Precision,
        accum_dtype: torch.dtype | None,
        policy: SyncPolicy = SyncPolicy.WINDOW,
        batch_dim: int = 0,
    ) -> None:
        self.model = model
        self.batch_dim = batch_dim  # the items' dimension (1 for sequence-first batches)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.sample_batch = sample_batch
        self.items = batch_size(sample_batch, batch_dim=batch_dim)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.runtime = PrecisionRuntime(precision, self.params, accum_dtype)
        self.device = self.runtime.device
        self.measured: dict[int, int] = {}
        # Buffers (BatchNorm statistics, masks, tables) live as long as the parameters do.
        self.parameters_bytes = sum(_nbytes(t) for t in (*model.parameters(), *model.buffers()))
        self.sharded = is_fsdp(model)
        # FSDP2 under the window policy holds every parameter's unsharded gradient sum for the
        # window; otherwise gradients are as large as this rank's (shard of the) parameters.
        unsharded = self.sharded and policy is SyncPolicy.WINDOW
        averaged = averaged_parameter_ids(model)  # an EMA copy inside gets no gradient
        self.gradients_bytes = sum(
            p.numel() * p.element_size() if unsharded else _nbytes(p)
            for p in self.params
            if id(p) not in averaged
        )
        self.buffers_bytes = 0
        if self.runtime.uses_buffers and accum_dtype is not None:
            self.buffers_bytes = sum(
                local_tensor(p).numel() * accum_dtype.itemsize for p in self.params
            )
        self.optimizer_bytes, self.step_workspace_bytes = _optimizer_bytes(optimizer)
        self.allocator = CudaAllocatorPeak(self.device) if self.device.type == "cuda" else None

    def activation_peak(self, size: int) -> int:
        """Peak bytes above the steady state for one forward+backward of `size` items."""
        if size in self.measured:
            return self.measured[size]
        # The batch's first items by the splitting rules: per-item lists and dataclasses too.
        first = slice_batch(self.sample_batch, 0, min(size, self.items), batch_dim=self.batch_dim)
        micro_batch = to_device(first, self.device)
        allocator = self.allocator
        saved_grads = [p.grad for p in self.params]
        state = ForwardState(self.model)  # buffers a forward updates: put back below
        try:
            for param in self.params:  # the steady state: gradients exist and are added into
                param.grad = torch.zeros_like(param)
            if allocator is not None:
                allocator.start()
            # FSDP2 reduce-scatters even here: a deferred sum would stay inside it after the
            # probe and leak into the next window; its gradients are put back below.
            reduce = self.sharded
            with track_tensor_bytes() as tracker, sync_context(self.model, sync=reduce):
                with self.runtime.autocast():
                    value, _, _ = read_loss(
                        call_loss_fn(self.loss_fn, self.model, micro_batch), size
                    )
                if value.requires_grad:
                    backward([value])
                del value
            # The allocator also sees what no tensor shows: cuDNN/cuBLAS workspaces, rounding.
            peak = tracker.peak if allocator is None else max(tracker.peak, allocator.peak())
        finally:
            for param, grad in zip(self.params, saved_grads, strict=True):
                param.grad = grad
            state.restore()
        self.measured[size] = peak
        return peak


class CudaAllocatorPeak:
    """The CUDA caching allocator's peak above its level at `start()`.

    Args:
        device: The CUDA device.
        memory: The statistics module (`torch.cuda`); a stand-in can be passed for tests.
    """

    def __init__(self, device: torch.device, memory: _AllocatorStatistics = torch.cuda) -> None:
        self.device = device
        self.memory = memory
        self.before = 0

    def start(self) -> None:
        """Reset the peak statistics and remember the bytes allocated now."""
        self.memory.synchronize(self.device)
        self.memory.reset_peak_memory_stats(self.device)
        self.before = self.memory.memory_allocated(self.device)

    def peak(self) -> int:
        """Peak bytes allocated since `start()`, above what was allocated then."""
        self.memory.synchronize(self.device)
        return self.memory.max_memory_allocated(self.device) - self.before


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes a plan counts that are already allocated, so not in the free memory.

    The parameters and buffers, the gradients present, and the optimizer's state so far.
    """
    grads = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    weights = sum(_nbytes(t) for t in (*model.parameters(), *model.buffers()))
    return weights + grads + _state_bytes(_local_optimizer(optimizer))


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """What this rank steps: a `ZeroRedundancyOptimizer`'s local optimizer over its shard.

    ZeRO cannot be replayed itself (it does not survive `deepcopy`, and its step broadcasts);
    its local optimizer holds this rank's part of the state, which is what the plan counts.
    Likewise a `PostLocalSGDOptimizer`'s (no `defaults` to copy; its step averages the model
    over ranks, a collective, and adds no state).
    """
    local = getattr(optimizer, "optim", None)
    wrapper = type(optimizer).__name__ in _DISTRIBUTED_WRAPPERS  # a torch without distributed
    return local if wrapper and isinstance(local, torch.optim.Optimizer) else optimizer


_DISTRIBUTED_WRAPPERS = ("ZeroRedundancyOptimizer", "PostLocalSGDOptimizer")


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(state bytes after a first step, step temporaries), from a replay on the meta device."""
    optimizer = _local_optimizer(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    memo: dict[int, Any] = {}
    for param in params:  # this rank's part only (a DTensor's local shard)
        local = local_tensor(param)
        meta = torch.nn.Parameter(torch.empty_like(local, device="meta"), param.requires_grad)
        meta.grad = torch.empty_like(local, device="meta") if param.requires_grad else None
        memo[id(param)] = meta
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # not the step counts
                memo[id(value)] = torch.empty_like(local_tensor(value), device="meta")
    replay = _deep_copy(optimizer, memo)
    _copy_own_attributes(optimizer, replay, memo)
    for group, real in zip(replay.param_groups, optimizer.param_groups, strict=True):
        _same_implementation(group, real["params"])
    state_before = _state_bytes(replay)
    with track_tensor_bytes(include_meta=True) as tracker:
        replay.step()
    state_after = _state_bytes(replay)
    return state_after, max(0, tracker.peak - (state_after - state_before))


def _deep_copy(optimizer: torch.optim.Optimizer, memo: dict[int, Any]) -> torch.optim.Optimizer:
    """`copy.deepcopy(optimizer)`, leaving its class's `step` as it was.

    The copy runs `Optimizer.__setstate__`, which wraps the class's `step` in torch's hook
    runner for good. A wrapper that never ran `Optimizer.__init__` (timm's Lookahead) has no
    hooks to run: its own `step()` then raised `AttributeError` at every later window.
    """
    kind, missing = type(optimizer), object()
    own = kind.__dict__.get("step", missing)
    try:
        return copy.deepcopy(optimizer, memo)
    finally:
        if kind.__dict__.get("step", missing) is not own:
            if own is missing:
                delattr(kind, "step")
            else:
                setattr(kind, "step", own)  # noqa: B010  (a class attribute, put back)


def _copy_own_attributes(
    optimizer: torch.optim.Optimizer, replay: torch.optim.Optimizer, memo: dict[int, Any]
) -> None:
    """Give the replay a custom optimizer's own attributes (`self.trust = trust` in `__init__`).

    `Optimizer.__getstate__` keeps only `defaults`, `state` and `param_groups`, so the deep copy
    drops them, and a step reading one raised `AttributeError` from planning (and from
    `micro_batch_size="auto"`). One that cannot be copied is left out rather than shared: the
    replay must not change the real optimizer. Nor is a method the instance overrides: every
    torch scheduler replaces `optimizer.step` by a wrapper that steps the real optimizer (held
    by a weak reference), so a replay given it stepped the real one, never its copy: the plan
    counted no optimizer state, and gradients left on the parameters (or a param group's own
    counter, Lookahead's) took a real step.
    """
    kind = type(optimizer)
    for name, value in vars(optimizer).items():
        if name in vars(replay) or callable(getattr(kind, name, None)):
            continue
        try:
            setattr(replay, name, copy.deepcopy(value, memo))  # parameters map to the meta ones
        except Exception:  # a lock, a process group: not what the step reads
            continue


def _same_implementation(group: dict[str, Any], real_params: list[torch.Tensor]) -> None:
    """Make the meta replay take the path the real step takes (its temporaries differ).

    Left to itself, the replay would pick the single-tensor path (meta is no foreach device)
    where a CUDA step picks foreach; and fused kernels refuse meta tensors, so a fused step is
    replayed with foreach, whose temporaries bound the fused kernel's.
    """
    fused = bool(group.get("fused"))
    if "fused" in group:
        group["fused"] = False
    if ("foreach" in group and group["foreach"] is None) or fused:
        grads = [p for p in real_params if p.requires_grad]
        _, foreach = _default_to_fused_or_foreach(grads, differentiable=False, use_fused=False)
        group["foreach"] = foreach or fused


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        _nbytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor` (a DTensor's local shard)."""
    local = local_tensor(tensor)
    return local.numel() * local.element_size()
