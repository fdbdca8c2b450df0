"""What a checkpoint may hold and whether it fits: checks run before anything is written or changed.

- `check_extra`: `save_checkpoint(extra=...)` takes only what a `weights_only` load reads back
  (plain containers, numbers, strings, bytes, tensors, dtypes, devices), so a file that saved
  always loads;
- `check_optimizer_fits`: an optimizer state fits only an optimizer of the same class (by name,
  and by the settings of its param groups, which also catches files that record no class), with
  the same number of param groups, of parameters per group, and per-parameter buffers of each
  parameter's shape;
- `check_accumulator_targets`: the optimizer and scheduler given with an Accumulator are the
  ones it steps (a stale one, rebuilt at a stage change without telling it, is refused);
- `check_intact`: a checkpoint's bytes are the ones written (the CRC-32 of each zip record),
  and it is a zip archive at all (another file gets torch's unrelated unpickling advice);
- `default_scheduler`: the scheduler a checkpoint saves and loads when none is passed;
- `one_line`: an exception's message as one plain line (no ANSI escapes, no line breaks);
- `unwrapped` / `strip_wrapper_prefixes`: a checkpoint holds the weights of the module inside a
  `torch.compile` or DDP / DataParallel wrapper, so it loads into the model wrapped or not.

Example:
    >>> check_extra({"epoch": 3, "order": [2, 0, 1]})
    >>> import numpy as np
    >>> check_extra({"order": np.arange(3)})
    Traceback (most recent call last):
    ...
    ValueError: extra['order'] is a numpy.ndarray, which a weights_only load cannot read back; ...
"""

from __future__ import annotations

import functools
import io
import pickle
import re
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from gradaccum._wrappers import WRAPPER_PREFIXES, unwrapped

__all__ = [
    "CheckpointError",
    "check_accumulator_targets",
    "check_class",
    "check_extra",
    "check_intact",
    "check_optimizer_fits",
    "default_scheduler",
    "one_line",
    "scheduler_kind",
    "strip_wrapper_prefixes",
    "unwrapped",
]


class CheckpointError(ValueError):
    """A checkpoint file is damaged, incomplete or of another kind, or does not fit its targets.

    Targets are the model, optimizer, scheduler and accumulator it is loaded into.
    """


def check_accumulator_targets(optimizer: Any, accumulator: Any, scheduler: Any, verb: str) -> None:
    """Refuse an optimizer or scheduler given with `accumulator` that it does not step.

    An optimizer rebuilt at a stage change without `acc.optimizer = ...` never trains: the
    Accumulator steps its own. Saving the rebuilt one writes a state that never moved; loading
    into it leaves the one that trains as it was. `verb` is "save" or "load".

    Raises:
        ValueError: Naming both objects and the fix, before anything is written or changed.
    """
    if accumulator is None:
        return
    for name, given, stepped in (
        ("optimizer", optimizer, accumulator.optimizer),
        ("scheduler", scheduler, accumulator.scheduler),
    ):
        if given is None or stepped is None or given is stepped:
            continue
        kind, own = type(given).__name__, type(stepped).__name__
        also = ", another object of the same class" if kind == own else ""
        raise ValueError(
            f"cannot {verb} a checkpoint: the {name} given ({kind}) is not the one the "
            f"accumulator steps (acc.{name}: {own}{also}), so its state is not the run's. "
            f"Pass {name}=acc.{name}; or, if the {name} given is the one meant to train "
            f"(rebuilt at a stage change), set acc.{name} = {name} between windows first. "
            "Nothing was written or changed."
        )


def strip_wrapper_prefixes(saved: dict[str, Any], keys: Any) -> dict[str, Any]:
    """`saved` without the wrapper prefixes on all its keys, if the model's `keys` lack them."""
    wanted = set(keys)
    while saved.keys() != wanted and saved:
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in saved)), None)
        if prefix is None or any(k.startswith(prefix) for k in wanted):
            return saved
        stripped = OrderedDict((key[len(prefix) :], value) for key, value in saved.items())
        metadata = getattr(saved, "_metadata", None)  # module versions, keyed by module path
        if isinstance(metadata, dict):
            stripped._metadata = OrderedDict(  # type: ignore[attr-defined]
                (k[len(prefix) :] if k.startswith(prefix) else "", v) for k, v in metadata.items()
            )
        saved = stripped
    return saved


