"""Plain PyTorch training steps written WITHOUT gradaccum, to compare the library against.

`reference_step` is the ground truth: one forward and one backward on the whole batch, then the
usual clip / optimizer / scheduler sequence. `reference_grads` is the same without the step.

The `buggy_*` functions are the accumulation loops users commonly write by hand. They are the
negative controls: on ragged data each one must visibly DISAGREE with `reference_step`, which
shows that the comparison used by the equivalence tests can fail.

A loss function here has the library's signature `loss_fn(model, batch)` and returns either a
scalar tensor (a mean over the batch's leading dimension) or any object with `.value` (summed
loss) and `.count` (items counted), such as `gradaccum.LossSum`; it is read by duck typing so that
nothing of the library's own loss handling is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LossFn = Callable[[nn.Module, Any], Any]


@dataclass(frozen=True)
class ReferenceResult:
    """What one reference step did: the objective, the item count, the pre-clip norm, the lr."""

    loss: float
    count: int
    grad_norm: float
    lr: float


def leading_dim(batch: Any) -> int:
    """Number of items of a tensor, or of the first tensor in a dict/tuple/list batch."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.shape[0]
    raise ValueError("batch holds no tensor")


def objective(loss: Any, batch: Any, normalize: str = "mean") -> tuple[torch.Tensor, int]:
    """The whole-batch objective for one `loss_fn` result, and its item count.

    A scalar tensor is a mean over the batch's items: it is the objective itself for
    `"mean"`, and `mean * items` for `"sum"`. A `(value, count)` result gives `value / count`
    or `value`.
    """
    if isinstance(loss, torch.Tensor):
        items = leading_dim(batch)
        return (loss if normalize == "mean" else loss * items), items
    value, count = loss.value, int(loss.count)
    return (value / count if normalize == "mean" else value), count


def total_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """2-norm of all gradients of `params` taken together."""
    norms = [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms))


def reference_grads(
    model: nn.Module, batch: Any, loss_fn: LossFn, normalize: str = "mean"
) -> tuple[float, int]:
    """Fill `.grad` with the full-batch gradient: one forward, one backward. No step."""
    for param in model.parameters():
        param.grad = None
    loss, count = objective(loss_fn(model, batch), batch, normalize)
    loss.backward()
    return float(loss.detach()), count


def finish_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    max_grad_norm: float | None,
) -> tuple[float, float]:
    """Clip, step, schedule, zero: the tail every loop here shares. Returns (norm, lr)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        norm = total_norm(params)
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm), lr


def reference_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: LossFn,
    *,
    normalize: str = "mean",
    max_grad_norm: float | None = None,
    scheduler: Any = None,
) -> ReferenceResult:
    """One plain optimizer step on the whole batch at once (the ground truth)."""
    optimizer.zero_grad(set_to_none=True)
    loss, count = reference_grads(model, batch, loss_fn, normalize)
    norm, lr = finish_step(model, optimizer, scheduler, max_grad_norm)
    return ReferenceResult(loss, count, norm, lr)


def split(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split a dict/tuple batch into consecutive micro-batches (no library code)."""
    size = leading_dim(batch)
    out = []
    for start in range(0, size, micro_batch_size):
        stop = start + micro_batch_size
        if isinstance(batch, dict):
            out.append({k: v[start:stop] for k, v in batch.items()})
        else:
            out.append(type(batch)(v[start:stop] for v in batch))
    return out


def buggy_mean_of_means_grads(
    model: nn.Module, batch: Any, mean_loss_fn: LossFn, micro_batch_size: int
) -> None:
    """BUG (a): each micro-batch's MEAN loss divided by the number of accumulation steps.

    Right only if every micro-batch counts the same number of items; wrong for a ragged last
    micro-batch or for padded tokens.
    """
    micro_batches = split(batch, micro_batch_size)
    for micro_batch in micro_batches:
        (mean_loss_fn(model, micro_batch) / len(micro_batches)).backward()


def buggy_zero_grad_inside_grads(
    model: nn.Module, batch: Any, mean_loss_fn: LossFn, micro_batch_size: int
) -> None:
    """BUG (b): `zero_grad()` at every micro-step, so each backward erases the previous ones."""
    micro_batches = split(batch, micro_batch_size)
    for micro_batch in micro_batches:
        for param in model.parameters():
            param.grad = None
        (mean_loss_fn(model, micro_batch) / len(micro_batches)).backward()


def buggy_last_micro_batch_grads(
    model: nn.Module, batch: Any, mean_loss_fn: LossFn, micro_batch_size: int
) -> None:
    """BUG (c): forward every micro-batch, but backward only the last one's loss."""
    loss = None
    for micro_batch in split(batch, micro_batch_size):
        loss = mean_loss_fn(model, micro_batch)
    assert loss is not None
    loss.backward()


BUGGY_GRADS = {
    "mean_of_means": buggy_mean_of_means_grads,
    "zero_grad_inside": buggy_zero_grad_inside_grads,
    "last_micro_batch_only": buggy_last_micro_batch_grads,
}


def buggy_step(
    bug: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    mean_loss_fn: LossFn,
    micro_batch_size: int,
    *,
    max_grad_norm: float | None = None,
    scheduler: Any = None,
) -> None:
    """One optimizer step of the hand-written accumulation loop `bug` (a key of BUGGY_GRADS)."""
    optimizer.zero_grad(set_to_none=True)
    BUGGY_GRADS[bug](model, batch, mean_loss_fn, micro_batch_size)
    finish_step(model, optimizer, scheduler, max_grad_norm)


def param_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter, keyed by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and every tensor of the optimizer state, keyed by a readable name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"state:{names[id(param)]}:{key}"] = value.detach().clone().reshape(-1)
    return out


def relative_gaps(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Per tensor, `max|actual - expected| / max|expected|`, compared in float64.

    Both sides must hold the same keys. A tensor whose expected value is all zero gives its
    absolute gap instead. A NaN gap is reported as inf.
    """
    assert actual.keys() == expected.keys(), sorted(actual.keys() ^ expected.keys())
    gaps = {}
    for key, want in expected.items():
        got = actual[key].to(torch.float64)
        want = want.to(torch.float64)
        diff = float((got - want).abs().max())
        scale = float(want.abs().max())
        gap = diff / scale if scale > 0 else diff
        gaps[key] = math.inf if math.isnan(gap) else gap
    return gaps


def relative_gap(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest of `relative_gaps`: one number for "how far apart are these states"."""
    return max(relative_gaps(actual, expected).values(), default=0.0)


def grad_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's `.grad` (zeros where it is None), keyed by the parameter's name."""
    return {
        name: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
        for name, p in model.named_parameters()
    }


def kept_items_reference(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    windows: Sequence[Sequence[dict[str, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    """One plain full-batch step per window: the mean squared error over the kept items of
    every rank's batch (`{"x", "y", "keep"}`), then the parameters."""
    for batches in windows:
        x = torch.cat([b["x"][b["keep"]] for b in batches])
        y = torch.cat([b["y"][b["keep"]] for b in batches])
        optimizer.zero_grad(set_to_none=True)
        (model(x) - y).pow(2).sum().div(len(x)).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
