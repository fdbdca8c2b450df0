"""The layout of `Accumulator.state_dict()`, checked whole before a load changes anything.

A state comes back from a file the user may have edited, truncated or built by hand. The
components restore their parts one after the other (the window, then the precision runtime,
then automatic sizing, telemetry and the counters), so a value that fails to convert halfway
(a missing key, a `None`, a string where an int belongs) would leave some parts loaded and
others not. Every value a load reads is therefore checked here first, and a damaged state is
refused with one `ValueError` naming the first bad entry by its path.

Only the types and the nesting are checked here; whether the state fits this model and these
settings (parameter shapes, precision, BatchNorm mode) is checked by the components.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from gradaccum._dtensor import local_tensor

__all__ = ["check_state_layout", "check_tensors_fit"]

Rule = tuple[Callable[[object], bool], str]  # a test and what it wants, for the message


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return _is_int(value) and value >= 0  # type: ignore[operator]


def _is_rates(value: object) -> bool:
    """`{"<size>": items per second}`, as the tuner writes its timings."""
    if not isinstance(value, Mapping):
        return False
    return all(isinstance(k, str) and k.isdigit() and _is_real(v) for k, v in value.items())


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_float_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _optional(rule: Rule) -> Rule:
    test, wanted = rule
    return (lambda value: value is None or test(value)), f"None or {wanted}"


def _list_of(rule: Rule) -> Rule:
    test, wanted = rule
    return (lambda value: isinstance(value, list) and all(test(v) for v in value)), (
        f"a list of {wanted}"
    )


INT: Rule = (_is_count, "an int >= 0")
REAL: Rule = (_is_real, "a number")
BOOL: Rule = (lambda v: isinstance(v, bool), "a bool")
STR: Rule = (lambda v: isinstance(v, str), "a str")
DICT: Rule = (lambda v: isinstance(v, Mapping), "a dict")
TENSOR: Rule = (_is_float_tensor, "a floating-point tensor")
SHAPES: Rule = _list_of(((lambda v: isinstance(v, list) and all(map(_is_int, v))), "int lists"))

_TOP = {"settings": DICT, "engine": DICT, "nonfinite_windows": INT, "empty_windows": INT}
_STREAK: Rule = (  # the drop streak is newer: a state saved before it holds none
    lambda v: (
        isinstance(v, Mapping)
        and _is_count(v.get("in_a_row"))
        and BOOL[0](v.get("warned"))
        and _is_count(v.get("dropped_in_a_row", 0))
        and BOOL[0](v.get("warned_dropped", False))
    ),
    '{"in_a_row": an int >= 0, "warned": a bool, "dropped_in_a_row": an int >= 0, '
    '"warned_dropped": a bool}',
)
_TOP_OPTIONAL = {  # newer than version 2
    "auto": _optional(DICT),
    "telemetry": _optional(DICT),
    "nonfinite_in_a_row": _STREAK,
}
_ENGINE = {"window": DICT, "precision": DICT, "batchnorm_mode": STR, "batchnorm": DICT}
_RANK_AND_WORLD: Rule = (
    lambda v: isinstance(v, list) and len(v) == 2 and all(map(_is_count, v)),
    "[rank, world size]",
)
_BUFFER_STARTS: Rule = (
    lambda v: (
        isinstance(v, list)
        and all(
            isinstance(e, list)
            and len(e) == 2
            and isinstance(e[0], str)
            and isinstance(e[1], torch.Tensor)
            for e in v
        )
    ),
    "a list of [buffer name, tensor]",
)
_ENGINE_OPTIONAL = {  # newer than version 2
    "origin": _optional(_RANK_AND_WORLD),
    "buffers": _BUFFER_STARTS,
}
_OPEN_WINDOW = {
    "count": INT,
    "loss_sum": _optional(TENSOR),
    "largest_micro_batch": INT,
    "denominator": REAL,
    "loss_scale": REAL,
    "param_shapes": SHAPES,
    "grads": _list_of(_optional(TENSOR)),
}
_OPEN_WINDOW_OPTIONAL = {"loss_host": REAL, "terms": _optional(DICT)}  # newer than version 2
_PRECISION = {
    "accum_dtype": _optional(STR),
    "scaler": _optional(DICT),
    "buffers": _list_of(_optional(TENSOR)),
}
_SCALER = {
    "scale": REAL,
    "growth_factor": REAL,
    "backoff_factor": REAL,
    "growth_interval": INT,
    "_growth_tracker": INT,
}
_AUTO = {
    "planned": _optional(INT),
    "size": _optional(INT),
    "clean_windows": INT,
    "wait": _optional(INT),
    "growing": BOOL,
    "out_of_memory_events": INT,
    "plan": _optional(DICT),
}
_AUTO_OPTIONAL = {"capped": BOOL, "tuner": _optional(DICT), "regrow_after": _optional(INT)}
_TUNER = {
    "fits": INT,
    "window_items": INT,
    "chosen": _optional(INT),
    "incumbent": INT,
    "reason": _optional(STR),
    "work": _optional(REAL),
    "rates": (_is_rates, 'a dict of {"<size>": rate}'),
}
_DECISION = {"work": REAL, "chosen": INT, "reason": STR, "rates": _TUNER["rates"]}
_TUNER_OPTIONAL = {  # a decision per shape timed (absent from states saved before)
    "decisions": (
        lambda v: isinstance(v, list) and all(_fits(d, _DECISION) and _capped(d) for d in v),
        'a list of {"work", "chosen", "reason", "rates", "fits"}',
    ),
}
_PLAN_RULES = {"probes": SHAPES, "device": STR}  # every other MemoryPlan field is a number
_TELEMETRY = {
    "steps": INT,
    "trace": REAL,
    "grad_sq": REAL,
    "small": _optional(((lambda v: isinstance(v, list) and len(v) == 3), "a list of 3")),
}


def check_state_layout(state: Mapping[str, Any], plan_fields: Collection[str]) -> None:
    """Raise ValueError naming the first entry of `state` a load could not read; change nothing.

    Args:
        state: An `Accumulator.state_dict()` whose version was already checked.
        plan_fields: The fields of a `MemoryPlan` (`sizing` is not imported here: it imports
            the precision runtime, which imports this module).
    """
    _check(state, "", _TOP, _TOP_OPTIONAL)
    engine = state["engine"]
    _check(engine, "engine.", _ENGINE, _ENGINE_OPTIONAL)
    window = engine["window"]
    _check(window, "engine.window.", {"micro_batches": INT})
    if window["micro_batches"]:  # a closed window reads nothing else
        _check(window, "engine.window.", _OPEN_WINDOW, _OPEN_WINDOW_OPTIONAL)
    precision = engine["precision"]
    _check(precision, "engine.precision.", _PRECISION)
    if precision["scaler"]:
        _check(precision["scaler"], "engine.precision.scaler.", _SCALER)
    elif precision["scaler"] is None and state["settings"].get("precision") == "fp16":
        _damaged("engine.precision.scaler", "the GradScaler state of an fp16 Accumulator", None)
    auto = state.get("auto")
    if auto is not None:
        _check(auto, "auto.", _AUTO, _AUTO_OPTIONAL)
        plan = auto["plan"]
        if plan is not None and set(plan) != set(plan_fields):
            _damaged("auto.plan", f"the fields of a MemoryPlan {sorted(plan_fields)}", plan)
        if plan is not None:  # sizes and bytes, `probes` as [size, bytes] pairs, `device`
            rules = {key: _PLAN_RULES.get(key, REAL) for key in plan_fields}
            _check(plan, "auto.plan.", rules)
        if auto.get("tuner") is not None:
            _check(auto["tuner"], "auto.tuner.", _TUNER, _TUNER_OPTIONAL)
    if state.get("telemetry") is not None:
        _check(state["telemetry"], "telemetry.", _TELEMETRY)


def check_tensors_fit(
    tensors: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor], what: str
) -> None:
    """Raise ValueError unless there is one saved tensor (or None) per parameter, shaped as it.

    Args:
        tensors: Saved gradients or accumulation buffers, in the parameters' order.
        params: The parameters they are loaded into.
        what: Their name, for the message.
    """
    if len(tensors) != len(params):
        raise ValueError(
            f"the saved Accumulator's {what} are {len(tensors)}, for {len(params)} parameters "
            "here; load the state into the same model and optimizer."
        )
    for index, (tensor, param) in enumerate(zip(tensors, params, strict=True)):
        mine = local_tensor(param).shape  # shard to shard: an FSDP2 checkpoint holds local ones
        if tensor is not None and local_tensor(tensor).shape != mine:
            raise ValueError(
                f"the saved Accumulator's {what}: entry {index} has shape "
                f"{list(tensor.shape)}, its parameter {list(mine)}; load the state into the "
                "same model and optimizer."
            )


def _fits(part: object, rules: Mapping[str, Rule]) -> bool:
    """Whether `part` is a dict holding every key of `rules`, each passing its test."""
    if not isinstance(part, Mapping):
        return False
    return all(key in part and test(part[key]) for key, (test, _) in rules.items())


def _capped(decision: Mapping[str, Any]) -> bool:
    """A tuner decision's optional `fits`: None, or the size that fit after out of memory."""
    return decision.get("fits") is None or _is_count(decision["fits"])


def _check(
    part: Mapping[str, Any],
    prefix: str,
    required: Mapping[str, Rule],
    optional: Mapping[str, Rule] | None = None,
) -> None:
    for key, (test, wanted) in required.items():
        if key not in part:
            _damaged(prefix + key, wanted, missing=True)
        if not test(part[key]):
            _damaged(prefix + key, wanted, part[key])
    for key, (test, wanted) in (optional or {}).items():
        if key in part and not test(part[key]):
            _damaged(prefix + key, wanted, part[key])


def _damaged(path: str, wanted: str, value: object = None, *, missing: bool = False) -> None:
    found = "is missing" if missing else f"is {_describe(value)}"
    raise ValueError(
        f"the Accumulator state is damaged: {path} {found}, expected {wanted}. Load a state "
        "exactly as Accumulator.state_dict() returned it (or the checkpoint it was saved in); "
        "nothing was changed."
    )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    text = repr(value)
    return (
        f"{text[:60]}... ({type(value).__name__})"
        if len(text) > 60
        else f"{text} ({type(value).__name__})"
    )