def check_intact(source: Path) -> None:
    """Refuse a file that is no checkpoint archive, or whose records differ from those written.

    `torch.save` records a CRC-32 per record of its zip archive, but `torch.load` does not
    compare them: a bit flipped inside a tensor (a failing disk, a bad copy) loads silently as
    another number. Records written without a CRC (0) are not checked.

    Raises:
        CheckpointError: Naming the file and what is wrong with it.
    """
    with source.open("rb") as file:
        head = file.read(4)
    if head and not head.startswith((b"PK\x03\x04", b"\x80")):  # \x80: a legacy pickle
        raise CheckpointError(
            f"{source} is not a checkpoint file: it starts with {head!r}, and torch.save writes "
            "a zip archive; give the file save_checkpoint wrote (a run's checkpoint.pt)."
        )
    if not zipfile.is_zipfile(source):
        return  # a legacy pickle, or an archive cut short: torch.load says which
    try:
        with zipfile.ZipFile(source) as archive:
            for record in archive.infolist():
                if record.CRC:
                    with archive.open(record) as data:  # compares the CRC-32 at its end
                        while data.read(1 << 24):
                            pass
    except Exception as error:  # damaged headers fail in zipfile in many ways
        raise CheckpointError(
            f"cannot read checkpoint {source}: it is corrupted ({one_line(error)}); its bytes "
            "are not the ones save_checkpoint wrote. Load an intact copy."
        ) from error


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def one_line(error: BaseException, limit: int = 200) -> str:
    """`TypeName: message` of `error` as one plain line, ANSI escapes removed, cut to `limit`."""
    text = " ".join(_ANSI.sub("", str(error)).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


# Leaves a weights_only load reads back, by exact type (a subclass, such as an IntEnum or a
# numpy scalar deriving from float, is pickled by its own class, which such a load refuses).
_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    torch.Tensor,
    torch.nn.Parameter,
    torch.dtype,
    torch.device,
    torch.Size,
)
_CONTAINERS = (dict, OrderedDict, list, tuple, set)
# Types a weights_only load reads back only from some torch release on (torch 2.4 refuses all
# four), or only when not empty (pickle writes an empty bytes as a call to `bytes()`, which every
# torch up to 2.13 at least refuses).
_PROBED = {complex: 1j, bytes: b"\x00", bytearray: bytearray(b"\x00"), set: {0}}


@functools.cache
def _loads_back(kind: type, empty: bool) -> bool:
    """Whether the running torch's `weights_only` load reads back a `kind` (`empty` or not).

    Tried once by a round trip in memory: the exact rule of whichever torch is installed,
    rather than a table of the releases that allowed each type.
    """
    buffer = io.BytesIO()
    torch.save(kind() if empty else _PROBED[kind], buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError:
        return False
    return True


def check_extra(extra: object, path: str = "extra") -> None:
    """Refuse an `extra` that a `weights_only` load could not read back.

    Args:
        extra: What the caller passes as `save_checkpoint(extra=...)`.
        path: How to name `extra` in the message.

    Raises:
        ValueError: Naming the first item of another type and how to convert it.
    """
    kind = type(extra)
    if kind in _PROBED and not _loads_back(kind, empty=not extra):  # type: ignore[arg-type]
        fix = "a list" if kind is set else "a list of numbers (list(value)), a tensor or a string"
        raise ValueError(
            f"{path} is {'an empty' if not extra else 'a'} {kind.__name__}, which the "
            f"weights_only load of torch {torch.__version__} cannot read back; convert it to "
            f"{fix} first. Nothing was written."
        )
    if kind in _LEAVES:
        return
    if kind in (dict, OrderedDict) and isinstance(extra, dict):
        for key, value in extra.items():
            check_extra(key, f"a key of {path}")
            check_extra(value, f"{path}[{key!r}]")
        return
    if kind in _CONTAINERS and isinstance(extra, list | tuple | set):
        for index, value in enumerate(extra):
            check_extra(value, f"{path}[{index}]" if kind is not set else f"an item of {path}")
        return
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    raise ValueError(
        f"{path} is a {name}, which a weights_only load cannot read back; convert it to a tensor "
        "(torch.as_tensor), a list, a number or a string first. extra takes dicts, lists, tuples "
        "and sets of numbers, strings, bytes, tensors, dtypes and devices. Nothing was written."
    )


def _article(word: str) -> str:
    """'a' or 'an' as the name is spoken: an initialism by its first letter's name (an SGD)."""
    if word[:2].isupper():
        return "an" if word[0] in "AEFHILMNORSX" else "a"
    return "an" if word[:1].upper() in "AEIOU" else "a"


def scheduler_kind(scheduler: object) -> str:
    """The scheduler's class name, with those it chains: `SequentialLR[LinearLR, ExponentialLR]`.

    torch's `SequentialLR` and `ChainedScheduler` load each saved inner state into whatever
    scheduler sits at its place, without a check, so their kind includes the inner ones.
    """
    name = type(scheduler).__name__
    inner = getattr(scheduler, "_schedulers", None)
    if not isinstance(inner, (list, tuple)):
        return name
    return f"{name}[{', '.join(map(scheduler_kind, inner))}]"


def default_scheduler(accumulator: Any, saved: dict[str, Any] | None = None) -> Any:
    """The `accumulator`'s scheduler, for a save or load given no `scheduler`; else None.

    It is the one the Accumulator steps, so a run saved and loaded as the README shows (with
    `accumulator=acc` only) resumes its schedule instead of starting it over. A load (`saved`:
    the file's states) takes it only if the file holds a state of that scheduler's kind: a run
    resumed with another schedule on purpose starts it afresh, as when one is passed as None.
    """
    scheduler = getattr(accumulator, "scheduler", None)
    if scheduler is None or saved is None:
        return scheduler
    recorded = saved.get("scheduler_class")
    kind = scheduler_kind(scheduler) if "[" in str(recorded) else type(scheduler).__name__
    return scheduler if saved.get("scheduler") is not None and recorded == kind else None


def check_class(
    source: Path, saved_class: object, target: object, what: str, kind: str | None = None
) -> None:
    """Refuse the state of another class (files written before the name was recorded pass).

    `kind` (`scheduler_kind`) is compared whole, except with a file that recorded only the
    outer class name (written before the inner ones were recorded).
    """
    current_class = type(target).__name__
    if kind is not None and not (isinstance(saved_class, str) and "[" not in saved_class):
        current_class = kind
    if saved_class is not None and saved_class != current_class:
        raise CheckpointError(
            f"{source} holds the state of {_article(str(saved_class))} {saved_class} {what}, but "
            f"it is loaded into {_article(current_class)} {current_class}, whose state and "
            f"settings differ; build {_article(str(saved_class))} {saved_class} as the run that "
            "saved it did."
        )


_SAME_GROUPS = "build the optimizer with the same param groups as the run that saved it"
# Per-parameter buffers of torch's optimizers that have the parameter's shape.
_ELEMENTWISE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta"}
    | {"sum", "grad_avg", "exp_inf", "ax", "prev", "step_size"}
)


