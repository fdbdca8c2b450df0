"""Buffers other than BatchNorm's that a model's forward updates (EMA codebooks, counters...).

A forward that updates a buffer (a VQ-VAE's EMA codebook, spectral norm's power-iteration
vectors, a step counter, a custom running statistic) advances it once per micro-batch instead of
once per batch, which no accumulation undoes. `BufferWatch` warns about it once, naming the
buffers, and makes a window that fails, is skipped or dropped put them back as BatchNorm's
running statistics are put back. The first window copies every such buffer and learns which
ones its forwards change (by value: a `.data` write or a reassigned attribute bumps no version
counter); later windows copy only those, and learn late changers from their version counters.
"""

from __future__ import annotations

import torch

from gradaccum._averaged import AverageWatch, named_trained_modules
from gradaccum._frozen_watch import FrozenWatch
from gradaccum._groupnorm import batchnorm_modules
from gradaccum._structure import StructureWatch
from gradaccum._warnings import warn_user
from gradaccum._wrappers import known_name, unwrapped

__all__ = [
    "BufferWatch",
    "ForwardStateWarning",
    "frequency_scaled",
    "is_observer",
    "observer_buffers",
]


class ForwardStateWarning(UserWarning):
    """A forward updates buffers, so micro-batches see other states than one full batch."""


