"""Trainable weights written between two `micro_step()` calls of one window: refused.

A streamed window's micro-batches must all run at the weights of its start. A loop that loads
weights in the middle of one (`model.load_state_dict(sd)` on a rollback, a `param.copy_()`,
`torch.nn.utils.vector_to_parameters`, a `p.data = ...` assignment) mixes the gradients of its
earlier micro-batches, taken at the old weights, with later ones: the step is no full-batch step
of either model (0.059 off, silently, before); so does an optimizer built later and never
given to the Accumulator, stepped by the loop after each `micro_step()` on partial sums. After
each micro-batch the window remembers the stepped parameters' version counters and storages
(`weight_marks`, C-level passes); the next
`micro_step()` (or `flush()`) compares them before it runs anything, and a change refuses the
window (`written_error`), discarding it as any failure does. A cast (`model.float()` under
`accum_dtype`) changes the dtype too and is left alone. A write through `p.data.copy_()` bumps
neither counter nor storage: before the window's last `micro_step()` (and `flush('step')`) the
norms are taken again and compared (`final`), so it is refused there, once per window; a
`Tokens` window, whose last micro-batch is not known ahead, does not compare. A loaded window
state starts with no marks, since `load_checkpoint` loads the weights after the Accumulator's
state.

Weights written and put back between two calls (validation on EMA weights swapped in with
`model.load_state_dict(ema_sd)` and out with `model.load_state_dict(backup)`, a `p.copy_(e)` /
`p.copy_(saved)` pair, a clamp that changes nothing) leave the window's model as it was: they
were refused, the window discarded, a false alarm. The marks hold each weight's norm, taken
once per window (one `torch._foreach_norm` pass, at its first mark, or at a mark after a forward
wrote weights); a moved counter whose parameter's norm is bitwise the same is a put-back, not a
write. A write that keeps every norm bitwise (a whole tensor's sign flipped or permuted) passes
as one.

A window carried over an epoch (`flush()` under `partial_window="carry"`) keeps a host copy of its
weights' values (`kept_weights`, in their dtype: the model's size) until its next micro-batch: an
evaluation in between may write them and put them back (a schedule-free optimizer's `eval()` then
`train()`, an EMA swapped in and out), which only rounds them. Weights back within a few units of
rounding of the copy (`_WITHIN` machine epsilons of each value plus the tensor's root mean square)
are the window's weights: accepted, the step the full-batch one up to rounding. Weights left
elsewhere (`eval()` without `train()`, a rollback) are refused as any write.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> params = list(model.parameters())
    >>> marks = weight_marks(params)
    >>> model.load_state_dict(torch.nn.Linear(2, 1).state_dict())
    <All keys matched successfully>
    >>> "load_state_dict" in str(written_error(params, marks, {}, micro_batches=1))
    True
"""

from __future__ import annotations

import operator

import torch

__all__ = ["WeightMarks", "kept_weights", "weight_marks", "written_error"]

_VERSION, _DTYPE = operator.attrgetter("_version"), operator.attrgetter("dtype")
_SHOWN = 3
_WITHIN = 8  # machine epsilons: a schedule-free eval()/train() round trip moves <= 3.1 (float64)

# Version counters, storage addresses, dtypes, the norms (None: unreadable) and, for a carried
# window only, host copies of the values.
WeightMarks = tuple[
    list[int], list[int], list[torch.dtype], list[torch.Tensor] | None, list[torch.Tensor]
]


def _norms(params: list[torch.nn.Parameter]) -> list[torch.Tensor] | None:
    """Each parameter's norm, one fused pass without a graph; None where it cannot be taken."""
    try:
        with torch.no_grad():
            return list(torch._foreach_norm(tuple(params)))
    except (RuntimeError, NotImplementedError):  # meta tensors, dtypes without a norm kernel
        return None


def weight_marks(
    params: list[torch.nn.Parameter], previous: WeightMarks | None = None
) -> WeightMarks | None:
    """Each parameter's version counter, storage address, dtype and norm; None if unreadable.

    `previous`: the window's last marks, whose norms are kept while nothing was written since
    (the norms are taken once per window). FSDP2's sharded parameters (DTensors) and inference
    tensors are not watched.
    """
    if not params or set(map(type, params)) != {torch.nn.Parameter}:  # DTensors (FSDP2)
        return None
    try:
        versions = list(map(_VERSION, params))
        pointers = list(map(torch.Tensor.data_ptr, params))
    except RuntimeError:  # an inference tensor has no version counter
        return None
    dtypes = [*map(_DTYPE, params)]
    if previous is not None and previous[:3] == (versions, pointers, dtypes):
        return versions, pointers, dtypes, previous[3], []  # nothing written since: same norms
    return versions, pointers, dtypes, _norms(params), []