def check_optimizer_fits(
    source: Path, payload: dict[str, Any], optimizer: torch.optim.Optimizer
) -> None:
    """Refuse an optimizer state of another optimizer type or parameter layout.

    The type is read from the recorded class name and, for every file, from the settings of the
    param groups: a group whose saved settings both lack some of this optimizer's and hold others
    (an AdamW's `betas` against an SGD's `momentum`) is another optimizer's. A torch version that
    only adds settings passes.
    """
    check_class(source, payload.get("optimizer_class"), optimizer, "optimizer")
    state = payload["optimizer"]
    saved_groups = state.get("param_groups")
    if not isinstance(state.get("state"), dict) or not isinstance(saved_groups, list):
        raise CheckpointError(
            f"{source} holds a damaged optimizer state (it lacks 'state' or 'param_groups')."
        )
    groups = optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise CheckpointError(
            f"{source} holds an optimizer state of {len(saved_groups)} param groups, the "
            f"optimizer has {len(groups)}; {_SAME_GROUPS}."
        )
    saved_params: list[Any] = []
    params: list[torch.Tensor] = []
    for index, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        listed = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(listed, list):
            raise CheckpointError(
                f"{source} holds a damaged optimizer state: param group {index} lists no params."
            )
        if len(listed) != len(group["params"]):
            raise CheckpointError(
                f"{source} holds {len(listed)} params in optimizer param group {index}, the "
                f"optimizer has {len(group['params'])} there; {_SAME_GROUPS}."
            )
        _check_settings(source, index, saved, group, optimizer)
        saved_params += listed
        params += group["params"]
    _check_buffer_shapes(source, state["state"], saved_params, params)


def _check_settings(
    source: Path,
    index: int,
    saved: dict[str, Any],
    group: dict[str, Any],
    optimizer: torch.optim.Optimizer,
) -> None:
    file_only = sorted(str(key) for key in saved.keys() - group.keys())
    optimizer_only = sorted(str(key) for key in group.keys() - saved.keys())
    if file_only and optimizer_only:
        name = type(optimizer).__name__
        raise CheckpointError(
            f"{source} holds the state of another optimizer type: its param group {index} has "
            f"the settings {file_only[:4]}, which this {name} lacks, and lacks its "
            f"{optimizer_only[:4]}; build the optimizer type the run that saved it used."
        )


def _check_buffer_shapes(
    source: Path, state: dict[Any, Any], saved_params: list[Any], params: list[torch.Tensor]
) -> None:
    for position, (saved_id, param) in enumerate(zip(saved_params, params, strict=True)):
        buffers = state.get(saved_id)
        if not isinstance(buffers, dict):
            continue  # a parameter that never stepped has no state
        for name, value in buffers.items():
            if name not in _ELEMENTWISE or not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{source} holds an optimizer {name!r} of shape {tuple(value.shape)} for "
                    f"parameter {position} (in param-group order), which has shape "
                    f"{tuple(param.shape)}; {_SAME_GROUPS}, in the same order."
                )
