"""Weights of a module outside the model changed between two micro-batches of one window.

A GAN's generator loss runs the discriminator, a module outside the generator's Accumulator.
With the two Accumulators' `micro_step()` calls interleaved (D's micro-batch, then G's, per
micro-batch of the stream), D's window steps on its last micro-batch, before G's last one: G's
window runs its earlier micro-batches through the old discriminator and its last through the
new one, so its step is the full-batch step of neither (5e-2 off the plain alternating loop after
3 rounds, silently). The same holds for any module the loss holds (a teacher updated by EMA
after every micro-batch, another optimizer's step). After each micro-batch of the first windows
the version counters of the parameters of the modules `loss_fn` holds outside the model are
kept; a change at the next micro-batch of the same window warns once, naming the module and the
order that is exact (the other window run to its step first).

Example:
    >>> import torch
    >>> disc = torch.nn.Linear(2, 1)
    >>> def g_loss(g, z):
    ...     return -disc(g(z)).mean()
    >>> watch = OutsideWeights(torch.nn.Linear(3, 2))
    >>> watch.check(g_loss) is None
    True
    >>> with torch.no_grad():
    ...     _ = disc.weight.add_(1.0)  # the discriminator's step, mid-window
    >>> "disc.weight" in watch.check(g_loss)
    True
"""

from __future__ import annotations

import torch

from gradaccum._teacher import held_outside

__all__ = ["OutsideWeights"]


class OutsideWeights:
    """Watch the weights of the modules `loss_fn` holds outside `model`, the first `windows`."""

    def __init__(self, model: torch.nn.Module | None, windows: int = 2) -> None:
        self.model = model
        self.windows = windows + 1 if model is not None else 0  # the first open takes one
        self._marks: dict[int, tuple[str, str, torch.nn.Parameter, int]] = {}

    @property
    def active(self) -> bool:
        return self.windows > 0

    def open_window(self) -> None:
        """A new window: weights changed since the last one are a step between windows."""
        self.windows, self._marks = max(self.windows - 1, 0), {}

    def check(self, loss_fn: object) -> str | None:
        """Why this micro-batch ran through other weights than the window's earlier ones."""
        if not self.windows or self.model is None:
            return None
        changed = [
            (held, name)
            for held, name, param, version in self._marks.values()
            if param._version != version  # an optimizer's step, a copy_(), a clamp_()
        ]
        self._marks = {
            id(param): (held, f"{held}.{name}", param, param._version)
            for held, module in held_outside(loss_fn, self.model)
            for name, param in module.named_parameters()
        }
        if not changed:
            return None
        self.windows, self._marks = 0, {}  # told once
        owner, names = changed[0][0], [name for _, name in changed]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        shown = ", ".join(names[:3]) + more
        return (
            f"loss_fn runs {owner}, a module outside the model whose weights ({shown}) changed "
            "between two micro-batches of this window (the step of its own Accumulator or "
            "optimizer, e.g. a GAN's discriminator whose micro_step() calls are interleaved with "
            "the generator's: its window steps before the generator's last micro-batch). This "
            f"window's micro-batches ran through two versions of {owner}, so its step is not the "
            f"full-batch step of the alternating loop. Run {owner}'s window to its step before "
            f"this window's first micro_step() (all of {owner}'s micro_step() calls for the "
            "batch, then these), or use acc.step(batch, loss_fn) for each; if the loop or "
            "loss_fn moves it itself (a momentum or EMA target, a weight copy), move it once per "
            "window, when result.stepped."
        )
