"""Optimizer steps refused inside an accumulation window, before they change anything.

A step on a partial, undivided sum of the window's gradients is never the full-batch step:

- `refuse_steps_inside`: a step pre-hook on the Accumulator's optimizer refuses the user's own
  `optimizer.step()` inside an open window (a copied loop's line, between two `micro_step()`
  calls or inside `loss_fn`), and names a second Accumulator stepping it;
- `steps_refused`: while a micro-batch's `loss_fn` and backward run (the window's first too), a
  global pre-hook refuses a step of ANY optimizer holding the window's parameters: PyTorch's
  optimizer-in-backward recipe (`register_post_accumulate_grad_hook` stepping one optimizer per
  parameter) would otherwise step once per micro-batch, silently.

Example:
    >>> import torch
    >>> from gradaccum import Accumulator
    >>> model = torch.nn.Linear(2, 1)
    >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=1)
    >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> for param in model.parameters():  # PyTorch's optimizer-in-backward recipe
    ...     _ = param.register_post_accumulate_grad_hook(lambda p: inner.step())
    >>> acc.step(torch.ones(2, 2), lambda m, b: m(b).sum())
    Traceback (most recent call last):
    ...
    RuntimeError: SGD.step() was called inside an accumulation window (0 micro-batches so far)...
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradaccum._grad_hooks import hooks_watched
from gradaccum._idle_step import warn_idle_step
from gradaccum._joined import JoinWatch
from gradaccum._window_registry import REGISTERED

__all__ = ["COMMITTING", "OpenWindow", "hooked_optimizer", "refuse_steps_inside", "steps_refused"]

# Where a wrapper that never ran `Optimizer.__init__` keeps the optimizer it steps: Lookahead's
# torch-optimizer (`optimizer`), timm (`_base_optimizer`), others (`base_optimizer`, `_optimizer`);
# torch.distributed.optim.PostLocalSGDOptimizer (`optim`), which averages the model after it.
_WRAPPED = ("optimizer", "_optimizer", "base_optimizer", "_base_optimizer", "optim")

# The optimizers an Accumulator's own window step is running on: a second Accumulator's window
# open over the same optimizer then names that Accumulator, not a stray optimizer.step().
COMMITTING: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class OpenWindow(Protocol):
    """What `refuse_steps_inside` reads of a window (`gradaccum.window.Window`)."""

    @property
    def is_open(self) -> bool: ...

    micro_batches: int
    params: list[torch.nn.Parameter]
    held: int  # the first `held` of `params` are the optimizer's
    joins: JoinWatch  # the optimizer's parameters that started to require grad mid-window
    committing: bool  # True while the Accumulator's own `optimizer.step()` runs
    running: bool  # True while a micro-batch's loss_fn and backward run (`steps_refused`)


def hooked_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer whose step hooks see `optimizer`'s steps: itself, or the one it wraps.

    A wrapper that adds to the step (Lookahead) but never ran `torch.optim.Optimizer.__init__`
    has no hooks of its own; its `step()` steps the optimizer it wraps, sharing its param
    groups, whose hooks then stand for it. None if there is no such optimizer.
    """
    if hasattr(optimizer, "_optimizer_step_pre_hooks"):
        return optimizer
    for name in _WRAPPED:
        inner = getattr(optimizer, name, None)
        if (
            isinstance(inner, torch.optim.Optimizer)
            and inner is not optimizer
            and getattr(inner, "param_groups", None) is optimizer.param_groups
        ):
            return hooked_optimizer(inner)
    return None


