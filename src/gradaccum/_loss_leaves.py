"""Tensors a loss trains that are not the model's parameters: a learnable loss weight.

`accumulate_grad` knows the model, not an optimizer, so a learnable weight the loss holds
outside the model (uncertainty weighting's `log_vars`, a temperature, `nn.Parameter` in a
closure) got each micro-batch's backward as seeded before the window's count was known and was
never divided: its `.grad` was the full-batch gradient times `denominator / count` (11 items
seeded at 1/16: 0.69 of it, silently), added onto the gradient it held before, and not put back
on an error. `check_equivalence` left both of its backwards in such a weight's `.grad`.

`OutsideLeaves` finds them in each micro-batch's graph (the leaves its backward accumulates into,
other than the model's parameters and the batch's own tensors, whose `.grad` docs/losses.md
leaves out of the step), sets their gradients aside the first time, so that they are replaced
like the parameters', divides them with the parameters' and puts them back on an error.

Example:
    >>> import torch
    >>> model, weight = torch.nn.Linear(2, 1), torch.nn.Parameter(torch.tensor(2.0))
    >>> leaves = OutsideLeaves(list(model.parameters()), batch=None)
    >>> leaves.take(weight * model(torch.ones(1, 2)).sum())
    >>> leaves.leaves == [weight]
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from gradaccum._check_copies import tensors_of

__all__ = ["OutsideLeaves"]


class OutsideLeaves:
    """The leaves requiring grad a loss reaches besides `params` and the batch's tensors."""

    def __init__(self, params: Sequence[torch.Tensor], batch: Any) -> None:
        self._known = {id(p) for p in params} | {id(t) for t in tensors_of(batch)}
        self.leaves: list[torch.Tensor] = []
        self._before: list[torch.Tensor | None] = []

    def take(self, loss: torch.Tensor) -> None:
        """Find the new ones in `loss`'s graph (before its backward) and set their grads aside."""
        seen: set[Any] = set()
        stack = [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)  # an AccumulateGrad node
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in self._known:
                    self._known.add(id(leaf))
                    self.leaves.append(leaf)
                    self._before.append(leaf.grad)
                    leaf.grad = None
                continue
            stack.extend(next_node for next_node, _ in node.next_functions)

    def grads(self) -> list[torch.Tensor]:
        """Their gradients, to divide with the parameters'."""
        return [leaf.grad for leaf in self.leaves if leaf.grad is not None]

    def restore(self) -> None:
        """Put back the gradients they held before (the same tensors)."""
        for leaf, grad in zip(self.leaves, self._before, strict=True):
            leaf.grad = grad

    @contextlib.contextmanager
    def put_back(self) -> Iterator[OutsideLeaves]:
        """Put their gradients back on leaving, however it is left (`check_equivalence`)."""
        try:
            yield self
        finally:
            self.restore()
