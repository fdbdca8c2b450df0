"""Several ranks: `optimizer.step()` taken on every rank, or every rank knows it was not.

The window's exchange and gradient reduction make every rank reach `optimizer.step()` with the
same gradients, but the step itself can still raise on one rank alone: out of memory while a
lazily built optimizer state (Adam's moments) is allocated, a custom optimizer's rank-dependent
check. The other ranks have stepped by then, and nothing can undo their step without a copy of
every parameter and its state. Before this agreement they went on training, silently apart from
the rank that raised (its parameters one step behind, or half-updated), and a loop that catches
the error to skip the batch trained on diverged replicas.

So after its step every rank joins one tiny all-reduce: how many ranks' steps raised. When some
but not all did, the replicas differ: every rank raises (the ones that stepped a
`RankMismatchError`, the others their own error with a note) and refuses further windows until a
checkpoint is loaded, as after a `PartialStepError`. When every rank raised alike (torch's own
input checks), nothing differs and each rank's own error stands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from gradaccum._commit import Breakable, SchedulerSteps, step_optimizer
from gradaccum._step_refusal import OpenWindow
from gradaccum._sync_base import GradSync

__all__ = ["join_as_failed", "step_on_every_rank"]


class Committer(Breakable, Protocol):
    """The `Engine`: breakable, and taking its scheduler's steps."""

    schedule: SchedulerSteps


def step_on_every_rank(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    names: dict[int, str],
    owner: Committer,
    window: OpenWindow,
    sync: GradSync,
) -> str | None:
    """`step_optimizer`, then (several ranks) agree on whether it raised anywhere.

    Returns:
        None when every rank stepped; else the message this rank, which stepped, must raise as a
        `RankMismatchError` once its commit is complete (`owner.broken` is already set).

    Raises:
        BaseException: This rank's own error from `optimizer.step()`; when other ranks stepped,
            with a note saying so, and `owner.broken` set.
    """
    try:
        step_optimizer(optimizer, params, names, owner, window)
    except Exception as error:
        join_as_failed(sync, error, owner, where="")
        raise
    if sync.world == 1:
        return None
    # A scheduler the window did not try steps now, so that one raising on some ranks only is
    # known to all (its error is raised at the commit's close); it counts world + 1 per rank.
    late = owner.schedule.take_early()
    failed = _failed_ranks(sync, 0 if late is None else sync.world + 1)
    if failed is None:  # the agreement itself failed: whether the others stepped is unknown
        failed = -1
    schedulers, failed = divmod(failed, sync.world + 1) if failed > 0 else (0, failed)
    if schedulers not in (0, sync.world):  # the ranks' schedules now differ
        owner.broken = _scheduler_apart(schedulers, sync.world)
        if late is None:
            return owner.broken
        if hasattr(late, "add_note"):  # this rank raises its own error, at the commit's close
            late.add_note(f"gradaccum: {owner.broken}")
        return None
    if failed == 0:
        return None
    owner.broken = _diverged(failed, sync.world, "see their own tracebacks")
    return owner.broken


def join_as_failed(
    sync: GradSync, error: BaseException, owner: Breakable, where: str = " before it"
) -> None:
    """Join the ranks' step agreement as a rank whose step raised, or that failed before it.

    Between the exchange and `optimizer.step()` (the division, the norm, clipping, out of
    memory on one rank) the other ranks go on to step and then wait in the agreement's
    all-reduce: this rank answers it, so they raise instead of waiting, and it notes on `error`
    that they stepped. A Ctrl-C (not an `Exception`) joins no collective.
    """
    if sync.world == 1 or not isinstance(error, Exception):
        return
    failed = _failed_ranks(sync, 1)
    if failed is not None:  # schedulers that raised after a step count world + 1 each
        failed %= sync.world + 1
    if failed is not None and failed < sync.world:
        message = _diverged(failed, sync.world, f"here: {type(error).__name__}{where}")
        owner.broken = owner.broken or message
        if hasattr(error, "add_note"):
            error.add_note(f"gradaccum: {message}")


def _failed_ranks(sync: GradSync, mine: int) -> int | None:
    """How many ranks' steps raised: one all-reduce; None if that collective failed."""
    try:
        return sync.sum_over_ranks(mine)
    except Exception:  # a peer is gone: it cannot be asked; the caller says what is known
        return None


def _scheduler_apart(failed: int, world: int) -> str:
    return (
        f"the scheduler's step raised on {failed} of {world} ranks (see their own tracebacks) "
        "after every rank's optimizer.step(): the ranks' schedules (learning rates) now differ. "
        "This Accumulator refuses further windows on every rank: fix the scheduler, then reload "
        "your last checkpoint on every rank (gradaccum.load_checkpoint(path, model=..., "
        "optimizer=..., accumulator=acc, scheduler=...))."
    )


def _diverged(failed: int, world: int, cause: str) -> str:
    who = "some ranks" if failed < 0 else f"{failed} of {world} ranks"
    return (
        f"optimizer.step() raised on {who} ({cause}) while the other ranks stepped: the "
        "replicas' parameters and optimizer states now differ, and no step can be undone. This "
        "Accumulator refuses further windows on every rank: fix the cause, then reload your "
        "last checkpoint on every rank (gradaccum.load_checkpoint(path, model=..., "
        "optimizer=..., accumulator=acc))."
    )
