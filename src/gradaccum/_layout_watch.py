"""A batch split along time: a sequence-first RNN or attention fed batch-first micro-batches.

`nn.LSTM`, `nn.GRU`, `nn.RNN` and `nn.MultiheadAttention` (so `nn.Transformer*` too) are
sequence-first by default (`batch_first=False`): they read `(S, B, ...)`. A batch of such tensors
split along dim 0 (`Accumulator.step`, `accumulate_grad` and `check_equivalence` split there unless
given `batch_dim=1`) is cut in time, not into items: each micro-batch runs a few time steps of
every sequence from a fresh hidden state, a silently different objective from the full batch.

`SequenceFirstCheck` watches the first few split micro-batches: a sequence-first module whose
input's dim 0 is the micro-batch's item count (and dim 1 is not, nor 1: one item's sequence of a
per-item list, `(T, 1, F)`) was handed the split dimension as its time axis, and it warns once.
A model that transposes its batch-first input before such a module gives it `(S, items, ...)`,
which is not warned about. A compiled model is not watched.

Example:
    >>> import torch, warnings
    >>> rnn = torch.nn.GRU(3, 4)  # sequence-first
    >>> check = SequenceFirstCheck(rnn, batch_dim=0)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     with check.watch(items=2, window_items=6):
    ...         _ = rnn(torch.randn(2, 5, 3))  # 2 of the 6 time steps, 5 sequences
    >>> caught[0].category.__name__
    'SequenceFirstWarning'
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from gradaccum._carried_state import CarriedStateCheck
from gradaccum._warnings import warn_user

__all__ = ["SequenceFirstCheck", "SequenceFirstWarning"]

_CHECKED = 3  # split micro-batches looked at: the model's layout does not change between them


class SequenceFirstWarning(UserWarning):
    """A sequence-first module received micro-batches that were split along its time axis."""


class SequenceFirstCheck:
    """Warns once when a split along dim 0 reaches a sequence-first module as its time axis."""

    def __init__(self, model: torch.nn.Module, batch_dim: int, carried: bool = True) -> None:
        """Find the model's sequence-first modules (none to watch with `batch_dim=1`).

        `carried=False` (`accumulate_grad`, under `check_equivalence`, which reports the gap and
        names a module keeping state in plain attributes) refuses no RNN state carried on.
        """
        self.modules = [
            (name or "<model>", module)
            for name, module in model.named_modules()
            if isinstance(module, (torch.nn.RNNBase, torch.nn.MultiheadAttention))
            and not module.batch_first
        ]
        # Hooks added and removed under torch.compile would cost two compilations (their guards
        # change): a compiled model, or one with a compiled module, is not watched.
        compiled = any(
            hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
            for m in model.modules()
        )
        self._left = _CHECKED if self.modules and batch_dim == 0 and not compiled else 0
        self.carried = CarriedStateCheck(model, compiled or not carried)  # a state to other rows

    def open_window(self) -> None:
        """A new window: states its earlier micro-batches' RNNs returned are no longer watched."""
        self.carried.open_window()

    def watch(
        self, items: int, window_items: int | None
    ) -> contextlib.AbstractContextManager[None]:
        """Watch one micro-batch's forward, if it is one of several the batch was split into.

        Args:
            items: The micro-batch's items along dim 0.
            window_items: The whole batch's items, or None when the caller split it (streaming).
        """
        if window_items is None or items >= window_items:
            return contextlib.nullcontext()
        carried = self.carried.watch(items) if self.carried.rnns else contextlib.nullcontext()
        if self._left <= 0:
            return carried
        self._left -= 1
        return _Watch(self, items, window_items, carried)

    def found_flattened(
        self, items: int, name: str, module: torch.nn.Module, sequences: int, steps: int
    ) -> None:
        """Warn once: an RNN ran this micro-batch's rows as time steps of fewer sequences."""
        self._left = 0
        warn_user(SequenceFirstWarning(_flattened_message(items, name, module, sequences)))

    def found(self, items: int, window_items: int, name: str, module: torch.nn.Module) -> None:
        """Warn once: `module` at `name` took this micro-batch's split dim 0 as its time axis."""
        self._left = 0  # once per Accumulator (or call)
        kind = type(module).__name__
        warn_user(
            SequenceFirstWarning(
                f"the batch was split along dim 0 into micro-batches of {items} of its "
                f"{window_items} items, but the {kind} at {name!r} is sequence-first "
                f"(batch_first=False) and its input's dim 0 holds those {items}: the split cut "
                "every sequence in time (or the module runs across the batch's items), which is "
                "not the full-batch step. For (S, B, ...) batches pass "
                "Accumulator(..., batch_dim=1) (accumulate_grad and check_equivalence take "
                "batch_dim=1 too); for (B, S, ...) batches build the "
                f"{kind} with batch_first=True, or transpose before it."
            )
        )


