"""Call a user's `loss_fn(model, micro_batch)`, and explain a newcomer's mistake when it raises.

A `loss_fn` with the wrong signature (one argument, or `(batch, model)`), or a micro-batch that
is not what it expects (a numpy array or Python list the model cannot take, a list of batches
given as one batch) fails inside the user's code, with a message that says nothing about
gradaccum's contract. Nothing is checked on the happy path: only a raising call is diagnosed,
so this costs nothing per micro-batch. The caller's window restore still runs, so nothing changes.

Example:
    >>> import torch
    >>> def loss_fn(batch):
    ...     return batch.sum()
    >>> try:
    ...     call_loss_fn(loss_fn, torch.nn.Linear(2, 1), torch.ones(3, 2))
    ... except TypeError as error:
    ...     print(str(error).split(":")[0])
    loss_fn loss_fn(batch) cannot be called as loss_fn(model, micro_batch)
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from gradaccum._carried_state import STATE_PER_ROW
from gradaccum._pairs import split_pairs_note

__all__ = [
    "call_loss_fn",
    "freed_graph_hint",
    "grad_disabled_error",
    "hints",
    "refuse_grad_disabled",
]

# torch's RNNs: "Expected hidden size (1, 3, 5), got [1, 8, 5]" (LSTM: "hidden[0] size").
_HIDDEN_SIZE = re.compile(
    r"Expected hidden(?:\[\d\])? size \(\d+, (?P<rows>\d+), \d+\), got \[\d+, (?P<given>\d+), \d+\]"
)
_BATCH_NAMES = frozenset({"batch", "micro_batch", "microbatch", "mb", "inputs", "data", "x", "b"})
_MODEL_NAMES = frozenset({"model", "net", "module", "network", "m"})
# How the notes that name a fix begin (the first note, describing the micro-batch, names none).
_FIX_NOTES = ("gradaccum: the batch holds", "gradaccum: if this list holds")


def call_loss_fn(loss_fn: Callable[..., Any], model: torch.nn.Module, micro_batch: Any) -> Any:
    """Return `loss_fn(model, micro_batch)`; if it raises, say which contract it broke.

    Raises:
        TypeError: If `loss_fn` cannot take `(model, micro_batch)` or names them the other way
            round (chained to the original error).
        Exception: Whatever `loss_fn` raised otherwise, with a note describing the micro-batch
            and, for a batch of numpy arrays, Python lists or batches, the fix.
    """
    try:
        return loss_fn(model, micro_batch)
    except Exception as error:
        if isinstance(error, torch.OutOfMemoryError):  # rerun smaller by the caller: no advice
            raise
        refusal = _signature_error(loss_fn, model)
        if refusal is not None:
            raise TypeError(refusal) from error
        add_note = getattr(error, "add_note", None)
        if add_note is not None:  # Python >= 3.11
            rows = next((t.shape[0] for t in _leaves(micro_batch) if _rows_of(t)), 0)
            for note in _notes(micro_batch) + _state_notes(error) + split_pairs_note(error, rows):
                add_note(f"gradaccum: {note}")
        raise


def grad_disabled_error(call: str) -> ValueError | None:
    """The error for `call` made while gradients are disabled, or None if they are enabled.

    A training step called inside a validation loop's `with torch.no_grad():`, or from a
    function decorated `@torch.no_grad()`, would run every `loss_fn` without a graph, and the
    loss's "does not require grad" would point at `loss_fn`, where nothing is wrong.
    """
    inference = torch.is_inference_mode_enabled()  # torch.enable_grad() does not lift it
    if torch.is_grad_enabled() and not inference:
        return None
    where, lift = (
        ("inside torch.inference_mode()", "with torch.inference_mode(False):")
        if inference
        else (
            "inside torch.no_grad() or torch.set_grad_enabled(False)",
            "with torch.enable_grad():",
        )
    )
    return ValueError(
        f"{call} was called with gradients disabled, {where}: loss_fn would build no graph and "
        "there would be nothing to accumulate. Call it outside that block (a training step "
        "inside a validation loop's `with torch.no_grad():`, or in a function decorated "
        f"@torch.no_grad()), or under `{lift}`. No loss_fn ran; nothing changed."
    )


def refuse_grad_disabled(call: str, *, micro_batches: int = 1) -> None:
    """Raise `grad_disabled_error(call)` if gradients are disabled and a micro-batch would run.

    Checked before any `loss_fn` runs (two flag reads, no device work), so an open streaming
    window is kept as it was.

    Raises:
        ValueError: Naming the block to leave; nothing has changed.
    """
    if micro_batches and (error := grad_disabled_error(call)) is not None:
        raise error


def freed_graph_hint(micro_batches: int) -> str:
    """Why a micro-batch's backward found its graph freed, after `micro_batches` ran cleanly.

    On a later micro-batch, a graph the micro-batches share (built once, outside `loss_fn`)
    was freed by the first one's backward. On the first, nothing of gradaccum ran a backward
    yet: `loss_fn` freed it itself, with a `torch.autograd.grad` (a gradient penalty) that kept
    no graph.
    """
    if micro_batches == 0:
        return (
            "the window's first backward found the loss's graph already freed: a "
            "torch.autograd.grad(...) inside loss_fn frees the graph it differentiates. For a "
            "gradient penalty, pass create_graph=True (it keeps the graph, and the penalty's "
            "own gradient flows through the gradient); for a value only needed as a number, "
            "retain_graph=True. (A tensor whose graph a backward before the step consumed fails "
            "here too: compute it inside loss_fn.)"
        )
    return (
        "every micro-batch runs its own backward, so loss_fn must not use a tensor with a graph "
        "computed outside it (once per batch, e.g. an encoder's output put in the batch, an "
        "embedding table or a weight transform): compute it inside loss_fn; a recurrent state "
        "carried from the previous micro-batch (truncated BPTT) is carried detached, "
        "h.detach(). Not retain_graph=True."
    )


def hints(error: BaseException) -> str:
    """`"; <fix>"` for each note `call_loss_fn` added to `error` naming a fix (one line)."""
    notes = getattr(error, "__notes__", [])
    return "".join(f"; {n.removeprefix('gradaccum: ')}" for n in notes if n.startswith(_FIX_NOTES))


def _signature_error(loss_fn: Callable[..., Any], model: torch.nn.Module) -> str | None:
    """Why `loss_fn`'s signature does not fit `(model, micro_batch)`, or None."""
    wrap = "wrap it: `def loss_fn(model, batch): return criterion(model(batch[0]), batch[1])`."
    if not callable(loss_fn):
        return f"loss_fn={loss_fn!r:.60} is not callable; pass a function loss_fn(model, batch)."
    if loss_fn is model:
        return f"loss_fn is the model itself; it must return the loss of a micro-batch: {wrap}"
    if isinstance(loss_fn, torch.nn.modules.loss._Loss):  # criterion(input, target)
        return f"loss_fn is a {type(loss_fn).__name__}, which takes (input, target); {wrap}"
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin or an extension type: nothing to read
        return None
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    fix = (
        "gradaccum passes the model first and the micro-batch second; define it as "
        "`def loss_fn(model, batch): ...` (bind other arguments with functools.partial)."
    )
    try:
        signature.bind(object(), object())
    except TypeError:
        return f"loss_fn {name}{signature} cannot be called as loss_fn(model, micro_batch): {fix}"
    positional = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) >= 2 and positional[0] in _BATCH_NAMES and positional[1] in _MODEL_NAMES:
        return (
            f"loss_fn {name}{signature} takes the batch first, but gradaccum calls "
            f"loss_fn(model, micro_batch): swap its parameters to ({positional[1]}, "
            f"{positional[0]})."
        )
    return None


