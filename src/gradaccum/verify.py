"""`check_equivalence`: does accumulating micro-batches give the full-batch gradient for a model?

It runs one plain full-batch backward and one accumulated backward on two deep copies of the
model, in float64 by default so that rounding cannot hide a real difference, and compares every
gradient (complex ones as complex numbers). Both runs start from the caller's RNG states (torch's,
NumPy's and Python's), which are left exactly as they were found. A model that computes in a less
precise dtype inside (a Llama-style RMSNorm's `x.float()`, a loss that casts the logits with
`.float()`) is judged at that dtype's rounding. It also lists the modules that make accumulation
inexact by construction (BatchNorm in train mode, dropout, spectral norm's power iteration, other
stateful parametrizations and hooks), so a failed check comes with its likely cause. That listing
(`find_non_additive`, `NonAdditiveModule`) lives in `gradaccum._non_additive` and is re-exported
here.

Example:
    >>> import torch
    >>> from gradaccum import check_equivalence
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> batch = (torch.randn(10, 4), torch.randn(10, 1))
    >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    >>> check_equivalence(model, batch, mse, micro_batch_size=3).ok
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradaccum._batch_sizes import check_batch_dim
from gradaccum._check_copies import (
    cast,
    cast_array,
    cast_copy,
    float32_only,
    refuse_unmaterialized,
    tensors_of,
)
from gradaccum._check_precision import PrecisionProbe, tolerance
from gradaccum._fixes import LOSS_CAUSES, fix_for
from gradaccum._grad_hooks import hooked_parameters
from gradaccum._loss_call import call_loss_fn, refuse_grad_disabled
from gradaccum._loss_leaves import OutsideLeaves
from gradaccum._non_additive import (
    ModulesRun,
    NonAdditiveModule,
    changed_by_hooks,
    changed_parameters,
    cuda_devices,
    diverged_attributes,
    diverged_buffers,
    find_non_additive,
    hooked_buffers,
)
from gradaccum._outputs import backward
from gradaccum._random_draws import (
    RANDOM_DRAWS,
    generators_forked,
    host_rng_forked,
    loss_generators,
    random_draws,
    rng_advanced,
    rng_snapshot,
)
from gradaccum._rng_state import held_generators
from gradaccum.batching import batch_size, map_tensors, split_batch
from gradaccum.loss import LossTerms, backward_inside_error, read_loss
from gradaccum.window import LossFn, accumulate_grad

__all__ = [
    "EquivalenceReport",
    "NonAdditiveModule",
    "ParameterGap",
    "check_equivalence",
    "find_non_additive",
]

# Relative gaps are taken against max(|parameter's gradient|, this x the model's largest one).
_SCALE_FLOOR = 1e-3


@dataclass(frozen=True)
class ParameterGap:
    """The gap between the accumulated and the full-batch gradient of one parameter."""

    name: str
    shape: tuple[int, ...]
    max_abs_diff: float  # of complex gradients: the largest modulus of the difference
    max_rel_diff: float  # max |accumulated - full| / max(max |full|, 1e-3 x model's largest)


@dataclass(frozen=True)
class EquivalenceReport:
    """Result of `check_equivalence`.

    Attributes:
        micro_batch_size: The split that was checked.
        dtype: The compute dtype of both runs.
        tolerance: Largest relative gap counted as rounding (computing in bfloat16 or float16
            it grows with the square root of the number of micro-batches).
        parameters: One `ParameterGap` per parameter that received a gradient.
        non_additive: Modules that make accumulation inexact.
        internal_dtype: The least precise dtype the model's differentiable computation ran in,
            when less precise than `dtype` (float32 inside a float64 check: an RMSNorm doing
            `x.float()`, a `.float()` loss); `tolerance` is then that dtype's. None otherwise.
    """

    micro_batch_size: int
    dtype: torch.dtype
    tolerance: float
    parameters: tuple[ParameterGap, ...]
    non_additive: tuple[NonAdditiveModule, ...]
    internal_dtype: torch.dtype | None = None

    @property
    def max_abs_diff(self) -> float:
        """Largest absolute gradient difference over all parameters."""
        return max((g.max_abs_diff for g in self.parameters), default=0.0)

    @property
    def max_rel_diff(self) -> float:
        """Largest per-parameter relative gradient difference."""
        return max((g.max_rel_diff for g in self.parameters), default=0.0)

    @property
    def ok(self) -> bool:
        """Whether every gap is within rounding for the precision the model computed in."""
        return self.max_rel_diff <= self.tolerance

    def __str__(self) -> str:
        name_width = max([9, *(len(g.name) for g in self.parameters)])
        lines = [
            f"{'parameter':<{name_width}}  {'shape':<16}  {'max abs diff':>12}  "
            f"{'max rel diff':>12}",
            f"{'-' * name_width}  {'-' * 16}  {'-' * 12}  {'-' * 12}",
        ]
        for gap in self.parameters:
            flag = "" if gap.max_rel_diff <= self.tolerance else "  <-- exceeds tolerance"
            lines.append(
                f"{gap.name:<{name_width}}  {gap.shape!s:<16}  {gap.max_abs_diff:>12.3e}  "
                f"{gap.max_rel_diff:>12.3e}{flag}"
            )
        verdict = "OK: accumulation is exact" if self.ok else "NOT EXACT"
        lines += [
            "",
            f"micro_batch_size={self.micro_batch_size}  dtype={self.dtype}  "
            f"tolerance={self.tolerance:.0e}",
            f"max abs diff {self.max_abs_diff:.3e}  max rel diff {self.max_rel_diff:.3e}  "
            f"-> {verdict}",
        ]
        if self.internal_dtype is not None:
            lines.append(
                f"note: the model computes in {self.internal_dtype} inside (e.g. x.float()), so "
                f"the tolerance is {self.internal_dtype} rounding"
            )
        if self.non_additive:
            lines.append(  # e.g. dropout in train mode: how to check the rest is in explain()
                "non-additive modules (accumulation cannot be exact with these; .explain() "
                "gives the fix for each):"
            )
            lines += [f"  - {module}" for module in self.non_additive]
        elif not self.ok:  # the loss itself: a count of the micro-batch, or in-batch negatives
            lines.append("no non-additive module: the loss is not additive; .explain() says why")
        return "\n".join(lines)

    def explain(self) -> str:
        """The verdict in words, what causes a gap, and the fix for each cause.

        Example:
            >>> model = torch.nn.Linear(3, 1)
            >>> batch = {"x": torch.randn(6, 3), "y": torch.randn(6, 1)}
            >>> def loss_fn(m, b):
            ...     return torch.nn.functional.mse_loss(m(b["x"]), b["y"])
            >>> check_equivalence(model, batch, loss_fn, 4).explain().split(".")[0]
            'result: EXACT'
        """
        judged = str(self.internal_dtype or self.dtype).removeprefix("torch.")
        if self.ok:
            lines = [
                f"result: EXACT. The accumulated gradient equals the full-batch gradient to "
                f"{judged} rounding (max rel diff {self.max_rel_diff:.1e} <= {self.tolerance:.0e})."
            ]
        else:
            lines = [
                "result: NOT EXACT. The accumulated gradient differs from the full-batch gradient "
                f"(max rel diff {self.max_rel_diff:.1e} > {self.tolerance:.0e})."
            ]
        if self.non_additive:
            lines.append(
                "note: these modules can make accumulation inexact, although this check matched:"
                if self.ok
                else "cause: these modules behave differently on micro-batches than on the whole "
                "batch:"
            )
            kinds: dict[str, list[NonAdditiveModule]] = {}
            for module in self.non_additive:
                kinds.setdefault(module.kind, []).append(module)
            for kind, modules in kinds.items():
                more = f" and {len(modules) - 4} more" if len(modules) > 4 else ""
                names = ", ".join(m.name for m in modules[:4]) + more
                fix = fix_for(kind, modules[0].reason)
                lines += [f"  {kind} at {names}: {modules[0].reason}", f"    -> {fix}"]
            if not self.ok and all("plain Python state" in m.reason for m in self.non_additive):
                # Such an attribute may only record (a logged value): the loss stays a suspect.
                lines += ["if those attributes are not read by the forward:", *LOSS_CAUSES]
        elif not self.ok:
            lines += LOSS_CAUSES
        if not self.ok and self.dtype not in (torch.float64, torch.float32):
            lines.append(
                f"note: this check summed the micro-batches' gradients in {judged}, whose "
                "rounding grows with their number: check in float64 (the default) to judge the "
                "split, and train such weights with Accumulator(..., accum_dtype=torch.float32)."
            )
        return "\n".join(lines)


def check_equivalence(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: int,
    *,
    dtype: torch.dtype = torch.float64,
    batch_dim: int = 0,
) -> EquivalenceReport:
    """Compare the accumulated gradient with the full-batch gradient on copies of `model`.

    The model itself is not touched. Floating tensors of the model and the batch (and the
    batch's floating numpy arrays) are cast to `dtype`, complex ones to the complex dtype of
    its precision. Both runs start from the caller's RNG states (torch's CPU, and CUDA when used;
    NumPy's and Python's), which are restored afterwards.

    Args:
        model: The model to check.
        batch: A whole batch.
        loss_fn: `loss_fn(model, micro_batch) -> Tensor | LossSum`.
        micro_batch_size: The split to check.
        dtype: Compute dtype of both runs (float64 makes rounding negligible). In bfloat16
            or float16 (or a model computing in them inside) each micro-batch's gradient is
            rounded to that dtype, and the tolerance grows with the square root of their number.
        batch_dim: The items' dimension of every tensor in the batch, as for
            `Accumulator(batch_dim=...)`: 0, or 1 for sequence-first `(S, B, ...)` batches.

    Returns:
        An `EquivalenceReport`; `str()` of it is a readable table.

    Raises:
        ValueError: If a parameter, buffer or batch tensor has no values (meta device, lazy
            module), the batch or `micro_batch_size` is invalid, or only the accumulated run fails.
    """
    batch_dim = check_batch_dim(batch_dim)  # the Accumulator's check and message
    refuse_unmaterialized(model, batch)
    # Validates before any work
    micro_batches = len(split_batch(batch, micro_batch_size, batch_dim=batch_dim))
    full_model, accumulated_model = cast_copy(model, dtype), cast_copy(model, dtype)
    batch = map_tensors(batch, lambda t: cast(t, dtype), lambda a: cast_array(a, dtype))
    devices = cuda_devices([*model.parameters(), *model.buffers(), *tensors_of(batch)])
    hooked = hooked_buffers(full_model)
    precision = PrecisionProbe(dtype)
    known = {m.name for m in find_non_additive(model)}

    # A learnable loss weight outside the model gets both runs' backwards: its .grad is put back.
    with (
        torch.enable_grad(),
        OutsideLeaves([*full_model.parameters()], batch).put_back() as outside,
    ):
        refuse_grad_disabled("check_equivalence()")  # inference mode, which enable_grad keeps
        own, own_drew = loss_generators(loss_fn), list[bool]()  # negative sampling's own
        with torch.random.fork_rng(devices=devices), host_rng_forked(), precision:
            generators = held_generators(full_model)  # its own, next to the global ones
            rng = rng_snapshot(devices, generators)
            with random_draws(full_model, devices, known) as drawing:
                try:
                    with generators_forked(own, own_drew), ModulesRun(full_model) as run:
                        result = call_loss_fn(loss_fn, full_model, batch)
                except Exception as error:
                    fused = float32_only(model)
                    if fused and dtype != torch.float32 and hasattr(error, "add_note"):
                        error.add_note(
                            f"gradaccum: {', '.join(fused[:3])} run float32 kernels only; "
                            "check with check_equivalence(..., dtype=torch.float32)."
                        )
                    raise
            if any(param.grad is not None for param in full_model.parameters()):
                raise backward_inside_error()  # the gradient would be counted twice
            if isinstance(result, LossTerms):
                raise ValueError(
                    "check_equivalence takes a loss with one denominator; compare a "
                    "LossSum.terms loss by stepping Accumulator.step against a full-batch step."
                )
            items = batch_size(batch, batch_dim=batch_dim)
            value, weight, count = read_loss(result, items, needs_graph=True)
            outside.take(value)
            if count > 0:  # the plain full-batch loss itself: no op a user would not write
                backward([value if weight == count else value / count])
            drew = rng_advanced(rng, devices, generators) or any(own_drew)
        with torch.random.fork_rng(devices=devices), host_rng_forked(), generators_forked(own):
            try:
                accumulate_grad(
                    accumulated_model, batch, loss_fn, micro_batch_size, batch_dim=batch_dim
                )
            except Exception as error:
                # State kept between calls (an RNN's hidden state held as an attribute) that the
                # full batch set for its B items: the micro-batches then fail on its shape.
                kept = diverged_attributes(cast_copy(model, dtype), full_model, set())
                held = ", ".join(f"{m.name} ({m.kind})" for m in kept)
                hint = (
                    f" These modules keep state between calls in plain attributes, which the full "
                    f"batch's forward set: {held}; reset it in loss_fn (e.g. model.state = None) "
                    "or carry it in the batch."
                    if kept
                    else ""
                )
                if not isinstance(error, ValueError):
                    if kept and hasattr(error, "add_note"):
                        error.add_note(
                            f"gradaccum: check_equivalence's accumulated run failed at "
                            f"micro_batch_size={micro_batch_size} although the full batch ran."
                            + hint
                        )
                    raise
                suspects = "; ".join(str(m) for m in find_non_additive(model)) or "none found"
                raise ValueError(
                    f"the accumulated run failed at micro_batch_size={micro_batch_size} although "
                    f"the full batch ran: {error}. Non-additive modules: {suspects}. Try a larger "
                    "micro_batch_size (BatchNorm needs more than 1 item per channel in train "
                    f"mode).{hint}"
                ) from error

    # Only modules that ran: a train-mode EMA copy the model holds never runs in a step.
    ran = [m for m in find_non_additive(model) if run.ran(m.name)]
    non_additive = ran + drawing + hooked_parameters(model)
    non_additive += changed_by_hooks(full_model, hooked, {m.name for m in non_additive})
    non_additive += diverged_buffers(full_model, accumulated_model, {m.name for m in non_additive})
    non_additive += diverged_attributes(
        full_model, accumulated_model, {m.name for m in non_additive}
    )
    non_additive += changed_parameters(model, full_model, {m.name for m in non_additive})
    if drew and not any("random" in m.reason for m in non_additive):
        non_additive.append(RANDOM_DRAWS)
    limit = precision.lowest
    return EquivalenceReport(
        micro_batch_size=micro_batch_size,
        dtype=dtype,
        tolerance=tolerance(limit or dtype, micro_batches),
        parameters=_gaps(full_model, accumulated_model),
        non_additive=tuple(non_additive),
        internal_dtype=limit,
    )


def _gaps(full_model: torch.nn.Module, accumulated: torch.nn.Module) -> tuple[ParameterGap, ...]:
    """One gap per parameter with a gradient; |.| of complex numbers is their modulus."""
    pairs = []
    reference = dict(full_model.named_parameters())
    for name, param in accumulated.named_parameters():
        full_grad, acc_grad = reference[name].grad, param.grad
        if full_grad is None and acc_grad is None:
            continue
        full_grad = torch.zeros_like(param) if full_grad is None else full_grad
        acc_grad = torch.zeros_like(param) if acc_grad is None else acc_grad
        pairs.append((name, tuple(param.shape), acc_grad, full_grad))
    largest = max((float(full.abs().max()) for *_, full in pairs), default=0.0)
    gaps = []
    for name, shape, acc_grad, full_grad in pairs:
        abs_diff = float((acc_grad - full_grad).abs().max())
        # A gradient that is exactly zero in exact arithmetic (a softmax shift, a bias before
        # BatchNorm) holds rounding noise only; judge it against the model's gradient scale.
        scale = max(float(full_grad.abs().max()), _SCALE_FLOOR * largest)
        rel_diff = abs_diff / scale if scale > 0 else (0.0 if abs_diff == 0 else float("inf"))
        gaps.append(ParameterGap(name, shape, abs_diff, rel_diff))
    return tuple(gaps)
