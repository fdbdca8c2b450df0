"""What the window boundary reads from the components: a rank's summary, the gradients to step.

Functions over the components' public interfaces (`Window`, `PrecisionRuntime`, `GradSync`), so
the engine reads as its algorithm: exchange, reduce, divide, check, clip, step.

Example:
    >>> import torch
    >>> from gradaccum.options import Precision
    >>> from gradaccum.precision import PrecisionRuntime
    >>> from gradaccum.sync import LocalSync
    >>> from gradaccum.window import Window
    >>> param = torch.nn.Parameter(torch.ones(2))
    >>> window, runtime = Window(), PrecisionRuntime(Precision.FP32, [param], accum_dtype=None)
    >>> window.open([param], 1, loss_scale=1.0)
    >>> runtime.open_window(1)
    >>> rank_summary(window, runtime, LocalSync()).micro_batches
    0
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from gradaccum._agreement import FAILED, OUT_OF_MEMORY, RankSummary, WindowAgreement
from gradaccum._dtensor import is_dtensor
from gradaccum._oom import is_out_of_memory
from gradaccum._sync_base import FAILED_COUNT
from gradaccum._tensor_parallel import sharded_view
from gradaccum._warnings import warn_user
from gradaccum.precision import PrecisionRuntime
from gradaccum.sync import GradSync
from gradaccum.window import Window

__all__ = [
    "announce_failure",
    "held_gradients",
    "nonfinite_names",
    "rank_summary",
    "reduced_gradients",
]

_IS_SPARSE = operator.attrgetter("is_sparse")


def rank_summary(
    window: Window, runtime: PrecisionRuntime, sync: GradSync, failed: int = 0
) -> RankSummary:
    """This rank's side of the window exchange.

    Which parameters it holds a gradient for is read only when there are other ranks.
    """
    params, ledger = window.params[: window.held], window.terms
    has_grad: tuple[bool, ...] = ()
    if sync.world > 1:  # which params to reduce: those some rank holds a gradient for
        has_grad = tuple(
            runtime.gradient(i, p) is not None or (ledger is not None and ledger.has_gradient(i))
            for i, p in enumerate(params)
        )
    return RankSummary(
        window.count,
        window.loss_total(),
        window.micro_batches,
        window.denominator or 1.0,
        failed=failed,
        has_grad=has_grad,
        terms=() if ledger is None else ledger.summary(),
        term_names=() if ledger is None else ledger.names,
        term_weights=() if ledger is None else ledger.weights,
    )


def announce_failure(
    window: Window,
    runtime: PrecisionRuntime,
    sync: GradSync,
    error: BaseException,
    rerun: bool,
    tokens: bool,
) -> None:
    """Tell the other ranks (DDP) that this rank's window raised `error`, at their next collective.

    `rerun`: an out-of-memory error is announced as such (every rank reruns the window smaller).
    `tokens`: they sum their counts next (a `Tokens` window); else they exchange. The notice may
    fail itself: a peer is gone, or waits inside another collective (a static graph's first
    window reduces inside its backwards). The window's own error is what this rank must still
    raise, and its window must still be forgotten, so that failure is only warned about.
    """
    try:
        if tokens:
            sync.sum_over_ranks(FAILED_COUNT)
        else:
            kind = OUT_OF_MEMORY if rerun and is_out_of_memory(error) else FAILED
            sync.exchange(rank_summary(window, runtime, sync, failed=kind))
    except Exception as notice:  # a collective's failure; the caller re-raises the real error
        warn_user(
            RuntimeWarning(
                "gradaccum could not tell the other ranks that this rank's accumulation window "
                f"failed ({type(notice).__name__}: {notice}); they fail at their next "
                "collective or at the process group's timeout."
            )
        )


def reduced_gradients(
    window: Window,
    runtime: PrecisionRuntime,
    sync: GradSync,
    agreement: WindowAgreement,
    *,
    reduce: bool,
) -> list[torch.Tensor]:
    """The optimizer's gradients: every parameter some rank used.

    Each `LossSum.terms` term is divided by its own count; the sum over ranks is taken here
    when `reduce` (where the backend did not take it).

    Raises:
        ValueError: If a gradient is sparse (before any reduction).
    """
    held: list[torch.Tensor] = []
    unsharded: list[tuple[int, torch.nn.Parameter, torch.Tensor | None]] = []  # FSDP2: reduce
    local: list[torch.Tensor] = []  # DDP's ignored parameters: not reduced
    shards: list[tuple[int, Any]] = []  # DDP + tensor parallel: where, and the DTensor layout
    ledger = window.terms
    counts = ledger.global_counts(agreement) if ledger else []  # checks counts given ahead
    params = window.params[: window.held]
    if ledger is None and sync.world == 1 and not runtime.uses_buffers:  # the `.grad` as they are
        held = [param.grad for param in params if param.grad is not None]
        params = []
    for index, param in enumerate(params):
        grad = runtime.gradient(index, param)
        if ledger is not None:
            combined = ledger.combine(index, grad, counts)
            if grad is None and combined is not None:
                runtime.hold(index, param, combined)
            grad = combined
        if not reduce and sync.world > 1 and not is_dtensor(param):  # not sharded by FSDP2
            unsharded.append((index, param, grad))
            continue
        if sync.keeps_local(param):  # DDP ignores it: this rank's own, never reduced
            if grad is not None:
                local.append(grad)
            continue
        if grad is None and sync.world > 1 and agreement.has_grad[index]:
            grad = runtime.zeros_for(index, param)  # another rank used it: reduce alike
        if grad is not None:
            if (layout := getattr(param, "_st_info", None)) is not None:  # DDP took it off
                shards.append((len(held), layout))
            held.append(grad)
    if any(map(_IS_SPARSE, held + local + [grad for *_, grad in unsharded if grad is not None])):
        raise ValueError(
            "a parameter received a sparse gradient; gradaccum accumulates dense gradients "
            "only. Use nn.Embedding(..., sparse=False). The window was discarded."
        )
    if not held and sync.world == 1 and window.params[: window.held]:  # one process: no rank waits
        raise ValueError(_NO_GRADIENT.format(items=window.count))
    if unsharded:  # the optimizer's parameters FSDP2 does not reduce: averaged as it averages
        held += sync.average_unsharded(unsharded, runtime.zeros_for)
    if reduce and sync.world > 1:
        mine = window.denominator or 1.0
        if mine != agreement.denominator and held + local:  # uneven: a power-of-two ratio
            torch._foreach_mul_(held + local, mine / agreement.denominator)
        sync.reduce(held)
    if local and sync.averaged_over > 1:  # a static graph's first window: DDP averaged the
        torch._foreach_div_(local, float(sync.averaged_over))  # rest, which the divisor undoes
    for position, layout in shards:  # the norm over the tensor-parallel shards: global
        held[position] = sharded_view(held[position], layout)
    return held + local


_NO_GRADIENT = (
    "the window counted {items} items but no parameter the optimizer holds received a "
    "gradient: the loss's graph does not reach them, so the step would train nothing. A loss "
    "rebuilt from a number (torch.tensor(loss.item(), requires_grad=True)) or from a detached "
    "output made to require grad again has no path to the weights: return the loss computed "
    "from the model's output, with its graph (or build the optimizer from the parameters the "
    "loss uses). The window was discarded."
)


def held_gradients(window: Window, runtime: PrecisionRuntime) -> list[torch.Tensor]:
    """The gradients the window has accumulated so far, on this rank (none reduced yet)."""
    params = window.params[: window.held]
    grads = (runtime.gradient(index, param) for index, param in enumerate(params))
    return [grad for grad in grads if grad is not None]


def nonfinite_names(
    window: Window, runtime: PrecisionRuntime, names: dict[int, str], world: int = 1
) -> tuple[str, ...]:
    """The optimizer's parameters whose gradient holds an inf or NaN, by name.

    None here under several ranks, with this rank's loss finite: another rank's was not (the
    ranks skip together, before the gradients are reduced), which the placeholder says.
    """
    found = []
    for index, param in enumerate(window.params[: window.held]):
        grad = runtime.gradient(index, param)
        if grad is not None and not bool(torch.isfinite(grad).all()):
            found.append(names.get(id(param), f"<optimizer param {index}>"))
    if not found and world > 1 and math.isfinite(window.loss_total()):
        return ("<none on this rank: another rank's loss or gradients are non-finite>",)
    if not found and math.isfinite(window.loss_total()):  # finite values, an infinite norm
        return ("<none: every gradient is finite, their total 2-norm overflows float32>",)
    return tuple(found) or ("<none: the loss itself is non-finite>",)