def refuse_steps_inside(optimizer: torch.optim.Optimizer, window: OpenWindow) -> None:
    """Make `optimizer.step()` raise, changing nothing, when called inside an open `window`.

    A loop moved to the Accumulator that kept its own `optimizer.step()`, between two
    `micro_step()` calls or inside `loss_fn`, would step on a partial, undivided sum of the
    window's gradients. A step pre-hook refuses it before anything changes; the Accumulator's
    own step, and steps between windows, pass. The hook holds the optimizer and the window
    weakly and is removed with the window.
    """
    REGISTERED.add(window)  # `load_checkpoint` refuses weights loaded under it while open
    hooked = hooked_optimizer(optimizer)
    if hooked is None:  # refused at construction (`check_optimizer`)
        return
    owner, outer, ref = weakref.ref(hooked), weakref.ref(optimizer), weakref.ref(window)

    def hook(stepped: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        open_window = ref()
        if open_window is None or open_window.committing:
            return
        if not (open_window.is_open or open_window.running):  # between windows: the user's
            return
        if stepped is not owner():  # a copy of the optimizer
            return
        name = type(outer() or stepped).__name__  # the wrapper the user steps (Lookahead)
        if stepped in COMMITTING:  # another Accumulator's window step, not the user's
            raise RuntimeError(
                f"another Accumulator steps this {name} while a window of an "
                f"Accumulator over it is open ({open_window.micro_batches} micro-batches so "
                "far): the step would clear that window's partial gradients. Settle the open "
                "window first (its acc.flush('step') or acc.flush('drop')), or drive both loops "
                "with one Accumulator. Nothing was stepped: the open window is kept, the "
                "stepping one was discarded."
            )
        raise RuntimeError(
            f"{name}.step() was called inside an accumulation window "
            f"({open_window.micro_batches} micro-batches so far): it would step on a partial, "
            "undivided sum of the window's gradients. Remove it: the Accumulator steps the "
            "optimizer itself when the window is full. Nothing was stepped; the window is kept."
        )

    weakref.finalize(window, hooked.register_step_pre_hook(hook).remove)


def _refuse_running(stepped: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: refuse a step of a running window's parameters.

    Outside micro-batches, a step with no gradient over a window's parameters is warned of
    (`_idle_step`: a new optimizer never given to the Accumulator).
    """
    if stepped in COMMITTING:  # another Accumulator's commit (its own hook names it)
        return
    if not _RUNNING:
        warn_idle_step(stepped)
        return
    for window in tuple(_RUNNING):  # a copy: another thread's micro-batch may end meanwhile
        mine = set(map(id, window.params))
        if any(id(p) in mine for group in stepped.param_groups for p in group["params"]):
            raise RuntimeError(
                f"{type(stepped).__name__}.step() was called inside an accumulation window "
                f"({window.micro_batches} micro-batches so far), while a micro-batch's loss_fn "
                "or backward ran: it would step on a partial, undivided sum of the window's "
                "gradients, once per micro-batch. An optimizer stepped in the backward (a "
                "register_post_accumulate_grad_hook, PyTorch's optimizer-in-backward recipe) "
                "cannot accumulate: remove the hook (handle.remove()) and let the Accumulator "
                "step its optimizer once per window. Nothing was stepped."
            )


# The windows whose micro-batch runs, in any thread: list.append and list.remove are atomic.
_RUNNING: list[OpenWindow] = []
_LOCK = threading.Lock()
_HOOKED: list[bool] = []  # the global hook is registered once, on first use


class steps_refused:  # noqa: N801  (a context manager used like a function)
    """While a micro-batch runs: refuse any optimizer's step of the window's parameters.

    The first micro-batch's too, before the window counts as open. PyTorch's optimizer-in-backward
    recipe steps each parameter from a `register_post_accumulate_grad_hook`: under accumulation
    that is a step per micro-batch on a partial, undivided sum, silently. Refused before the step
    changes anything, by one global pre-hook registered once (registering one per micro-batch
    would mutate torch's hook dict while another thread's step may iterate it); a CUDA backward
    runs its hooks in torch's device threads, so the running windows are process-wide. A class,
    not a generator: it runs twice per micro-batch.
    """

    __slots__ = ("hooks", "window")

    def __init__(self, window: OpenWindow) -> None:
        self.window, self.hooks = window, hooks_watched(window)  # the user's gradient hooks

    def __enter__(self) -> None:
        if not _HOOKED:  # once per process
            with _LOCK:
                if not _HOOKED:
                    register_optimizer_step_pre_hook(_refuse_running)
                    _HOOKED.append(True)
        _RUNNING.append(self.window)
        self.window.running = True
        if self.hooks is not None:  # bracketed in the first micro-batches (`_grad_hooks`)
            self.hooks.enter(self.window)

    def __exit__(self, *exc: object) -> None:
        self.window.running = False
        _RUNNING.remove(self.window)
        if self.hooks is not None:
            self.hooks.exit(failed=exc[0] is not None)
