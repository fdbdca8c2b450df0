"""Gradient hooks on parameters: run once per micro-batch, exact only if they are linear.

A hook registered with `param.register_hook` changes the gradient of each backward, so under
accumulation it sees one micro-batch's share, not the window's gradient: a fixed scaling (or a
fixed mask) adds up to the same step, a clamp, a per-parameter norm clip or added noise does
not ("per-layer gradient clipping" written as a hook: 4e-2 off, silently). A
`register_post_accumulate_grad_hook` that changes `param.grad` in place runs on the running sum
of the window's gradients, so it applies again to what it changed already: a scaling compounds
(0.5 becomes 0.5 ** k for the first micro-batch's share), a clamp clips partial sums; only
zeroing fixed entries adds up. Neither can be told from the hook's code, so the first few
micro-batches of a window bracket the hooks of each hooked parameter with two of ours, reading
the gradient before and after them, and warn once when what they did is none of these. Each
window's start looks for hooks registered since (a callback's at epoch 2): new ones are
bracketed for as many micro-batches again.

Example:
    >>> import torch, warnings
    >>> w = torch.nn.Parameter(torch.zeros(3))
    >>> _ = w.register_hook(lambda g: g.clamp(-1, 1))
    >>> window = type("W", (), {"params": [w], "micro_batches": 0})()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     for x in (torch.tensor([3.0, 0.5, 1.0]), torch.tensor([0.5, 3.0, 1.0])):
    ...         watch = hooks_watched(window)
    ...         watch.enter(window)
    ...         (w * x).sum().backward()
    ...         watch.exit(failed=False)
    ...         window.micro_batches += 1
    >>> "not a fixed scaling" in str(caught[0].message)
    True
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from gradaccum._non_additive import NonAdditiveModule
from gradaccum._warnings import warn_user

__all__ = ["hooked_parameters", "hooks_watched"]

_TORCH = os.path.dirname(torch.__file__)
_WATCHED = 16  # micro-batches bracketed per set of hooks at most (then the hooks run alone)
_FIX = (
    "Clip, scale or log the window's gradient in an optimizer step pre-hook instead "
    "(optimizer.register_step_pre_hook): it runs once per step actually taken, on the "
    "divided, unscaled full-batch gradients (README, 'Your own gradient processing')."
)


def _hooks(param: torch.Tensor, post: bool) -> Any:
    return param._post_accumulate_grad_hooks if post else param._backward_hooks


def _torch_own(hook: Any) -> bool:
    """Whether `hook` is torch's (DDP, FSDP, a parametrization's), not the user's."""
    code = getattr(hook, "__code__", None)
    return code is not None and code.co_filename.startswith(_TORCH)


def _where(hooks: Any, ours: set[int]) -> str:
    """The user's first hook among `hooks`, as `name at file:line`."""
    hook = next((h for key, h in hooks.items() if key not in ours), None)
    code = getattr(hook, "__code__", None)
    name = getattr(hook, "__qualname__", type(hook).__name__)
    return f"{name} at {code.co_filename}:{code.co_firstlineno}" if code is not None else name


