"""A checkpoint holds only what `load_checkpoint`'s weights_only load reads back.

An optimizer or scheduler state keeps the numbers it was given as they were given: a learning
rate computed with NumPy (`lr = 3e-4 * np.sqrt(batch / 256)`, a value of `np.logspace`) or a
`T_max` from `np.ceil` is a NumPy scalar, which `torch.save` pickles as a NumPy object and a
weights_only load refuses. Such a checkpoint was written without a word and could not be loaded
at resume, the error blaming `extra`. NumPy float64s, ints and bools are now written as the
Python numbers of the same value, with which Python computes the same schedule; a written file
whose pickle still names anything a weights_only load refuses is refused before it replaces the
previous checkpoint, naming where it is: an object of your own in a scheduler's or a module's
extra state, or a NumPy float32 (its schedule is computed in float32, so a Python number would
resume it 1e-9 away from the uninterrupted run, not bitwise: `float(lr)` where it is set).

Example:
    >>> import numpy as np
    >>> plain_numbers({"param_groups": [{"lr": np.float64(0.5), "betas": (0.9, np.int64(1))}]})
    {'param_groups': [{'lr': 0.5, 'betas': (0.9, 1)}]}
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["check_stateful", "plain_numbers", "refuse_unreadable"]

_PLAIN = (str, bytes, int, float, complex, type(None), torch.Tensor, torch.dtype, torch.device)
_EXACT = "biu"  # NumPy kinds that compute as their Python numbers do (float64 too, not float32)


def plain_numbers(state: Any) -> Any:
    """`state` with each NumPy number inside its dicts, lists and tuples as a Python number.

    Containers are rebuilt only where something changed, keeping their type (a model's
    `OrderedDict` keeps its `_metadata`, the module versions); anything else is kept as it is.
    """
    if isinstance(state, np.generic) and (state.dtype.kind in _EXACT or state.dtype == np.float64):
        return state.item()
    if isinstance(state, dict):
        pairs = [(plain_numbers(k), plain_numbers(v)) for k, v in state.items()]
        if all(k is a and v is b for (k, v), (a, b) in zip(pairs, state.items(), strict=True)):
            return state
        rebuilt = copy.copy(state)  # its type and attributes, then the converted entries
        rebuilt.clear()
        rebuilt.update(pairs)
        return rebuilt
    if isinstance(state, (list, tuple)):
        items = [plain_numbers(item) for item in state]
        if all(a is b for a, b in zip(items, state, strict=True)):
            return state
        if isinstance(state, list):
            return items
        return type(state)(*items) if hasattr(state, "_fields") else type(state)(items)
    return state


def check_stateful(scheduler: object) -> None:
    """Refuse to save a scheduler that cannot give its state (a class of your own with `step()`).

    The Accumulator steps any object with `step()`, and `save_checkpoint(accumulator=acc)` saves
    its scheduler: one without `state_dict()` raised a bare `AttributeError` at the first save,
    and no call could leave it out (`scheduler=None` means the Accumulator's).

    Raises:
        ValueError: Naming the missing methods and the fix; nothing is written.
    """
    missing = [f"{n}()" for n in ("state_dict", "load_state_dict") if not hasattr(scheduler, n)]
    if scheduler is not None and missing:
        raise ValueError(
            f"cannot save the scheduler: {type(scheduler).__name__} has no "
            f"{' or '.join(missing)}, so a checkpoint cannot hold where its schedule is and a "
            "resumed run would start it over. Give it state_dict() and load_state_dict() (or "
            "build the schedule as torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)). "
            "Nothing was written."
        )


def refuse_unreadable(written: Path, payload: dict[str, Any], target: Path) -> None:
    """Raise ValueError if the file `written` names objects a weights_only load refuses.

    Only the file's pickle is read, not its tensors (torch >= 2.5; older torch skips the check).

    Args:
        written: The temporary file, not yet renamed over `target`.
        payload: What was written, to name the part that holds the object.
        target: The checkpoint's path, for the message.
    """
    find = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    refused = [] if find is None else find(written)
    if not refused:
        return
    where = _first_object(payload)
    raise ValueError(
        f"cannot write checkpoint {target}: "
        + (f"{where[0]} is a {where[1]}" if where else "it holds an object")
        + f" ({', '.join(refused)}), which the weights_only load of load_checkpoint refuses; "
        "make that state plain data (numbers, strings, lists, dicts, tensors; a NumPy float32: "
        "float(value) where it is set). Nothing was written: the previous checkpoint is kept."
    )


def _first_object(state: Any, path: str = "") -> tuple[str, str] | None:
    """The path and type name of the first entry of `state` that is not plain data."""
    if isinstance(state, dict):
        entries: Any = ((f"{path}[{k!r}]" if path else str(k), v) for k, v in state.items())
    elif isinstance(state, (list, tuple, set)):
        entries = ((f"{path}[{i}]", v) for i, v in enumerate(state))
    elif isinstance(state, _PLAIN):
        return None
    else:
        kind = type(state)
        return path, f"{kind.__module__}.{kind.__qualname__}"
    for key, value in entries:
        found = _first_object(value, key)
        if found is not None:
            return found
    return None