def _notes(micro_batch: Any) -> list[str]:
    """Notes for an error raised in `loss_fn`: what it was given, and the likely fix."""
    notes = [f"loss_fn(model, micro_batch) raised; micro_batch was {_describe(micro_batch)}."]
    leaves = list(_leaves(micro_batch))
    if any(isinstance(leaf, np.ndarray) for leaf in leaves):
        notes.append(
            "the batch holds numpy arrays: gradaccum splits them but neither converts them nor "
            "moves them to the model's device; put torch.as_tensor(array) in the batch."
        )
    if _holds_number_lists(micro_batch):
        notes.append(
            "the batch holds Python lists of numbers: gradaccum splits them item by item but "
            "never makes them tensors; put torch.tensor(values) in the batch."
        )
    if (
        isinstance(micro_batch, list)
        and len(micro_batch) > 1
        and all(_is_batch(item) for item in micro_batch)
    ):
        notes.append(
            "if this list holds whole batches (a DataLoader's, collected), step() takes one "
            "batch: call acc.step(batch, loss_fn) for each, or acc.micro_step(batch, loss_fn) "
            "with Accumulator(..., accumulation_steps=N)."
        )
    return notes


def _state_notes(error: Exception) -> list[str]:
    """A note for an RNN given a state of more rows than its input: a state kept for the batch."""
    found = _HIDDEN_SIZE.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None or int(found["given"]) <= int(found["rows"]):
        return []
    return [
        f"an RNN was given an initial state of {found['given']} rows for an input of "
        f"{found['rows']}: a state kept for the whole batch (truncated BPTT over its streams, "
        "self.h = h.detach()) cannot go whole to a micro-batch of some of its rows. "
        + STATE_PER_ROW
    ]


