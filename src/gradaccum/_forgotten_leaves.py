"""A learnable loss weight that neither the model nor the optimizer holds: never trained.

Uncertainty weighting's `log_var = torch.zeros(2, requires_grad=True)` used in `loss_fn` but
left out of the optimizer's params is never stepped, and its `.grad` grows by each window's
backward forever (nobody clears it), silently. `ForgottenLeaves` reads the graph of the first
micro-batch of the first few windows for leaves requiring grad besides the window's parameters
(the model's and the optimizer's) and the batch's own tensors, and watches their `.grad` with a
post-accumulate hook. A leaf that comes back in a later window with its `.grad` only ever grown
by backwards (the same tensor, never cleared or zeroed between) is one nobody steps or clears: it
warns once, naming its shape and `optimizer.add_param_group`. Quiet for: tensors created in
`loss_fn` each time (an adversarial perturbation: a new leaf per window), inputs requiring grad
on purpose (the batch's), and another network trained by its own optimizer (a GAN's
discriminator in the generator's window: its `zero_grad()` or Accumulator clears that `.grad`).

Example:
    >>> import torch
    >>> weight = torch.zeros(2, requires_grad=True)
    >>> check = ForgottenLeaves(windows=3)
    >>> check.open_window([])
    >>> check.check((weight * 2).sum(), batch=None)
    >>> (weight * 2).sum().backward()
    >>> check.open_window([])
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as told:
    ...     warnings.simplefilter("always")
    ...     check.check((weight * 2).sum(), batch=None)
    >>> "add_param_group" in str(told[0].message)
    True
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from gradaccum._check_copies import tensors_of
from gradaccum._warnings import warn_user

__all__ = ["ForgottenLeaves"]


class _Watched:
    """One leaf outside the window's parameters: what its last accumulation left in `.grad`."""

    def __init__(self, leaf: torch.Tensor) -> None:
        self.leaf = weakref.ref(leaf)  # a leaf made in loss_fn each time must be free to go
        self.grad: weakref.ref[torch.Tensor] | None = None
        self.version = -1
        self.managed = False  # its `.grad` was cleared or replaced between backwards
        self.handle = leaf.register_post_accumulate_grad_hook(self._accumulated)  # type: ignore[no-untyped-call]

    def _accumulated(self, leaf: torch.Tensor) -> None:
        """After any backward into it: note a `.grad` replaced or zeroed since the last one.

        Backward alone never does that: someone keeps it (an optimizer's `zero_grad()`).
        """
        grad, held = leaf.grad, None if self.grad is None else self.grad()
        if grad is None:
            return
        if self.grad is not None and (grad is not held or grad._version > self.version + 1):
            self.managed = True
        self.grad, self.version = weakref.ref(grad), grad._version

    def untouched(self, leaf: torch.Tensor) -> bool:
        """Whether `.grad` only ever grew by backwards: what the last one left, never cleared."""
        grad = leaf.grad
        held = None if self.grad is None else self.grad()
        return (
            not self.managed and grad is not None and grad is held and grad._version == self.version
        )


class ForgottenLeaves:
    """Warn once of a leaf `loss_fn` trains that no one steps: checked the first `windows`."""

    def __init__(self, windows: int = 3) -> None:
        self.windows = windows
        self._known: set[int] = set()
        self._first = False  # the window's first micro-batch is still to be read
        self._opened = False  # by an Accumulator's window (accumulate_grad steps such leaves)
        self._watched: dict[int, _Watched] = {}

    @property
    def active(self) -> bool:
        return self._opened and self.windows > 0

    def open_window(self, params: Sequence[torch.Tensor] | None) -> None:
        """A new window over `params` (None: no check, `accumulate_grad` steps such leaves)."""
        if params is None or not self.windows:
            return self._stop() if params is None else None
        self.windows -= 1
        self._known, self._first, self._opened = {id(p) for p in params}, True, True

    def check(self, loss: object, batch: Any) -> None:
        """Read the first micro-batch's graph: warn for a leaf no one cleared since last time."""
        if not self._first:
            return
        self._first = False
        value = getattr(loss, "value", loss)  # a LossSum's sum
        if not isinstance(value, torch.Tensor) or value.grad_fn is None:
            return self._stop() if not self.windows else None
        skip = self._known | {id(t) for t in tensors_of(batch)}
        leaves = [leaf for leaf in _leaves(value) if id(leaf) not in skip]
        forgotten = []
        for leaf in leaves:
            watched = self._watched.get(id(leaf))
            if watched is not None and watched.leaf() is leaf:
                if watched.untouched(leaf):
                    forgotten.append(leaf)
            elif leaf.is_leaf and self.windows:
                if watched is not None:
                    watched.handle.remove()
                self._watched[id(leaf)] = _Watched(leaf)
        if forgotten:
            warn_user(UserWarning(_problem(forgotten)))
        if forgotten or not self.windows:
            self._stop()

    def _stop(self) -> None:
        self.windows, self._first = 0, False
        for watched in self._watched.values():
            watched.handle.remove()
        self._watched.clear()


def _leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors `loss`'s backward accumulates into (its graph's AccumulateGrad nodes)."""
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _problem(leaves: list[torch.Tensor]) -> str:
    shapes = ", ".join(f"{type(leaf).__name__} of shape {tuple(leaf.shape)}" for leaf in leaves[:3])
    more = f" and {len(leaves) - 3} more" if len(leaves) > 3 else ""
    return (
        f"loss_fn trains {shapes}{more} that neither the model nor the optimizer holds: it is "
        "never stepped, and its .grad grows by every window's backward (nothing clears it). If "
        "it is a learnable loss weight (uncertainty weighting's log_var, a temperature), give "
        "it to the optimizer: optimizer.add_param_group({'params': [weight]}) or include it in "
        "its params; if it is a constant or a frozen network, make it with requires_grad=False, "
        "call .requires_grad_(False) on it, or .detach() it in loss_fn."
    )
