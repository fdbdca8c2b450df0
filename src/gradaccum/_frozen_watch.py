"""Frozen parameters written inside a window: a target network's EMA updated per micro-batch.

MoCo, BYOL, DINO or a mean teacher keep a frozen copy of the network (`requires_grad=False`
parameters, often a submodule of the model) and move it toward the trained one by a momentum
update written in the training step, so, ported to `loss_fn`, it runs once per micro-batch: N
updates per optimizer step instead of one, and later micro-batches read another target than the
full batch does. Silent, unlike a buffer's update (`_buffer_watch`). `FrozenWatch` tells
`BufferWatch` once, naming the parameters, for its `ForwardStateWarning`, without copying them
(a frozen backbone can be most of the model): each window compares their version counters and
storages (an in-place update, a `p.data = ...` reassignment), and the first three also a sample
of their elements (a `p.data.mul_()`, which bumps no version counter; a target copied from the
trained network moves only from the second window on). They are not put back when a window
is forgotten: nothing else than a copy could. A PEFT `merge_adapter()` adds the adapters into their
frozen base weights: undone by `unmerge_adapter()` within the window (an evaluation merged for
speed) it is no change, left merged it is told as such, naming `unmerge_adapter()`.
"""

from __future__ import annotations

import torch

from gradaccum._averaged import averaged_parameter_ids
from gradaccum._wrappers import unwrapped

__all__ = ["FrozenWatch"]

_SHOWN = 6  # parameter names in the warning
_BY_VALUE = 3  # windows whose samples are compared
_SAMPLE = 1024  # elements per parameter


def _version(param: torch.Tensor) -> int | None:
    return None if param.is_inference() else param._version


def _samples(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Up to `_SAMPLE` evenly spaced elements of each tensor, copied (the first windows only).

    Not a norm: a float64 norm or sum of a large frozen weight allocates a float64 copy of it.
    A momentum update moves every element, so a sample sees it.
    """
    with torch.no_grad():
        flat = [p.detach().reshape(-1) for p in params]  # a view, unless non-contiguous
        return [f[:: max(1, f.numel() // _SAMPLE)][:_SAMPLE].clone() for f in flat]


class FrozenWatch:
    """Says once when a window changed parameters that do not require grad.

    Args:
        model: The model (possibly wrapped).
        active: False under several ranks (a rank's writes are its own business there).
    """

    def __init__(self, model: torch.nn.Module, *, active: bool = True) -> None:
        model = unwrapped(model)
        # nn.Embedding(max_norm=...) renormalizes its rows in its forward: `_buffer_watch`'s.
        renormed = {
            id(m.weight)
            for m in model.modules()
            if isinstance(m, torch.nn.Embedding) and m.max_norm is not None
        }
        averaged = averaged_parameter_ids(model)  # an EMA copy inside: `AverageWatch`'s
        self._params = [
            (name, p)
            for name, p in model.named_parameters()
            # Plain tensors only: a DTensor's storage pointer and elements are not a local read.
            if active
            and not p.requires_grad
            and id(p) not in renormed
            and id(p) not in averaged
            and type(p.detach()) is torch.Tensor
            and p.layout is torch.strided
        ]
        # PEFT layers' base weights: merge_adapter() adds the adapters into them in place.
        self._merged_into = {
            id(p): m
            for m in model.modules()
            if hasattr(m, "merged_adapters")
            for p in getattr(m, "base_layer", m).parameters()
        }
        self._marks: list[tuple[str, torch.Tensor, int | None, int]] = []
        self._samples: list[torch.Tensor] | None = None  # the first windows', by value
        self._by_value = _BY_VALUE  # windows left to compare samples in
        self.warned = False

    def open(self) -> None:
        """A window opens: mark the parameters frozen now."""
        if not self._params or self.warned:
            return
        self._marks = [
            (n, p, _version(p), p.data_ptr()) for n, p in self._params if not p.requires_grad
        ]
        if self._by_value:
            self._samples = _samples([p for _, p, _, _ in self._marks])

    def close(self, micro_batches: int) -> str | None:
        """At a commit (after the step, which steps no frozen parameter): what moved, if any."""
        marks, samples = self._marks, self._samples
        self.reset()
        if not marks:
            return None
        self._by_value = max(self._by_value - 1, 0)
        moved = [
            name
            for name, p, version, pointer in marks
            if not p.requires_grad and (_version(p) != version or p.data_ptr() != pointer)
        ]
        if samples is not None:  # every one: a reassigned tensor may reuse the old address
            by_mark, now = set(moved), _samples([p for _, p, _, _ in marks])
            pairs = zip(marks, samples, now, strict=True)
            moved = [
                m[0]
                for m, old, new in pairs
                if not m[1].requires_grad and (m[0] in by_mark or not old.equal(new))
            ]
        layers = {name: self._merged_into.get(id(p)) for name, p, _, _ in marks}
        # A PEFT merge_adapter() then unmerge_adapter() (an evaluation merged for speed) puts
        # the base weights back within rounding: not a change the step would notice.
        moved = [n for n in moved if getattr(layers[n], "merged_adapters", True)]
        if not moved or micro_batches < 2:
            return None
        self.warned = True
        names = ", ".join(moved[:_SHOWN]) + (", ..." if len(moved) > _SHOWN else "")
        if any(layers[n] is not None for n in moved):
            return (
                f"PEFT adapters were merged into their base weights ({names}) inside this "
                f"accumulation window of {micro_batches} micro-batches and are still merged "
                "(merge_adapter()): the micro-batches after the merge ran the adapters folded "
                "into frozen weights, gave them no gradient, and the step is not the "
                "full-batch one. Call unmerge_adapter() right after the evaluation that "
                "merged them, or merge between windows (after a result with stepped=True)."
            )
        return (
            f"{len(moved)} parameters that do not require grad ({names}) changed inside "
            f"this accumulation window of {micro_batches} micro-batches: a target network's "
            "momentum (EMA) update written in loss_fn (MoCo, BYOL, a mean teacher) runs once "
            "per micro-batch, not once per optimizer step, and later micro-batches read "
            "another target than the full batch does, so the steps are not the full-batch "
            "ones. Update it once per window, after acc.step() or when result.stepped."
        )

    def reset(self) -> None:
        """Drop this window's marks (it closed, was forgotten, or a state was loaded)."""
        self._marks, self._samples = [], None
