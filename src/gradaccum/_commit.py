"""The window's commit: `optimizer.step()`, taken whole, refused before it starts, or reported.

Guards around the one call that changes the model, none of which copies a parameter:

- the scheduler is tried first (`try_scheduler`): one of torch's own is stepped, then put back
  (its own state and the param groups' values), so one that would raise after the step
  (`OneCycleLR` past `total_steps`, a `LambdaLR` whose lambda fails) raises before anything
  changed. Its real step follows the commit (`SchedulerSteps`), which also warns once when the
  scheduler was stepped outside the Accumulator too;
- `optimizer.step()` is watched by the parameters' `_version` counters, read before the call
  by one C-level `map` (no Python frame per parameter), and, for an optimizer not from
  `torch.optim` (which may write through `p.data`, leaving the versions alone) or one with
  `fused=True` (whose kernels leave them alone too), by each parameter's float64 norm (one
  foreach kernel). An optimizer that raises having changed
  nothing, typically torch's own input checks, has the state entries its lazy initialization
  created removed, so nothing changed at all;
- an optimizer that raises after it updated some parameters (a second param group failing
  torch's checks, a custom optimizer) cannot be undone without a copy of every parameter and
  its state, which costs the memory of a second model. Instead `PartialStepError` names the
  parameters it changed and how to continue, and the engine refuses every later window until
  a state is loaded, so a retried call can never step the same parameters twice;
- a step pre-hook on the optimizer (`refuse_steps_inside`) refuses the user's own
  `optimizer.step()` inside an open window, before it changes anything; while a micro-batch's
  `loss_fn` and backward run, a global one (`steps_refused`) refuses any optimizer's step of
  the window's parameters (a `register_post_accumulate_grad_hook` stepping in the backward);
  both live in `_step_refusal` and are re-exported here, where the engine takes its guards.

Example:
    >>> import torch
    >>> param = torch.nn.Parameter(torch.ones(2))
    >>> param.grad = torch.ones(2)
    >>> step_optimizer(torch.optim.SGD([param], lr=0.5), [param], {})
    >>> param.tolist()
    [0.5, 0.5]
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from gradaccum._checks import check_scheduler, check_scheduler_optimizer
from gradaccum._dtensor import local_tensor
from gradaccum._joined import warn_joined, warn_left_out
from gradaccum._oom import optimizer_step_guard
from gradaccum._step_refusal import (
    COMMITTING,
    OpenWindow,
    hooked_optimizer,
    refuse_steps_inside,
    steps_refused,
)
from gradaccum._warnings import warn_user
from gradaccum.result import PartialStepError

__all__ = [
    "Breakable",
    "PartialStepError",
    "SchedulerSteps",
    "refuse_steps_inside",
    "run_each",
    "steps_refused",
    "step_optimizer",
    "triable",
    "try_scheduler",
]

_VERSION = operator.attrgetter("_version")
_SHOWN_NAMES = 5


class Breakable(Protocol):
    """What `step_optimizer` marks when a step failed halfway (the `Engine`)."""

    broken: str | None


def step_optimizer(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    names: dict[int, str],
    owner: Breakable | None = None,
    window: OpenWindow | None = None,
) -> None:
    """`optimizer.step()`; if it raises, nothing changed, or `PartialStepError` says what did.

    Args:
        optimizer: The optimizer to step.
        params: The parameters it holds (watched for changes).
        names: Parameter names by `id`, for the error.
        owner: Its `broken` is set to the message when the step raised after changing
            parameters (the engine then refuses windows until a state is loaded).
        window: The open window whose step this is: its `committing` flag lets the step through
            `refuse_steps_inside`'s hook (per window, so no process-wide flag).

    Raises:
        PartialStepError: If `optimizer.step()` raised after changing some of `params`.
    """
    versions = list(map(_VERSION, params))
    norms = _fingerprint(optimizer, params)
    # A wrapper (Lookahead) steps the optimizer it wraps, whose state and hooks are its own.
    inner = hooked_optimizer(optimizer)
    committing = {optimizer} if inner is None else {optimizer, inner}
    states = list({id(o.state): o.state for o in committing}.values())
    known = [len(s) for s in states]  # dicts: state created by this step comes after `known`
    if window is not None:
        warn_joined(window.joins.drop(), names)  # unfrozen mid-window: not in this step
        outside = window.params[window.held :]  # the model's others: unfrozen and left out?
        warn_left_out(window.joins.left_out(outside), names, optimizer)
        window.committing = True  # the step pre-hook lets this step through
        COMMITTING.update(committing)
    try:
        with optimizer_step_guard():  # out of memory here is not rerun smaller: it may have stepped
            optimizer.step()
    except BaseException as error:
        changed = _changed(params, versions, norms)
        if not changed:
            for state, count in zip(states, known, strict=True):
                for param in list(state)[count:]:  # lazily created by this failed step
                    del state[param]
            raise
        message = _partial_message(optimizer, changed, len(params), names, error)
        if owner is not None:
            owner.broken = message
        if not isinstance(error, Exception):  # Ctrl-C mid-update: keep its type, say what changed
            if hasattr(error, "add_note"):
                error.add_note(message)
            raise
        raise PartialStepError(message) from error
    finally:
        if window is not None:
            window.committing = False
            COMMITTING.difference_update(committing)


def run_each(*parts: Callable[[], object]) -> None:
    """Call every part, even after one raised; then raise the first error (the commit's close).

    After `optimizer.step()` the window must end closed whatever fails on the way (a scheduler,
    Ctrl-C): one left open with the step's gradients would be stepped again by the next call.
    """
    first: BaseException | None = None
    for part in parts:
        try:
            part()
        except BaseException as error:
            if first is None:
                first = error
    if first is not None:
        raise first


def _fingerprint(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> list[torch.Tensor] | None:
    """Each parameter's float64 norm, where versions may miss an update; else None.

    torch's optimizers change parameters in place, which bumps their `_version`, except with
    `fused=True`, whose kernels leave it alone (seen on CPU); others may write through `p.data`
    or their own kernels (bitsandbytes), which does not either. One foreach kernel over the
    parameters, only for those optimizers; None where it cannot run.
    """
    fused = any(group.get("fused") for group in optimizer.param_groups)
    if type(optimizer).__module__.startswith("torch.optim") and not fused:
        return None
    try:
        return _norms(params)
    except (RuntimeError, TypeError):  # e.g. parameters on several devices, or no float64
        return None


def _norms(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    local = [local_tensor(p).detach() for p in params]
    return list(torch._foreach_norm(local, 2, dtype=torch.float64))


def _changed(
    params: Sequence[torch.Tensor], versions: list[int], norms: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """The parameters a failed step changed: by their versions, and by their norms if taken."""
    moved = [p._version != v for p, v in zip(params, versions, strict=True)]
    if norms is not None:
        for index, (a, b) in enumerate(zip(norms, _norms(params), strict=True)):
            moved[index] = moved[index] or not bool((a == b) | (a.isnan() & b.isnan()))
    return [p for p, m in zip(params, moved, strict=True) if m]


def _partial_message(
    optimizer: torch.optim.Optimizer,
    changed: list[torch.Tensor],
    total: int,
    names: dict[int, str],
    error: BaseException,
) -> str:
    shown = [names.get(id(p), f"<optimizer param of shape {tuple(p.shape)}>") for p in changed]
    listed = ", ".join(shown[:_SHOWN_NAMES]) + (", ..." if len(shown) > _SHOWN_NAMES else "")
    return (
        f"{type(optimizer).__name__}.step() raised ({type(error).__name__}: {error}) after it "
        f"had already updated {len(changed)} of its {total} parameters ({listed}); they and "
        "the optimizer state cannot be put back, so this Accumulator refuses further windows "
        "rather than step them twice. Fix the cause, then reload your last checkpoint "
        "(gradaccum.load_checkpoint(path, model=..., optimizer=..., accumulator=acc)), or build "
        "a new Accumulator to continue from the half-updated weights knowingly."
    )


def try_scheduler(scheduler: Any) -> None:
    """Step one of torch's schedulers and put it back: raise now what its step would raise later.

    The param groups' values it sets (lr, momentum, betas; tensor values in place) and its own
    state are restored whether it raised or not. Only torch's own classes are tried (`triable`).
    """
    if not triable(scheduler):
        return
    state = copy.deepcopy(scheduler.state_dict())  # a scheduler may change its lists in place
    state_groups = scheduler.optimizer.param_groups
    groups = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
        for g in state_groups
    ]
    try:
        with warnings.catch_warnings():  # its first step comes before optimizer.step() here
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
    except Exception as error:
        if hasattr(error, "add_note"):
            error.add_note(
                f"gradaccum: {type(scheduler).__name__}.step() was tried before optimizer.step() "
                "and raised, so nothing was stepped; the window was discarded. A scheduler that "
                "runs out of steps (OneCycleLR's total_steps) needs a longer schedule or a stop "
                "before it."
            )
            built, count = len(getattr(scheduler, "base_lrs", ())), len(state_groups)
            if built and built != count:  # the usual cause of its zip() or 'initial_lr' error
                error.add_note(
                    f"gradaccum: {type(scheduler).__name__} was built for {built} param groups, "
                    f"the optimizer has {count} (add_param_group after the scheduler): build "
                    "the scheduler again over all of them and set acc.scheduler to it."
                )
        raise
    finally:
        scheduler.load_state_dict(state)
        for group, saved in zip(scheduler.optimizer.param_groups, groups, strict=True):
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and isinstance(group.get(key), torch.Tensor):
                    group[key].copy_(value)
                else:
                    group[key] = value


def triable(scheduler: Any) -> bool:
    """Whether `scheduler` is one of torch's, whose lr follows from its own state alone.

    Others may read the optimizer's state after its step (transformers' `AdafactorSchedule`),
    which a try before the step cannot give them; they run after the commit only.
    """
    if type(scheduler).__module__ != torch.optim.lr_scheduler.__name__:
        return False
    return all(triable(inner) for inner in getattr(scheduler, "_schedulers", ()))


class SchedulerSteps:
    """Takes the scheduler's step after a commit, and notices steps taken outside.

    A training loop moved to the Accumulator often keeps its own `scheduler.step()`: with
    `scheduler=` passed too, the schedule runs twice as fast. The scheduler's `last_epoch` after
    each step taken here is remembered; one that moved since is warned of, once.
    """

    def __init__(self) -> None:
        self._last: tuple[int, object] | None = None  # (id(scheduler), last_epoch)
        self._warned = False
        self._checked: Any = None  # the scheduler last checked, held: an id could be reused
        self._current: Any = None  # this window's scheduler (None: none)
        self._early: tuple[BaseException | None] | None = None  # taken before the agreement

    def checked(self, scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
        """`scheduler`, refused as at construction if it was set (`acc.scheduler = ...`) since.

        Raises:
            ValueError, TypeError: As `Accumulator(scheduler=...)` would, before any change.
        """
        self._current, self._early = scheduler, None
        if scheduler is None or scheduler is self._checked:
            return scheduler
        try:
            check_scheduler(scheduler)
            check_scheduler_optimizer(scheduler, optimizer)
        except (TypeError, ValueError) as error:
            if hasattr(error, "add_note"):
                error.add_note(
                    "gradaccum: acc.scheduler was set (or acc.optimizer replaced) after the "
                    "Accumulator was built: set acc.scheduler to one built on acc.optimizer. "
                    "This window was discarded, nothing was stepped."
                )
            raise
        self._checked = scheduler
        return scheduler

    def take_early(self) -> BaseException | None:
        """Several ranks: step an untried scheduler before the ranks agree on the step.

        One not from torch (not tried: `triable`) may raise after the commit on one rank only,
        whose schedule then differs from the others', which went on silently. Stepped here, its
        error joins the step agreement; `take` raises it at the commit's close.

        Returns:
            Its error, if it raised.
        """
        if self._current is None or triable(self._current):
            return None
        try:
            self.take(self._current)
            self._early = (None,)
        except Exception as error:
            self._early = (error,)
        return self._early[0]

    def take(self, scheduler: Any) -> None:
        """`scheduler.step()` (if any), once per optimizer step taken."""
        if self._early is not None:  # taken before the agreement: its error, if any, now
            (error,), self._early = self._early, None
            if error is not None:
                raise error
            return
        if scheduler is None:
            return
        epoch = getattr(scheduler, "last_epoch", None)
        if self._last is not None and self._last[0] == id(scheduler) and self._last[1] != epoch:
            self._warn(scheduler, self._last[1], epoch)
        self._last = None
        scheduler.step()
        epoch = getattr(scheduler, "last_epoch", None)
        self._last = None if epoch is None else (id(scheduler), epoch)

    def forget(self) -> None:
        """A state was loaded: the scheduler may have moved on purpose."""
        self._last, self._early = None, None

    def _warn(self, scheduler: Any, was: object, now: object) -> None:
        if self._warned:
            return
        self._warned = True
        name = type(scheduler).__name__
        warn_user(
            UserWarning(
                f"{name} was stepped outside the Accumulator since its last step (last_epoch "
                f"{was} -> {now}); the Accumulator already steps it once per optimizer step, so "
                f"the schedule runs ahead. Remove your own {name}.step() (or pass scheduler=None "
                "and keep it); after loading a scheduler state, ignore this."
            )
        )