def _flattened_message(items: int, name: str, module: torch.nn.Module, sequences: int) -> str:
    kind = type(module).__name__
    return (
        f"the micro-batch's {items} rows reached the {kind} at {name!r} as {items // sequences} "
        f"time steps of {sequences} sequences (its batch axis holds {sequences}, not the "
        f"{items} rows): rows flattened from a (T, N) rollout time-major (a recurrent PPO's "
        "minibatch, as CleanRL's) are cut in time by the split, each micro-batch running a "
        "few steps from the sequences' initial state, which is not the full-batch step. Keep "
        "the minibatch as (T, N, ...) tensors, its initial states (num_layers, N, hidden) and "
        "dones (T, N), pass Accumulator(..., batch_dim=1) and flatten in loss_fn: each "
        "micro-batch then holds whole sequences (docs/losses.md, 'Recurrent models'). If each "
        "micro-batch already holds whole sequences (rows flattened sequence by sequence), "
        "ignore this."
    )


class _Watch:
    """Pre-hooks on the sequence-first modules for one micro-batch's forward."""

    def __init__(
        self,
        check: SequenceFirstCheck,
        items: int,
        window_items: int,
        carried: contextlib.AbstractContextManager[None],
    ) -> None:
        self.check, self.items, self.window_items = check, items, window_items
        self.carried = carried
        self.seen: list[tuple[str, torch.nn.Module]] = []
        # Per RNN: (name, module, its inputs' batch axis, the time steps x sequences it ran).
        self.ran: dict[int, tuple[str, torch.nn.Module, int, int]] = {}
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> None:
        self.carried.__enter__()
        for name, module in self.check.modules:
            self.handles.append(module.register_forward_pre_hook(self._record(name)))

    def __exit__(self, *exc_info: object) -> None:
        # A plain __exit__, not a generator: warn_user then points at the user's line.
        for handle in self.handles:
            handle.remove()
        self.carried.__exit__(*exc_info)  # type: ignore[arg-type]
        if self.seen and exc_info[0] is None:
            self.check.found(self.items, self.window_items, *self.seen[0])
        elif exc_info[0] is None:
            flattened = [ran for ran in self.ran.values() if ran[2] and ran[3] == self.items]
            if flattened:
                self.check.found_flattened(self.items, *flattened[0])

    def _record(self, name: str) -> Callable[[torch.nn.Module, tuple[Any, ...]], None]:
        def record(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            first = args[0] if args else None
            # A PackedSequence or an unbatched 2-D input has no batch axis to confuse; nor has
            # one item's sequence, `(T, 1, F)` from a per-item list, whose T may equal `items`.
            if (
                not self.seen
                and isinstance(first, torch.Tensor)
                and first.dim() == 3
                and first.shape[0] == self.items != first.shape[1]
                and first.shape[1] > 1
            ):
                self.seen.append((name, module))
            if isinstance(module, torch.nn.RNNBase) and isinstance(first, torch.Tensor):
                self._ran(name, module, first)

        return record

    def _ran(self, name: str, module: torch.nn.Module, first: torch.Tensor) -> None:
        """Add up the (S, b) steps an RNN ran, b its batch axis, if b is not the rows."""
        sequences = int(first.shape[1]) if first.dim() == 3 else 0
        _, _, before, steps = self.ran.get(id(module), (name, module, sequences, 0))
        valid = 1 < sequences < self.items and before == sequences  # one batch axis, fewer
        self.ran[id(module)] = (
            name,
            module,
            sequences if valid else 0,
            steps + first.numel() // max(first.shape[-1], 1),
        )