def _same_norm(index: int, marks: WeightMarks, now: WeightMarks) -> bool:
    """True if parameter `index` has bitwise the norm it had at `marks`: written, then put back."""
    before, after = marks[3], now[3]
    if before is None or after is None:
        return False
    return bool(torch.equal(before[index], after[index]))


def now_marks_equal(params: list[torch.nn.Parameter], marks: WeightMarks) -> bool:
    """True if no counter, storage or dtype moved since `marks` (no norm is taken)."""
    try:
        versions = list(map(_VERSION, params))
    except RuntimeError:
        return True
    return (
        versions == marks[0]
        and list(map(torch.Tensor.data_ptr, params)) == marks[1]
        and [*map(_DTYPE, params)] == marks[2]
    )


def kept_weights(marks: WeightMarks | None, params: list[torch.nn.Parameter]) -> WeightMarks | None:
    """`marks` of a window being carried, with a host copy of each weight's values."""
    if marks is None:
        return None
    return (*marks[:4], [p.detach().to("cpu", copy=True) for p in params])  # the model's size


def _put_back(param: torch.nn.Parameter, kept: torch.Tensor) -> bool:
    """Whether `param` holds `kept`'s values up to a few units of rounding of its dtype."""
    if param.shape != kept.shape or not param.dtype.is_floating_point:
        return False
    now, kept = param.detach().to("cpu", torch.float64), kept.double()
    scale = kept.abs() + kept.square().mean().sqrt()  # the values near 0 round with the rest
    return bool(((now - kept).abs() <= _WITHIN * torch.finfo(param.dtype).eps * scale).all())


def written_error(
    params: list[torch.nn.Parameter],
    marks: WeightMarks | None,
    names: dict[int, str],
    *,
    micro_batches: int,
    final: bool = False,
) -> RuntimeError | None:
    """The error for parameters written since `marks` were taken (same dtype), if any.

    `final`: before the window's last micro-batch, where the norms are compared even if no
    counter moved (a `p.data.copy_()`); once per window, a second norm pass.
    """
    if marks is None:
        return None
    if now_marks_equal(params, marks):  # the usual case: list comparisons in C
        if not final or marks[3] is None:
            return None
        now: WeightMarks | None = (*marks[:3], _norms(params), [])
    else:
        now = weight_marks(params, marks)  # the norms, taken again for what moved
    if now is None:
        return None
    kept = marks[4]  # a carried window: weights put back after an evaluation are its own
    written = [
        param
        for index, (param, version, pointer, dtype, *seen) in enumerate(
            zip(params, *marks[:3], *now[:3], strict=True)
        )
        if dtype == seen[2]  # else a cast (model.float() mid-window, with accum_dtype buffers)
        and (final or version != seen[0] or pointer != seen[1])
        and not _same_norm(index, marks, now)  # validation on swapped-in EMA weights, undone
        and not (kept and _put_back(param, kept[index]))  # or within rounding (carried)
    ]
    if not written:
        return None
    shown = [names.get(id(p), f"<parameter of shape {tuple(p.shape)}>") for p in written]
    listed = ", ".join(shown[:_SHOWN]) + (", ..." if len(shown) > _SHOWN else "")
    return RuntimeError(
        f"{len(written)} trained parameters ({listed}) were written between two micro_step() "
        f"calls of one accumulation window ({micro_batches} micro-batches so far): the "
        "window's earlier micro-batches ran at the old weights, so its step would mix the "
        "gradients of two models. Writers: a model.load_state_dict(), a param.copy_(), "
        "torch.nn.utils.vector_to_parameters, a p.data = ... assignment or a p.data.copy_() "
        "(seen at the window's last micro-batch; change weights "
        "between windows, after a result with stepped=True or acc.flush('drop'); to roll back "
        "mid-window, load_checkpoint(path, ..., accumulator=acc) replaces the open window too); "
        "the step() of another optimizer over them (one built and never given to the "
        "Accumulator: set acc.optimizer = it between windows and remove its step(); another "
        "Accumulator over shared parameters: run one window to its step before the other's "
        "first micro_step()); a schedule-free optimizer's eval() inside the window (evaluate "
        "after a result with stepped=True or after acc.flush(); a window carried by "
        "partial_window='carry' takes the weights its train() put back); an in-place "
        "constraint applied after every micro_step() (WGAN's weight clipping p.clamp_(-c, c), "
        "a max-norm renorm_()): apply it only after a result with stepped=True, as a plain "
        "loop does after optimizer.step(). The window was discarded; the weights are as written."
    )
