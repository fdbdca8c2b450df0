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
`accum_dtype`) changes the dtype too and is left alone; a write through `p.data.copy_()` bumps
neither counter nor storage and is not seen. A loaded window state starts with no marks, since
`load_checkpoint` loads the weights after the Accumulator's state.

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

__all__ = ["WeightMarks", "weight_marks", "written_error"]

_VERSION, _DTYPE = operator.attrgetter("_version"), operator.attrgetter("dtype")
_SHOWN = 3

WeightMarks = tuple[list[int], list[int], list[torch.dtype]]


def weight_marks(params: list[torch.nn.Parameter]) -> WeightMarks | None:
    """Each parameter's version counter, storage address and dtype; None where none can be read.

    FSDP2's sharded parameters (DTensors) and inference tensors are not watched.
    """
    if set(map(type, params)) != {torch.nn.Parameter}:  # DTensors (FSDP2), other subclasses
        return None
    try:
        return (
            list(map(_VERSION, params)),
            list(map(torch.Tensor.data_ptr, params)),
            [*map(_DTYPE, params)],
        )
    except RuntimeError:  # an inference tensor has no version counter
        return None


def written_error(
    params: list[torch.nn.Parameter],
    marks: WeightMarks | None,
    names: dict[int, str],
    *,
    micro_batches: int,
) -> RuntimeError | None:
    """The error for parameters written since `marks` were taken (same dtype), if any."""
    if marks is None:
        return None
    now = weight_marks(params)
    if now is None or now == marks:  # the usual case: list comparisons in C
        return None
    written = [
        param
        for param, version, pointer, dtype, *seen in zip(params, *marks, *now, strict=True)
        if dtype == seen[2] and (version != seen[0] or pointer != seen[1])
    ]
    if not written:  # a cast only (model.float() mid-window, with accum_dtype buffers)
        return None
    shown = [names.get(id(p), f"<parameter of shape {tuple(p.shape)}>") for p in written]
    listed = ", ".join(shown[:_SHOWN]) + (", ..." if len(shown) > _SHOWN else "")
    return RuntimeError(
        f"{len(written)} trained parameters ({listed}) were written between two micro_step() "
        f"calls of one accumulation window ({micro_batches} micro-batches so far): the "
        "window's earlier micro-batches ran at the old weights, so its step would mix the "
        "gradients of two models. Writers: a model.load_state_dict(), a param.copy_(), "
        "torch.nn.utils.vector_to_parameters or a p.data = ... assignment (change weights "
        "between windows, after a result with stepped=True or acc.flush('drop'); to roll back "
        "mid-window, load_checkpoint(path, ..., accumulator=acc) replaces the open window too); "
        "the step() of another optimizer over them (one built and never given to the "
        "Accumulator: set acc.optimizer = it between windows and remove its step(); another "
        "Accumulator over shared parameters: run one window to its step before the other's "
        "first micro_step()); an in-place constraint applied after every micro_step() "
        "(WGAN's weight clipping p.clamp_(-c, c), a max-norm renorm_()), even one that changes "
        "no value: apply it only after a result with stepped=True, as a plain loop does after "
        "optimizer.step(). The window was discarded; the weights are as written."
    )