class BufferWatch:
    """Copies the forward-updated buffers as a window opens; puts them back if it is forgotten.

    Buffers are known by their slot (owning module, name), indexed, so that a copy of the
    Accumulator (deepcopy, pickle) keeps what it learned.

    Args:
        model: The model (possibly wrapped).
        skip: Modules whose buffers another component restores (BatchNorm layers).
        active: False under several ranks, where DDP's buffer broadcast rewrites them all.
    """

    def __init__(
        self, model: torch.nn.Module, skip: list[torch.nn.Module], *, active: bool = True
    ) -> None:
        self._model, self._skip, self._active = unwrapped(model), {id(m) for m in skip}, active
        self._structure = StructureWatch(self._find_slots)  # modules set after building
        self._slots = self._structure.value
        self._learned: set[int] | None = None  # slots that change; None: no window closed yet
        self._saved: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # slot, tensor, copy
        self._versions: list[tuple[int, torch.Tensor, int | None]] = []  # slot, tensor, version
        self._warned = False
        self._tied = tied_max_norm(model)  # warned of at the first split window
        self._by_frequency = frequency_scaled(model)  # likewise
        self._frozen = FrozenWatch(model, active=active)  # a target network's EMA in loss_fn
        self._averages = AverageWatch(unwrapped(model))  # an EMA updated after each micro_step
        # Copies an older version took of an EMA copy's buffers: left as they are when loaded.
        self._unwatched = self._averages.buffer_names

    def open(self) -> None:
        """Copy what this window may change (all of it until one window has shown what does)."""
        if (fresh := self._structure.look()) is not None:  # a head set: learn its buffers
            self._slots, self._learned = fresh, None
            self._structure.settle(fresh)
        self._frozen.open()
        self._averages.open()
        if not self._slots:
            return
        current = [(i, m._buffers.get(k)) for i, (_, m, k) in enumerate(self._slots)]
        learned = self._learned
        self._saved = [
            (i, b, b.detach().clone())
            for i, b in current
            if b is not None and (learned is None or i in learned)
        ]
        self._versions = [(i, b, _version(b)) for i, b in current if b is not None]

    def _find_slots(self) -> list[tuple[str, torch.nn.Module, str]]:
        """Each buffer slot: its name, owning module and key; BatchNorm's are another's.

        Named inside a torch.compile / DDP wrapper: a state saved wrapped loads unwrapped. An EMA
        copy's buffers change between windows (update_parameters), never in a forward. The
        model's BatchNorm layers are skipped too, as `BatchNormControl` finds them again.
        """
        skipped = self._skip | {id(m) for _, m in batchnorm_modules(self._model)}
        return [
            (f"{name}.{key}" if name else key, module, key)
            for name, module in named_trained_modules(self._model)
            if id(module) not in skipped
            for key, buffer in module._buffers.items()
            if buffer is not None and self._active
        ]

    def changed(self) -> list[str]:
        """The buffers this window's forwards changed so far, as `module.buffer` names."""
        return [self._slots[i][0] for i in self._changed_slots()]

    def _changed_slots(self) -> list[int]:
        found = [i for i, b, old in self._saved if not self._same(i, b, old)]
        copied = {i for i, *_ in self._saved}
        found += [
            i
            for i, b, version in self._versions
            if i not in copied and (self._now(i) is not b or _version(b) != version)
        ]
        return found

    def close(self, micro_batches: int) -> None:
        """At a commit: learn which buffers change; warn once if a split window changed any."""
        if self._tied and micro_batches > 1:
            tied, self._tied = "; ".join(self._tied), []
            warn_user(
                ForwardStateWarning(
                    f"nn.Embedding(max_norm=...) renormalizes the rows it looks up in place, in "
                    f"each micro-batch's forward, and its weight is tied ({tied}): later "
                    "micro-batches read the rows earlier ones renormalized, the full batch "
                    "reads them all renormalized first, so the step is not the full-batch one. "
                    "Renormalize the batch's rows before the window: with torch.no_grad(): "
                    "torch.embedding_renorm_(emb.weight, ids.unique(), max_norm, 2.0)."
                )
            )
        if self._by_frequency and micro_batches > 1:
            scaled, self._by_frequency = ", ".join(self._by_frequency), []
            warn_user(UserWarning(FREQUENCY_TEXT.format(scaled)))
        frozen = self._frozen.close(micro_batches)
        if frozen is not None:
            warn_user(ForwardStateWarning(frozen))
        averaged = self._averages.close(micro_batches)
        if averaged is not None:
            warn_user(ForwardStateWarning(averaged))
        if not self._slots:
            return
        changed = self._changed_slots()
        self._learned = (self._learned or set()) | set(changed)
        if changed and micro_batches > 1 and not self._warned:
            self._warned = True
            names = ", ".join(self._slots[i][0] for i in changed[:6])
            warn_user(
                ForwardStateWarning(
                    f"the model's forward updated the buffers {names} in this window, once per "
                    f"micro-batch ({micro_batches} times) instead of once per batch: later "
                    "micro-batches saw another state than the full batch does (an EMA codebook, "
                    "spectral norm's vectors), so where the forward reads it the step is not "
                    "exactly the full-batch one. gradaccum.check_equivalence(...).explain() "
                    "measures the gap; update such state once per window (after acc.step) if it "
                    "must match."
                )
            )
        self.reset()

    def forget(self) -> None:
        """Put back every copied buffer the window changed (a failed, skipped or dropped one)."""
        with torch.no_grad():
            for i, buffer, old in self._saved:
                _, module, key = self._slots[i]
                if module._buffers.get(key) is not buffer:  # a reassigned attribute
                    module._buffers[key] = buffer  # the original back
                if buffer.shape != old.shape:  # resized in place: a per-channel quantization
                    buffer.resize_(old.shape)  # observer's range, empty until its first forward
                if not _equal(buffer, old):  # (an inference tensor is never written here)
                    buffer.copy_(old)
            copied = {i for i, *_ in self._saved}
            for i, buffer, version in self._versions:  # not copied, but the original is intact
                _, module, key = self._slots[i]
                if i not in copied and _version(buffer) == version:
                    module._buffers[key] = buffer
        self.reset()

    def reset(self) -> None:
        """Drop this window's copies (it closed, or another window's state was loaded)."""
        self._saved, self._versions = [], []
        self._frozen.reset()

    def state_dict(self) -> list[list[str | torch.Tensor]]:
        """The open window's starting copies, `[[buffer name, tensor], ...]` (plain data).

        What a window that fails, is skipped or is dropped after a resume puts back: without
        them, the loaded window's earlier forwards' updates would stay.
        """
        return [[self._slots[i][0], old.clone()] for i, _, old in self._saved]

    def check_state(self, start: object) -> list[tuple[int, torch.Tensor]] | None:
        """Check a saved `state_dict()` against this model; raise ValueError changing nothing.

        Returns:
            Each saved copy by slot, on its buffer's device, for `resume`; None for a state
            saved before the copies were.
        """
        if start is None:
            return None
        slots = {name: i for i, (name, _, _) in enumerate(self._slots)}
        resumed = []
        for entry in start if isinstance(start, list) else [start]:
            name, tensor = entry if isinstance(entry, list) and len(entry) == 2 else ("", None)
            if isinstance(name, str) and known_name(name, self._unwatched) in self._unwatched:
                continue
            i = slots.get(known_name(name, slots)) if isinstance(name, str) else None
            buffer = None if i is None else self._now(i)
            resizable = i is not None and is_observer(self._slots[i][1])  # see is_observer
            if (
                i is None
                or buffer is None
                or not isinstance(tensor, torch.Tensor)
                or tensor.dtype != buffer.dtype
                or (tensor.shape != buffer.shape and not resizable)
            ):
                raise ValueError(
                    f"the Accumulator state is damaged: engine.buffers entry {str(entry)[:80]} "
                    "is no buffer of this model (same name, shape and dtype); load the state "
                    "into the same model. Nothing was changed."
                )
            resumed.append((i, tensor.to(buffer.device).clone()))
        return resumed

    def resume(self, start: list[tuple[int, torch.Tensor]] | None, is_open: bool) -> None:
        """After a load: an open window's start is the one saved.

        A state saved before the start was (None) resumes with none, as it did then: copies taken
        now could be a fresh model's, which `load_checkpoint` loads after the Accumulator.
        """
        if not is_open or start is None:
            self.reset()
            return
        current = [(i, self._now(i)) for i in range(len(self._slots))]
        self._saved = [(i, buffer, old) for i, old in start if (buffer := self._now(i)) is not None]
        self._versions = [(i, b, _version(b)) for i, b in current if b is not None]

    def _now(self, slot: int) -> torch.Tensor | None:
        _, module, key = self._slots[slot]
        buffer: torch.Tensor | None = module._buffers.get(key)
        return buffer

    def _same(self, slot: int, buffer: torch.Tensor, old: torch.Tensor) -> bool:
        return self._now(slot) is buffer and _equal(buffer, old)