def _rows_of(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def _leaves(obj: Any) -> Any:
    """Every leaf of a nesting of dicts, lists and tuples."""
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from _leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _leaves(value)
    else:
        yield obj


def _holds_number_lists(obj: Any) -> bool:
    """True if some list or tuple in `obj` holds only Python numbers (or lists of them)."""
    if isinstance(obj, Mapping):
        return any(_holds_number_lists(v) for v in obj.values())
    if isinstance(obj, (list, tuple)) and obj:
        leaves = list(_leaves(obj))
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in leaves):
            return True
        return any(_holds_number_lists(v) for v in obj)
    return False


def _is_batch(item: Any) -> bool:
    """True if `item` is a container whose tensors all have a leading dimension of 2 or more."""
    if not isinstance(item, (list, tuple, Mapping)):
        return False
    tensors = [leaf for leaf in _leaves(item) if isinstance(leaf, torch.Tensor)]
    return bool(tensors) and all(t.ndim >= 1 and t.shape[0] > 1 for t in tensors)


def _describe(obj: Any, depth: int = 0) -> str:
    """A short description of a batch: its containers and its leaves' types and shapes."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor{tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')} on {obj.device}"
    if isinstance(obj, np.ndarray):
        return f"numpy.ndarray{obj.shape} {obj.dtype}"
    if isinstance(obj, torch.nn.Module):
        return f"a model ({type(obj).__name__})"
    if isinstance(obj, (list, tuple, Mapping)):
        kind = type(obj).__name__
        if depth >= 2 or not obj:
            return f"a {kind} of {len(obj)}"
        items = list(obj.items()) if isinstance(obj, Mapping) else list(enumerate(obj))
        shown = [
            (f"{k!r}: " if isinstance(obj, Mapping) else "") + _describe(v, depth + 1)
            for k, v in items[:3]
        ]
        more = f", ... ({len(obj)} in all)" if len(obj) > 3 else ""
        return f"a {kind} [{', '.join(shown)}{more}]"
    text = repr(obj)
    return f"{type(obj).__name__} {text[:40]}" if len(text) <= 40 else type(obj).__name__