class _Watch:
    """One Accumulator's (or `accumulate_grad`'s) watch over its parameters' hooks."""

    def __init__(self) -> None:
        self.left = 0
        self.known: frozenset[tuple[bool, int]] = frozenset()  # the user's hooks (by key) seen
        self.told = False
        self.seen: dict[tuple[int, bool], torch.Tensor] = {}  # ratios or zeroed masks, a window
        self.handles: list[Any] = []
        self.before: dict[tuple[int, bool], torch.Tensor] = {}
        self.problem: str | None = None
        self.where: dict[tuple[int, bool], str] = {}
        self.fresh: dict[tuple[int, bool], bool] = {}  # no `.grad` before the backward

    def rearm(self, params: Any) -> None:
        """At a window's start: bracket again if the user's hooks changed since last looked."""
        found = frozenset(
            (post, key)
            for param in params
            for post in (False, True)
            if (hooks := _hooks(param, post))
            for key, hook in hooks.items()
            if not _torch_own(hook)
        )
        if found != self.known:
            self.known, self.left = found, _WATCHED if found else 0

    def enter(self, window: Any) -> None:
        self.left -= 1
        if window.micro_batches == 0:  # a new window: its hooks may scale by another factor
            self.seen.clear()
        for param in window.params:
            for post in (False, True):
                hooks = _hooks(param, post)
                if hooks and not all(map(_torch_own, hooks.values())):
                    self._bracket(param, post, hooks)

    def _bracket(self, param: torch.Tensor, post: bool, hooks: Any) -> None:
        key = (id(param), post)
        shape = tuple(param.shape)
        tensor: Any = param  # torch leaves both register methods unannotated
        if post:
            first = tensor.register_post_accumulate_grad_hook(lambda p: self._read(key, p.grad))
            last = tensor.register_post_accumulate_grad_hook(lambda p: self._post(key, p, shape))
        else:
            first = tensor.register_hook(lambda g: self._read(key, g))
            last = tensor.register_hook(lambda g: self._pre(key, g, shape))
        # Ours first and last, the user's between. Torch walks the dict's own order (not
        # OrderedDict.move_to_end's), so the entries are put back after ours.
        entries = list(hooks.items())
        hooks.clear()
        hooks.update(entries[-2:-1] + entries[:-2] + entries[-1:])
        self.handles += [first, last]
        self.where[key] = _where(hooks, {first.id, last.id})
        self.fresh[key] = param.grad is None

    def _read(self, key: tuple[int, bool], grad: torch.Tensor | None) -> None:
        if grad is not None:
            self.before[key] = grad.detach().clone()

    def _scaled(self, key: tuple[int, bool], raw: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether `grad` is `raw` times the same elementwise factors as in the window so far."""
        defined = raw != 0
        ratio = torch.where(defined, grad / torch.where(defined, raw, 1), torch.nan)
        seen = self.seen.setdefault(key, ratio)
        both = defined & ~seen.isnan()
        tol = max(1e-6, 16 * torch.finfo(ratio.dtype).eps)
        self.seen[key] = torch.where(seen.isnan(), ratio, seen)
        return not bool((grad[~defined] != 0).any()) and torch.allclose(
            ratio[both], seen[both], rtol=tol, atol=tol
        )

    def _pre(self, key: tuple[int, bool], grad: torch.Tensor, shape: tuple[int, ...]) -> None:
        """After a tensor hook: the same gradient, or a fixed elementwise scaling of it."""
        raw = self.before.pop(key, None)
        if raw is None or self.problem is not None or torch.equal(raw, grad):
            return
        if not self._scaled(key, raw, grad.detach()):
            self.problem = (
                f"the gradient hook {self.where[key]} (register_hook, on a parameter of shape "
                f"{shape}) changes each micro-batch's gradient in a way that is not a fixed "
                "scaling (a clamp, a per-parameter norm clip, added noise): it runs once per "
                "micro-batch, on that micro-batch's share, so the window's gradient is not the "
                "hook applied to the full-batch gradient, and the step is not the full-batch "
                "step. " + _FIX
            )

    def _post(self, key: tuple[int, bool], param: torch.Tensor, shape: tuple[int, ...]) -> None:
        """After a post-accumulate hook: a fixed scaling of a fresh `.grad`, a sum left alone.

        A fresh `.grad` is one micro-batch's share (the window's first, or each one when
        low-precision gradients move to buffers); on a running sum only factors of 0 and 1 add
        up (fixed entries zeroed).
        """
        before, grad = self.before.pop(key, None), param.grad
        fresh, self.fresh[key] = self.fresh.get(key, False), False
        if before is None or grad is None or self.problem is not None or torch.equal(before, grad):
            return
        summed = self._scaled(key, before, grad.detach())
        if summed and not fresh:  # applied again to a sum it changed: factors of 0 or 1 only
            factors = self.seen[key][~self.seen[key].isnan()]
            summed = bool(((factors == 0) | (factors == 1)).all())
        if not summed:
            self.problem = (
                f"the post-accumulate-grad hook {self.where[key]} (on a parameter of shape "
                f"{shape}) changed param.grad in place: it runs after each micro-batch's "
                "backward, on the running sum of the window's gradients, so it applies again "
                "to what it changed already (a scaling compounds, a clamp clips partial sums) "
                "and the step is not the full-batch step. " + _FIX
            )

    def exit(self, failed: bool) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.before.clear()
        problem, self.problem = self.problem, None
        if problem is not None and not failed:
            self.told = True
            warn_user(UserWarning(problem))


_WATCHES: weakref.WeakKeyDictionary[Any, _Watch] = weakref.WeakKeyDictionary()


def hooks_watched(window: Any) -> _Watch | None:
    """The watch to bracket a micro-batch's backward with (`enter`, `exit`), or None.

    None once it warned, and after its micro-batches, until a window opens over other hooks.
    """
    watch = _WATCHES.get(window)
    if watch is None:
        watch = _WATCHES[window] = _Watch()
    if watch.told:
        return None
    if window.micro_batches == 0:  # hooks registered since the last window's start
        watch.rearm(window.params)
    return None if watch.left <= 0 else watch


def hooked_parameters(model: torch.nn.Module) -> list[NonAdditiveModule]:
    """The parameters whose gradient hooks `check_equivalence`'s copies run without.

    A deep copy of a parameter does not carry its hooks, so the check compares the gradients
    before any hook: it cannot see what a hook does per micro-batch, and names it instead.
    """
    found = []
    for name, param in model.named_parameters():
        for post in (False, True):
            hooks = _hooks(param, post)
            if hooks and not all(map(_torch_own, hooks.values())):
                kind = "register_post_accumulate_grad_hook" if post else "register_hook"
                found.append(
                    NonAdditiveModule(
                        name,
                        "gradient hook",
                        f"{_where(hooks, set())} ({kind}) runs once per micro-batch on "
                        + ("the window's running sum" if post else "that micro-batch's share")
                        + "; this check's copies of the model run without it",
                    )
                )
    return found
