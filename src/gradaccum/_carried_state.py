"""An RNN state carried from one micro-batch of a split batch to the next: other rows' state.

Truncated BPTT keeps the RNN's last state between chunks (`self.h = h.detach()`) and runs the
next chunk from it. Streamed with `micro_step()`, one chunk of every stream per call, that is
exact. Given to `step()`, a chunk of B streams is split into micro-batches of rows, and a state
kept whole runs micro-batch 2 (rows 4..7) from micro-batch 1's state (rows 0..3): each stream
continues another's, silently (1.4e-2 of the parameters apart after 3 chunks on a small LSTM),
until a smaller micro-batch makes the RNN refuse the state's shape (noted: `STATE_PER_ROW`).

`CarriedStateCheck` holds, for the open window, the last states (`h_n`, `c_n`) each of the model's
RNNs returned in each split micro-batch (detached views: they keep the storage, so its address is
not reused by another tensor meanwhile, as the state of a micro-batch's earlier step of a decoding
loop could be), and refuses an RNN's initial state that shares the storage
of one returned in an earlier micro-batch of the window, when the state's batch axis is this
micro-batch's rows. A state carried along time (a sequence-first batch split in time on purpose,
`(L, B, H)` with B not the micro-batch's items), an encoder's state given to a decoder in the same
micro-batch, and a state kept per micro-batch across windows are not refused. A compiled model is
not watched (hooks would cost recompilations), nor `accumulate_grad` (`check_equivalence` runs it
to report such a gap, naming a module that keeps its state in plain attributes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["STATE_PER_ROW", "CarriedStateCheck"]

STATE_PER_ROW = (
    "Carry one state per row: put it in the batch rows first, with the rows' indices ({'h': "
    "h_all.transpose(0, 1).clone(), 'idx': torch.arange(B), ...}), run each micro-batch from "
    "mb['h'].transpose(0, 1).contiguous() and write its new state back at its rows, "
    "h_all[:, mb['idx']] = h_n.detach() (docs/losses.md, 'Truncated BPTT'); or, if one window "
    "may span several chunks, give each chunk of all the streams to micro_step() "
    "(Accumulator(..., accumulation_steps=chunks_per_step))."
)


class CarriedStateCheck:
    """Refuses an RNN state from an earlier micro-batch of the window given to later rows."""

    def __init__(self, model: torch.nn.Module, off: bool) -> None:
        """Find the model's RNNs (none watched if `off`: a compiled model, `accumulate_grad`)."""
        self.rnns = (
            []
            if off
            else [
                (name or "<model>", module)
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.RNNBase)
            ]
        )
        self.kept: list[torch.Tensor] = []  # detached h_n views: their addresses stay theirs
        self.earlier: set[int] = set()  # the storages of states of the window's earlier ones
        # Each RNN's last state in this micro-batch (a decoder's loop returns one per step, each
        # given to the next; only the last may be carried on, and only those are kept alive).
        self.current: dict[int, list[torch.Tensor]] = {}

    def open_window(self) -> None:
        """Forget the states of the last window: a state kept per micro-batch may go on."""
        self.kept.clear()
        self.earlier.clear()

    @contextlib.contextmanager
    def watch(self, items: int) -> Iterator[None]:
        """Watch one split micro-batch of `items` rows: hooks on the RNNs while it runs."""
        handles = []
        for name, module in self.rnns:
            handles.append(
                module.register_forward_pre_hook(self._check(name, items), with_kwargs=True)
            )
            handles.append(module.register_forward_hook(self._record))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for states in self.current.values():
                self.kept += states
                self.earlier.update(state.untyped_storage().data_ptr() for state in states)
            self.current.clear()

    def _record(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        state = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        states = state if isinstance(state, tuple) else (state,)
        self.current[id(module)] = [t.detach() for t in states if isinstance(t, torch.Tensor)]

    def _check(self, name: str, items: int) -> Any:
        def check(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            state = args[1] if len(args) > 1 else kwargs.get("hx")
            for tensor in state if isinstance(state, tuple) else (state,):
                if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
                    continue  # none, or an unbatched sequence's state
                if tensor.shape[1] != items:  # carried along time, not across rows
                    continue
                if tensor.untyped_storage().data_ptr() in self.earlier:
                    raise ValueError(self._message(name, module, items))

        return check

    def _message(self, name: str, module: torch.nn.Module, items: int) -> str:
        return (
            f"the {type(module).__name__} at {name!r} was given an initial state that an RNN "
            f"returned for an earlier micro-batch of this window: the batch was split into "
            f"micro-batches of {items} rows, so that state is other rows' (other streams'), and "
            "each micro-batch would go on from another's state, which is not the full-batch step "
            "(a state kept for truncated BPTT, self.h = h.detach(), carries across chunks in "
            f"time, not across micro-batches). {STATE_PER_ROW}"
        )
