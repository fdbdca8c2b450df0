"""A model's outputs as backward roots: for ranks whose loss has no graph (FSDP2).

Every FSDP2 forward and backward is a collective, so every rank must run both on every
micro-batch. A loss that returns a constant (no graph) for a micro-batch of no item still ran the
model; `captured_outputs` keeps the model's output tensors, and a backward of zeros through them
takes part in FSDP2's collectives while adding nothing to any gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from gradaccum._tensor_parallel import loss_parallel_context
from gradaccum.batchnorm import batchnorm_modules
from gradaccum.loss import read_loss

__all__ = ["backward", "captured_outputs", "output_tensors", "zero_backward", "zero_item_roots"]


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a model's output (a tensor, or a dict/list/tuple of them, any depth)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for value in output.values() for t in output_tensors(value)]
    if isinstance(output, (list, tuple)):
        return [t for value in output for t in output_tensors(value)]
    return []


@contextlib.contextmanager
def captured_outputs(model: torch.nn.Module, outputs: list[torch.Tensor]) -> Iterator[None]:
    """Collect `model`'s output tensors that carry a graph into `outputs` while the block runs."""

    def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
        outputs.extend(t for t in output_tensors(output) if t.requires_grad)

    hook = model.register_forward_hook(keep)
    try:
        yield
    finally:
        hook.remove()


@contextlib.contextmanager
def _batchnorm_unchanged(model: torch.nn.Module) -> Iterator[None]:
    """BatchNorm in eval mode: a batch of no item must not count as one in its statistics."""
    training = [(bn, bn.training) for _, bn in batchnorm_modules(model)]
    for bn, _ in training:
        bn.training = False
    try:
        yield
    finally:
        for bn, was in training:
            bn.training = was


def zero_item_roots(
    model: torch.nn.Module,
    empty_batch: Any,
    loss_fn: Callable[[torch.nn.Module, Any], Any],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> list[torch.Tensor]:
    """Forward `empty_batch` (no item); return what a backward of zeros starts from.

    Backpropagating zeros from them (`zero_backward`) runs every collective and adds nothing.
    A `loss_fn` that raises on the empty batch after the model ran (torch's `loss_parallel()`
    cross-entropy of `logits.flatten(0, 1)` with no row, a `.max()` of nothing) is not needed:
    the micro-batch counts nothing, and the zeros go through the model's outputs.

    Raises:
        RuntimeError: If `loss_fn` did not call the model, which FSDP2 cannot survive.
    """
    outputs: list[torch.Tensor] = []
    with autocast(), captured_outputs(model, outputs), _batchnorm_unchanged(model):
        try:
            value, _, _ = read_loss(loss_fn(model, empty_batch), 0)
        except Exception:
            if not outputs:  # it raised before the model ran, or in it: the user's to see
                raise
            return outputs
    roots = [value] if value.requires_grad else outputs
    if not roots:
        raise RuntimeError(
            "FSDP2 needs every rank to run the model on every micro-batch: loss_fn returned a "
            "loss without calling the model for a micro-batch of no item. Call the model on it "
            "(its output may be empty) and return LossSum(loss_sum, 0)."
        )
    return roots


def zero_backward(roots: list[torch.Tensor]) -> None:
    """Backpropagate zeros from `roots`: a backward's collectives, no gradient added."""
    backward(roots, [torch.zeros_like(t) for t in roots])


def backward(roots: list[torch.Tensor], seeds: list[torch.Tensor] | None = None) -> None:
    """`torch.autograd.backward`, inside `loss_parallel()` when the loss was computed in it."""
    if len(roots) == 1 and type(roots[0]) is torch.Tensor:  # the common case: no DTensor loss
        torch.autograd.backward(roots, seeds)
        return
    with loss_parallel_context(roots):
        torch.autograd.backward(roots, seeds)
