"""`check_equivalence`: does accumulating micro-batches give the full-batch gradient for a model?

It runs one plain full-batch backward and one accumulated backward on two deep copies of the
model, in float64 by default so that rounding cannot hide a real difference, and compares every
gradient. It also lists modules that make accumulation inexact by construction (BatchNorm in
train mode, dropout), so a failed check comes with its likely cause.

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

import copy
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.batching import batch_size, map_tensors, split_batch
from gradaccum.loss import read_loss
from gradaccum.window import LossFn, accumulate_grad

__all__ = [
    "EquivalenceReport",
    "NonAdditiveModule",
    "ParameterGap",
    "check_equivalence",
    "find_non_additive",
]

# Relative gap that rounding alone can explain, per compute dtype.
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
_LOW_PRECISION_TOLERANCE = 1e-2
# Relative gaps are taken against max(|parameter's gradient|, this x the model's largest one).
_SCALE_FLOOR = 1e-3
_DROPOUT_TYPES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


@dataclass(frozen=True)
class NonAdditiveModule:
    """A module whose output for one item depends on the other items of its micro-batch.

    Attributes:
        name: Qualified module name in the model.
        kind: The module's class name.
        reason: Why accumulation is inexact with it.
    """

    name: str
    kind: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.kind}): {self.reason}"


@dataclass(frozen=True)
class ParameterGap:
    """The gap between the accumulated and the full-batch gradient of one parameter."""

    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    max_rel_diff: float  # max |accumulated - full| / max(max |full|, 1e-3 x model's largest)


@dataclass(frozen=True)
class EquivalenceReport:
    """Result of `check_equivalence`.

    Attributes:
        micro_batch_size: The split that was checked.
        dtype: The compute dtype of both runs.
        tolerance: Largest relative gap counted as rounding.
        parameters: One `ParameterGap` per parameter that received a gradient.
        non_additive: Modules that make accumulation inexact.
    """

    micro_batch_size: int
    dtype: torch.dtype
    tolerance: float
    parameters: tuple[ParameterGap, ...]
    non_additive: tuple[NonAdditiveModule, ...]

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
        """Whether every gap is within rounding for `dtype`."""
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
        if self.non_additive:
            lines.append("non-additive modules (accumulation cannot be exact with these):")
            lines += [f"  - {module}" for module in self.non_additive]
        return "\n".join(lines)


def find_non_additive(model: torch.nn.Module) -> list[NonAdditiveModule]:
    """List the modules that make micro-batch accumulation differ from a full batch.

    Example:
        >>> import torch
        >>> [m.name for m in find_non_additive(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))]
        ['0']
    """
    found = []
    for name, module in model.named_modules():
        # An eval-mode BatchNorm without running statistics still normalizes per batch.
        batch_statistics = isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and (
            module.training or module.running_mean is None
        )
        if not (module.training or batch_statistics):
            continue
        kind = type(module).__name__
        if batch_statistics:
            found.append(
                NonAdditiveModule(
                    name or "<model>",
                    kind,
                    "normalizes with micro-batch statistics and updates running statistics "
                    "once per micro-batch",
                )
            )
        elif (isinstance(module, _DROPOUT_TYPES) and module.p > 0) or (
            isinstance(module, torch.nn.MultiheadAttention) and module.dropout > 0
        ):
            found.append(
                NonAdditiveModule(
                    name or "<model>", kind, "draws random masks per micro-batch call"
                )
            )
    return found


def check_equivalence(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: int,
    *,
    dtype: torch.dtype = torch.float64,
) -> EquivalenceReport:
    """Compare the accumulated gradient with the full-batch gradient on copies of `model`.

    The model itself is not touched. Floating tensors of the batch are cast to `dtype`; both
    runs start from the same RNG state.

    Args:
        model: The model to check.
        batch: A whole batch.
        loss_fn: `loss_fn(model, micro_batch) -> Tensor | LossSum`.
        micro_batch_size: The split to check.
        dtype: Compute dtype of both runs (float64 makes rounding negligible).

    Returns:
        An `EquivalenceReport`; `str()` of it is a readable table.
    """
    split_batch(batch, micro_batch_size)  # validates the batch and the size before any work
    full_model = copy.deepcopy(model).to(dtype)
    accumulated_model = copy.deepcopy(model).to(dtype)
    batch = _cast_floating(batch, dtype)
    seed = int(torch.randint(0, 2**31 - 1, ()).item())

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        value, weight, count = read_loss(loss_fn(full_model, batch), batch_size(batch))
        if count > 0:
            (value * weight / count).backward()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            accumulate_grad(accumulated_model, batch, loss_fn, micro_batch_size)
        except ValueError as error:
            suspects = "; ".join(str(m) for m in find_non_additive(model)) or "none found"
            raise ValueError(
                f"the accumulated run failed at micro_batch_size={micro_batch_size} although the "
                f"full batch ran: {error}. Non-additive modules: {suspects}. Try a larger "
                "micro_batch_size (BatchNorm needs more than 1 item per channel in train mode)."
            ) from error

    pairs = []
    reference = dict(full_model.named_parameters())
    for name, param in accumulated_model.named_parameters():
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
    return EquivalenceReport(
        micro_batch_size=micro_batch_size,
        dtype=dtype,
        tolerance=_TOLERANCE.get(dtype, _LOW_PRECISION_TOLERANCE),
        parameters=tuple(gaps),
        non_additive=tuple(find_non_additive(model)),
    )


def _cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    return map_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)
