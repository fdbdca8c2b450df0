"""Parameters that join the optimizer's trainable set in the middle of a window.

A window steps the parameters the optimizer held with `requires_grad=True` when it opened (see
`gradaccum.window.window_parameters`). One unfrozen, or added by `add_param_group`, between two
`micro_step()` calls gets a gradient from the window's later micro-batches only, and the
boundary never divides, clips, checks or (fp16) unscales it: `optimizer.step()` would move it by
a partial, loss-scaled sum. `JoinWatch` puts such gradients back as they were before the window,
just before the step, so the step is the full-batch one with the newcomer still out; it takes
part from the next window.

Example:
    >>> import torch
    >>> frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    >>> watch = JoinWatch(torch.optim.SGD([frozen], lr=0.1))
    >>> watch.open([])
    >>> frozen.requires_grad_(True).grad = torch.ones(2)  # unfrozen, then a backward
    >>> [tuple(p.shape) for p in watch.drop()], frozen.grad
    ([(2,)], None)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradaccum._warnings import warn_user

__all__ = ["JoinWatch", "warn_joined"]


class JoinWatch:
    """Notices the optimizer's parameters that start to require grad after a window opened."""

    def __init__(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._optimizer = optimizer
        self._inside: set[int] = set()
        self._aside: dict[int, torch.Tensor] = {}  # frozen parameters' own gradients
        self._armed = False

    def open(self, held: Sequence[torch.nn.Parameter]) -> None:
        """Remember the window's own parameters (`held`: the optimizer's trainable ones).

        A frozen parameter that holds a gradient (left from before it was frozen) has it set
        aside, so that a backward after an unfreeze cannot add into it in place.
        """
        if self._optimizer is None:
            return
        self._inside = set(map(id, held))
        self._aside = {}
        for param in self._frozen():
            if param.grad is not None:
                self._aside[id(param)] = param.grad
                param.grad = None
        self._armed = True

    def drop(self) -> list[torch.nn.Parameter]:
        """Put back the gradients the window's newcomers hold; return those that got one.

        Frozen parameters get back the gradient set aside (still frozen or not); runs once per
        window (the boundary, or the window's end if it never got there).
        """
        if not self._armed or self._optimizer is None:
            return []
        self._armed = False
        joined = []
        for group in self._optimizer.param_groups:
            for param in group["params"]:
                if id(param) in self._inside:
                    continue
                if param.requires_grad and param.grad is not None:
                    joined.append(param)
                if param.requires_grad or id(param) in self._aside:
                    param.grad = self._aside.get(id(param))
        return joined

    def _frozen(self) -> list[torch.nn.Parameter]:
        assert self._optimizer is not None
        return [
            param
            for group in self._optimizer.param_groups
            for param in group["params"]
            if not param.requires_grad
        ]


def warn_joined(joined: Sequence[torch.nn.Parameter], names: dict[int, str]) -> None:
    """Warn that `joined` (from `JoinWatch.drop`) sat out this window's step."""
    if not joined:
        return
    shown = [names.get(id(p), f"<optimizer param of shape {tuple(p.shape)}>") for p in joined]
    listed = ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "")
    warn_user(
        UserWarning(
            f"{len(joined)} parameters ({listed}) were unfrozen or added to the optimizer in the "
            "middle of an accumulation window: their gradient covers only its later micro-batches, "
            "so it was dropped and they were not stepped; they take part from the next window. "
            "Unfreeze or add_param_group() between windows (after a result with stepped=True) "
            "to include them in a whole window."
        )
    )
