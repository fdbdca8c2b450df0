"""Choosing the micro-batch size from a memory budget, by measuring instead of guessing.

Memory during training is a fixed part plus a part that grows with the micro-batch:

    peak(m) = parameters and buffers + gradients + optimizer state + accumulation buffers
              + max(optimizer-step workspace, activations(m))
    activations(m) = fixed_activations + per_item * m

`plan_micro_batch` measures each term without copying the model (that would double what it
plans) and leaves everything as it was: parameters, gradients, buffers a forward updates (BatchNorm
statistics, spectral norm's vectors, an EMA codebook), optimizer state and the random number
generators, Python's and NumPy's included (see `gradaccum._probe`):

- parameters, buffers, gradients and accumulation buffers are counted from the tensors; the
  optimizer's state after its first step, and its step's temporaries, come from replaying one
  step on the meta device, where tensors have sizes but no memory;
- the activation line is fitted through forward+backward probes at two or more sizes, each
  measured with `gradaccum.memory.track_tensor_bytes` (every storage allocated, temporaries and
  gradient buffers of the backward included) and, on CUDA, with the allocator's peak statistics;
- the size chosen is probed too, so the prediction at the answer is a measurement. A probe that
  runs out of memory is retried at a smaller size.

The chosen size is the largest, up to the batch, whose predicted peak fits
`memory_budget * (1 - margin)`; it need not be a power of two.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
    ...                             torch.nn.Linear(256, 1))
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> batch = (torch.randn(512, 64), torch.randn(512, 1))
    >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> plan = plan_micro_batch(model, batch, mse, opt, memory_budget="1MiB")
    >>> 1 <= plan.micro_batch_size < 512, plan.predicted_peak_bytes <= 2**20
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum._agreement import RankMismatchError
from gradaccum._oom import (
    MemoryBudgetError,
    is_out_of_memory,
    release_cached_memory,
    rng_states,
    set_rng_states,
)
from gradaccum._probe import Probe, resident_bytes
from gradaccum._rng_state import held_generators
from gradaccum.batching import batch_size
from gradaccum.memory import parse_bytes
from gradaccum.options import Precision, SyncPolicy, parse
from gradaccum.sync import all_ranks_max

__all__ = ["DEFAULT_MARGIN", "MemoryPlan", "plan_micro_batch", "resolve_budget"]

DEFAULT_MARGIN = 0.05
_CUDA_FREE_SHARE = 0.9
_MAX_PROBES = 16  # of the device's free memory, when no budget is given on CUDA


@dataclass(frozen=True)
class MemoryPlan:
    """What lives in memory during a step, measured, and the micro-batch size that fits.

    Attributes:
        micro_batch_size: The largest size, up to the batch, whose predicted peak fits.
        batch_size: Items in the sample batch; no micro-batch is larger.
        memory_budget: The budget in bytes.
        margin: Share of the budget kept free for what the model does not show.
        parameters_bytes: The model's parameters and buffers (BatchNorm statistics, masks).
        gradients_bytes, optimizer_bytes, buffers_bytes: The rest of the fixed part (buffers:
            higher-precision accumulation buffers, with `accum_dtype`).
        step_workspace_bytes: Temporaries of one optimizer step, beyond its state.
        activation_fixed_bytes: The fitted activation line at zero items.
        activation_bytes_per_item: Its slope, bytes per item.
        probes: `(size, measured activation-and-backward peak in bytes)` for every probe.
        device: Where the model lives.
    """

    micro_batch_size: int
    batch_size: int
    memory_budget: int
    margin: float
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    buffers_bytes: int
    step_workspace_bytes: int
    activation_fixed_bytes: float
    activation_bytes_per_item: float
    probes: tuple[tuple[int, int], ...]
    device: str

    @property
    def fixed_bytes(self) -> int:
        """Bytes held whatever the micro-batch: parameters, gradients, optimizer, buffers."""
        return (
            self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes + self.buffers_bytes
        )

    @property
    def usable_bytes(self) -> int:
        """The budget less its safety margin."""
        return int(self.memory_budget * (1.0 - self.margin))

    @property
    def micro_batches(self) -> int:
        """Micro-batches per window for the sample batch."""
        return math.ceil(self.batch_size / self.micro_batch_size)

    @property
    def predicted_peak_bytes(self) -> int:
        """The predicted peak at the chosen size."""
        return self.predict(self.micro_batch_size)

    def activation_bytes(self, micro_batch_size: int) -> int:
        """Activations and backward temporaries of one micro-batch of this size (fitted)."""
        fitted = self.activation_fixed_bytes + self.activation_bytes_per_item * micro_batch_size
        return max(0, math.ceil(fitted))

    def predict(self, micro_batch_size: int) -> int:
        """Predicted peak bytes of a training step at `micro_batch_size`."""
        transient = max(self.step_workspace_bytes, self.activation_bytes(micro_batch_size))
        return self.fixed_bytes + transient

    def __str__(self) -> str:
        rows = [
            ("parameters and buffers", self.parameters_bytes),
            ("gradients", self.gradients_bytes),
            ("optimizer state", self.optimizer_bytes),
            ("accumulation buffers", self.buffers_bytes),
            ("optimizer step workspace", self.step_workspace_bytes),
            ("activations, fixed part", round(self.activation_fixed_bytes)),
            ("activations per item", round(self.activation_bytes_per_item)),
            (f"predicted peak at m={self.micro_batch_size}", self.predicted_peak_bytes),
            (f"budget less {self.margin:.0%} margin", self.usable_bytes),
            ("memory budget", self.memory_budget),
        ]
        lines = [
            f"memory plan on {self.device} for a batch of {self.batch_size}",
            f"{'component':<32}{'bytes':>16}  {'size':>10}",
        ]
        for name, value in rows:
            lines.append(f"{name:<32}{value:>16,}  {format_bytes(value):>10}")
        probes = ", ".join(f"m={size}: {format_bytes(peak)}" for size, peak in self.probes)
        lines += [
            f"probes (activations + backward peak): {probes}",
            f"chosen micro_batch_size = {self.micro_batch_size}: {self.micro_batches} "
            f"micro-batch(es) per batch of {self.batch_size}; predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} of {format_bytes(self.memory_budget)}",
        ]
        return "\n".join(lines)


def plan_micro_batch(
    model: torch.nn.Module,
    sample_batch: Any,
    loss_fn: Callable[[torch.nn.Module, Any], object],
    optimizer: torch.optim.Optimizer,
    *,
    memory_budget: int | str | None = None,
    precision: Precision | str = "fp32",
    accum_dtype: torch.dtype | None = None,
    margin: float = DEFAULT_MARGIN,
    sync_policy: SyncPolicy | str = "window",
    batch_dim: int = 0,
) -> MemoryPlan:
    """Measure what a training step needs and pick the largest micro-batch that fits.

    Args:
        model: The model, plain or DDP-wrapped (probes defer DDP's reduction).
        sample_batch: A whole batch, as `Accumulator.step` gets it; probes are slices of it.
        loss_fn: `loss_fn(model, micro_batch) -> Tensor | LossSum`.
        optimizer: The optimizer over the model's parameters; its state is measured.
        memory_budget: Bytes, or a string such as `"512MiB"` or `"2GB"`. Required on CPU; on
            CUDA it defaults to 90% of the free device memory plus the model state already there.
        precision: The autocast the training will use (activations shrink under bf16/fp16).
        accum_dtype: The accumulation buffers' dtype, if the training uses them.
        margin: Share of the budget left free, in [0, 1).
        sync_policy: FSDP2's (see `Accumulator`): under `"window"` every rank holds the
            unsharded gradient sums for the window, under `"micro"` only its shard. Under DDP
            and FSDP2 every rank plans alike: up to the smallest rank's batch, within the
            smallest rank's budget, and each probe's peak is the largest rank's.
        batch_dim: The items' dimension of the batch's tensors (1 for `(seq, batch, ...)`), as
            `Accumulator(batch_dim=)` reads them.

    Returns:
        The `MemoryPlan`; `str(plan)` is a table.

    Raises:
        ValueError: On a bad budget or margin, no budget on CPU, or a lazy module that has not
            run yet.
        MemoryBudgetError: If even one item per micro-batch does not fit.
    """
    for name, param in model.named_parameters():  # before a probe's forward materializes it
        if torch.nn.parameter.is_lazy(param):
            raise ValueError(
                f"parameter {name} is uninitialized (a lazy module); run one forward pass on a "
                "sample batch before planning: the plan counts the parameters' bytes, and the "
                "optimizer must hold the materialized ones."
            )
    if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r} must be a number in [0, 1), e.g. 0.1.")
    mode = parse(Precision, precision, "precision")
    policy = parse(SyncPolicy, sync_policy, "sync_policy")
    device = next(model.parameters()).device
    resident = resident_bytes(model, optimizer) if memory_budget is None else 0
    # Every rank probes the same sizes (each probe is a collective): the smallest batch, budget.
    mine = [
        -batch_size(sample_batch, batch_dim=batch_dim, allow_empty=True),
        -resolve_budget(memory_budget, device, resident=resident),
    ]
    items, budget = (int(-value) for value in all_ranks_max(model, [float(v) for v in mine]))
    if not items:  # raised on every rank alike: one rank raising alone leaves the others waiting
        raise ValueError(
            "the batch is empty (0 items along the batch dimension) on this rank or another: "
            "the plan probes every rank's sample batch. Plan on a batch with items on every "
            "rank (micro_batch_size='auto' plans on the first step()'s), or pass the int "
            "micro_batch_size that plan_micro_batch chooses."
        )
    # Python's, NumPy's and the model's own too: a loss_fn may augment with np.random.
    rng = rng_states(device, held_generators(model))
    try:
        probe = Probe(model, optimizer, loss_fn, sample_batch, mode, accum_dtype, policy, batch_dim)
        sizes = _probe_sizes(probe, items, budget, margin)
    finally:
        set_rng_states(device, rng)
    return sizes.plan(_choose(sizes, budget, margin), items, budget, margin, str(device))


def resolve_budget(
    memory_budget: int | str | None, device: torch.device, *, resident: int = 0
) -> int:
    """The budget in bytes: as given, or on CUDA a share of the free memory plus `resident`.

    `resident` is what the plan counts that is already allocated, so not free: the
    parameters, any gradients and optimizer state (`gradaccum._probe.resident_bytes`).

    Raises:
        ValueError: If it is malformed, or missing on a device without memory statistics.
    """
    if memory_budget is not None:
        return parse_bytes(memory_budget)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _CUDA_FREE_SHARE) + resident
    raise ValueError(
        f"memory_budget is required on {device.type}: there is no free-memory figure to default "
        "to; pass e.g. memory_budget='2GiB' (or --memory-budget 2GiB)."
    )


def format_bytes(value: float) -> str:
    """`1536` -> `"1.5 KiB"`."""
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


@dataclass
class _Fit:
    """The probes so far and the line through the two largest."""

    probe: Probe
    ceiling: int  # the batch size, or less once a probe ran out of memory
    fixed_part: float = 0.0
    per_item: float = 0.0

    def refit(self) -> None:
        points = sorted(self.probe.measured.items())
        if len(points) == 1:
            ((size, peak),) = points
            self.fixed_part, self.per_item = 0.0, peak / size
            return
        (small, low), (large, high) = points[-2], points[-1]  # the regime of the answer
        self.per_item = max(0.0, (high - low) / (large - small))
        self.fixed_part = high - self.per_item * large

    def predict(self, size: int) -> int:
        """The current line's prediction: `MemoryPlan.predict` of a plan made from it now."""
        return self.plan(size, self.ceiling, 1, 0.0, "").predict(size)

    def plan(self, chosen: int, items: int, budget: int, margin: float, device: str) -> MemoryPlan:
        probe = self.probe
        return MemoryPlan(
            micro_batch_size=chosen,
            batch_size=items,
            memory_budget=budget,
            margin=float(margin),
            parameters_bytes=probe.parameters_bytes,
            gradients_bytes=probe.gradients_bytes,
            optimizer_bytes=probe.optimizer_bytes,
            buffers_bytes=probe.buffers_bytes,
            step_workspace_bytes=probe.step_workspace_bytes,
            activation_fixed_bytes=self.fixed_part,
            activation_bytes_per_item=self.per_item,
            probes=tuple(sorted(probe.measured.items())),
            device=device,
        )


def _probe_sizes(probe: Probe, items: int, budget: int, margin: float) -> _Fit:
    """Probe sizes growing at most 2x toward the candidate, until one is the candidate.

    Small sizes alone mislead: their peak is often a parameter-sized gradient temporary, not
    activations, so the line through them is too flat. Growing by at most 2x keeps every probe
    near memory that already fitted, and the last probe measures the answer itself. A probe that
    runs out of memory caps the plan below it; the next probe bisects toward that cap.
    """
    fit = _Fit(probe, ceiling=items)
    size = min(items, 4)
    while not _measured(fit, size, budget):
        size = max(1, size // 2)
    for _ in range(_MAX_PROBES):
        fit.refit()
        candidate = _choose(fit, budget, margin)
        if any(abs(candidate - size) <= 0.02 * candidate for size in probe.measured):
            break
        largest = max(probe.measured)
        size = candidate if candidate < largest else min(candidate, 2 * largest)
        if fit.ceiling < items and size > largest:  # between a success and a failure
            size = min(size, (largest + fit.ceiling + 1) // 2)
        _measured(fit, size, budget)
    if fit.ceiling < items:  # something ran out of memory: only sizes that ran are trusted
        fit.ceiling = min(fit.ceiling, max(probe.measured))
    fit.refit()
    return fit


def _measured(fit: _Fit, size: int, budget: int) -> bool:
    """Probe `size`; False (and a lower cap) if it ran out of memory."""
    probe = fit.probe
    peak, failed, raised = 0, 0, None
    try:
        peak = probe.activation_peak(size)
    except Exception as error:  # only out-of-memory errors are survived
        if not is_out_of_memory(error):
            raised = error  # told to the other ranks first: they wait in this all-reduce
        failed = 1
        release_cached_memory(probe.device)
    # Every rank plans alike: the largest rank's peak, and out of memory if any rank ran out.
    mine = [float(peak), float(failed), float(raised is not None)]
    try:
        peak, failed, elsewhere = (int(v) for v in all_ranks_max(probe.model, mine))
    finally:
        if raised is not None:
            raise raised
    if elsewhere:
        raise RankMismatchError(
            "loss_fn raised on another rank while micro_batch_size='auto' planned on the first "
            "batch (see that rank's traceback); nothing was changed on any rank, and the next "
            "step() plans again."
        )
    if not failed:
        probe.measured[size] = peak
        return True
    probe.measured.pop(size, None)
    fit.ceiling = min(fit.ceiling, size - 1)
    if size == 1:
        raise MemoryBudgetError(
            f"planning ran out of memory even at micro_batch_size=1 (memory_budget="
            f"{format_bytes(budget)}); the model, its gradients and optimizer state nearly "
            "fill the device: use a smaller model, precision='bf16', or more memory."
        )
    return False


def _choose(fit: _Fit, budget: int, margin: float) -> int:
    """The largest size, up to the batch and below any that ran out of memory, that fits."""
    usable = int(budget * (1.0 - margin))
    if fit.predict(1) > usable:
        probe = fit.probe
        fixed = probe.parameters_bytes + probe.gradients_bytes + probe.optimizer_bytes
        raise MemoryBudgetError(
            f"even micro_batch_size=1 needs {format_bytes(fit.predict(1))} (parameters, gradients "
            f"and optimizer state alone are {format_bytes(fixed)}), more than the "
            f"{format_bytes(usable)} usable of memory_budget={format_bytes(budget)}; raise the "
            "budget, or shrink the model or its optimizer state (e.g. SGD, bf16)."
        )
    low, high = 1, fit.ceiling  # predict() is non-decreasing in the size: bisect the largest fit
    while low < high:
        middle = (low + high + 1) // 2
        if fit.predict(middle) <= usable:
            low = middle
        else:
            high = middle - 1
    return low