def is_observer(module: torch.nn.Module) -> bool:
    """A quantization observer or fake-quantize module (known by class name: no import).

    Their buffers change shape: a per-channel range is empty until the first forward gives it
    the channel count, and a load resizes them to the saved shape.
    """
    return any(c.__name__ in ("ObserverBase", "FakeQuantizeBase") for c in type(module).__mro__)


def observer_buffers(model: torch.nn.Module) -> set[str]:
    """The names of the buffers `is_observer` modules hold (state_dict keys)."""
    return {
        f"{name}.{key}".lstrip(".")
        for name, module in model.named_modules()
        if is_observer(module)
        for key in module._buffers
    }


def _version(buffer: torch.Tensor) -> int | None:
    """Its version counter; None for an inference tensor, which has none (nor in-place writes)."""
    return None if buffer.is_inference() else buffer._version


def _equal(now: torch.Tensor, old: torch.Tensor) -> bool:
    """Equal values, NaN where NaN was (a cache made by torch.empty may hold some)."""
    if torch.equal(now, old):
        return True
    if now.shape != old.shape or not (now.is_floating_point() or now.is_complex()):
        return False
    return bool(((now == old) | (now.isnan() & old.isnan())).all())


FREQUENCY_TEXT = (
    "{} scales each row's gradient by 1 / how often its id occurs (scale_grad_by_freq=True), "
    "counted in each micro-batch's backward, not in the batch: a row looked up in k "
    "micro-batches gets its scaled gradient k times (about k times its full-batch one), so the "
    "step is not the full-batch one. Build it with scale_grad_by_freq=False, or count each id "
    "over the whole batch before acc.step() and scale each lookup's gradient by 1 / its count, "
    "passed in the "
    "batch (e = emb(ids); e = e.detach() + (e - e.detach()) * inv_count[..., None]; "
    "docs/losses.md, 'Embeddings')."
)


def frequency_scaled(model: torch.nn.Module) -> list[str]:
    """Each trainable `nn.Embedding` / `nn.EmbeddingBag` with `scale_grad_by_freq=True`."""
    return [
        f"{name or '<model>'} ({type(module).__name__})"
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))
        and module.scale_grad_by_freq
        and module.weight.requires_grad
    ]


def tied_max_norm(model: torch.nn.Module) -> list[str]:
    """Each `nn.Embedding(max_norm=...)` whose weight another module reads, with its readers.

    The embedding's own lookups read only the rows they renormalized, which is exact (the same
    module registered twice too); another module reading the weight (a tied LM head) is not.
    """
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for key, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, f"{name}.{key}".lstrip(".")))
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and module.max_norm is not None:
            others = [n for m, n in holders.get(id(module.weight), []) if m is not module]
            if others:
                found.append(f"{name or '<model>'}.weight read by {', '.join(others)}")
    return found
