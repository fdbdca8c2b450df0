"""The windows of every live Accumulator, to refuse loading weights under an open one.

`load_checkpoint(path, model=model, optimizer=optimizer)` without `accumulator=` replaces the
weights and the optimizer state, but an Accumulator over the model may hold an open window: the
summed gradients of micro-batches run at the OLD weights. The next `micro_step()` calls added
to that window and stepped on it (a rollback after an error in the loop: 6e-2 off the
full-batch step, silently, and every later window cut at another place). Such a load is now
refused before anything changes, naming `accumulator=acc` (the saved window replaces the open
one) and `acc.flush('drop')`. The error for gradients changed between two micro-batches of a
window (`gradients_changed_error`) names another Accumulator's window open over them, if any.

Example:
    >>> import torch
    >>> from gradaccum._window_registry import open_windows_over
    >>> model = torch.nn.Linear(2, 1)
    >>> open_windows_over(list(model.parameters()), exclude=None)
    []
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch

__all__ = [
    "REGISTERED",
    "busy_error",
    "gradients_changed_error",
    "open_windows_over",
    "refuse_loading_under_open_window",
]


class _Window(Protocol):
    @property
    def is_open(self) -> bool: ...

    micro_batches: int
    count: int
    params: list[torch.nn.Parameter]


# Every Accumulator's window (added where its optimizer's step hook is set), held weakly.
REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()


def open_windows_over(params: Iterable[torch.Tensor], *, exclude: Any) -> list[_Window]:
    """The open registered windows accumulating into any of `params`, except `exclude`."""
    wanted = {id(p) for p in params}
    return [
        window
        for window in tuple(REGISTERED)  # a copy: a window may be collected meanwhile
        if window is not exclude and window.is_open and any(id(p) in wanted for p in window.params)
    ]


def refuse_loading_under_open_window(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, accumulator: Any
) -> None:
    """Raise a `ValueError` if an Accumulator other than `accumulator` has an open window here.

    The window is one over `model`'s or `optimizer`'s parameters; `accumulator`'s own window
    is replaced by the load, so it is no obstacle.
    """
    own = getattr(getattr(accumulator, "_engine", None), "window", None)
    params = [*model.parameters()]
    params += [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
    found = open_windows_over(params, exclude=own)
    if not found:
        return
    window = found[0]
    raise ValueError(
        f"cannot load a checkpoint into this model: an Accumulator over it has an open window "
        f"of {window.micro_batches} micro-batches ({window.count} items counted) whose "
        "gradients were taken at the current weights; loading new weights under it would mix "
        "them into the next step. Pass accumulator=acc to load_checkpoint (the saved window "
        "state replaces the open one), or discard the open window first with "
        "acc.flush('drop') (acc.flush('step') to keep its update). Nothing was loaded."
    )


def busy_error(params: list[torch.nn.Parameter], names: dict[int, str]) -> RuntimeError | None:
    """The refusal of a window about to open over `params` while another holds their gradients.

    Opening sets the gradients its parameters hold aside (to put them back if it fails): those
    of another Accumulator's open window over shared parameters (two optimizers over one
    encoder, or two Accumulators built on one module, their `micro_step()` calls alternating)
    would be taken from it, so neither step could be the full-batch one. Refused before
    anything runs, the other window kept whole. Shared parameters it holds no gradient of
    (its loss does not reach them) are no obstacle.
    """
    if not any(window.is_open for window in tuple(REGISTERED)):  # the usual case: no set built
        return None
    for window in open_windows_over(params, exclude=None):
        wanted = set(map(id, params))
        shared = [p for p in window.params if p.grad is not None and id(p) in wanted]
        if not shared:
            continue
        shown = [names.get(id(p), f"<parameter of shape {tuple(p.shape)}>") for p in shared]
        listed = ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "")
        return RuntimeError(
            f"another Accumulator has a window open ({window.micro_batches} micro-batches so "
            f"far) holding the partial gradients of {len(shared)} of this window's parameters "
            f"({listed}): opening this window would set them aside, so neither step could be "
            "the full-batch one (two windows interleaved over shared parameters: two optimizers "
            "over one encoder, or two Accumulators built on one module, their micro_step() "
            "calls alternating). Run the other window to its step (or its acc.flush('step') or "
            "flush('drop')) before this one's first micro-batch, or train both losses with one "
            "Accumulator (one optimizer with a param group per part, LossSum.terms). Two "
            "Accumulators over one module whose parts their optimizers hold (a GAN's generator "
            "and discriminator): give each its own part as the model, "
            "Accumulator(gan.generator, g_optimizer). (An Accumulator left by a loop that raised "
            "between two micro_step() calls keeps its window until it is garbage-collected.) "
            "Nothing ran; the other window is kept."
        )
    return None


def gradients_changed_error(
    touched: list[torch.nn.Parameter], names: dict[int, str], window: object
) -> RuntimeError:
    """The error for gradients of an open streaming window changed between two micro-batches.

    A copied loop's `zero_grad()` is the usual cause (the gradients cleared), or its clipping
    after each micro-batch (changed in place: named with `max_grad_norm=` and the step
    pre-hook); a backward outside this Accumulator is the other: a second Accumulator's
    micro-batch (a GAN's generator loss flowing through the discriminator, whose window is open)
    adds into the window's sums; a second Accumulator over the whole module clears them with its
    windows. All are named; another Accumulator's window open over `touched` (not `window`, this
    one's), when there is one, is named alone.
    """
    named = [names.get(id(p), "<unnamed>") for p in touched[:3]]
    others = open_windows_over(touched, exclude=window)
    if others:  # two Accumulators' micro_step() calls interleaved
        return RuntimeError(
            f"the gradients of {len(touched)} parameters ({', '.join(named)}, ...) changed "
            "between two micro-batches of one window, and another Accumulator has a window open "
            f"over them ({others[0].micro_batches} micro-batches so far): two windows "
            "interleaved over shared parameters (two optimizers over one encoder, micro_step() "
            "calls alternating) set each other's partial gradients aside, so neither step can "
            "be the full-batch one. "
            "Run one window to its step before the other's first micro_step(), or train both "
            "losses with one Accumulator (one optimizer with a param group per part, the two "
            "losses returned as LossSum.terms). Two Accumulators over one module whose parts "
            "their optimizers hold (a GAN's generator and discriminator): give each its own "
            "part as the model, Accumulator(gan.generator, g_optimizer). This window was "
            "discarded; the other one is refused at its next micro_step()."
        )
    cleared = all(p.grad is None or not bool(p.grad.any()) for p in touched)  # the error's path
    cause = (
        "an optimizer.zero_grad() (or another change to .grad) inside the accumulation loop "
        "would silently drop part of the window, and a backward outside this Accumulator would "
        "add to it. Remove the zero_grad(): the Accumulator clears gradients itself after each "
        "step."
        if cleared
        else "they were changed in place, not cleared: a clip_grad_norm_() or clip_grad_value_() "
        "after each micro_step() (a copied loop) would clip partial sums, and a backward outside "
        "this Accumulator would add to them. Clip with Accumulator(..., max_grad_norm=...), or by "
        "value or per param group in an optimizer step pre-hook (README, 'Your own gradient "
        "processing'): both see the window's whole gradient, once per step."
    )
    return RuntimeError(
        f"the gradients of {len(touched)} parameters ({', '.join(named)}, ...) changed between two "
        f"micro-batches of one window: {cause} A backward of another Accumulator's "
        "micro_step() (a GAN's generator loss through the discriminator while the "
        "discriminator's window is open) is kept out by requires_grad_(False) on these "
        "parameters around that call, or by running the two windows one after the other. "
        "Another Accumulator whose model holds these parameters outside its optimizer (both "
        "built on a GAN's whole module) sets their gradients aside and clears them with each of "
        "its windows: give each Accumulator its own part as the model, "
        "Accumulator(gan.generator, g_optimizer). The window was discarded."
    )
