"""Weight averages held inside the model: an EMA or SWA copy kept as a submodule.

A training module often keeps its EMA as an attribute, `self.ema = AveragedModel(self.net, ...)`,
so that one `state_dict()` and one checkpoint hold both. The copy's parameters still require grad
(AveragedModel deep-copies the module as it is) and its BatchNorm layers are in train mode, but
its forward never runs in a training step: `update_parameters` moves its weights after each step
and `update_bn` sets its statistics at the end. So it is not "a parameter nothing trains", nor a
BatchNorm normalizing micro-batches, nor gradients to plan memory for, nor buffers a forward
updates (a failed window must not put back an update the user made between micro-batches); the
checks that read the model's modules statically leave it out. An average updated inside a
window, after every `micro_step()` instead of when a step was taken, is warned of
(`AverageWatch`).

Example:
    >>> import torch
    >>> from torch.optim.swa_utils import AveragedModel
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> holder = torch.nn.ModuleDict({"net": net, "ema": AveragedModel(net)})
    >>> sorted(name for name, _ in named_trained_modules(holder))
    ['', 'net', 'net.0']
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.optim.swa_utils import AveragedModel

__all__ = [
    "AverageWatch",
    "averaged_parameter_ids",
    "copied_parameter_ids",
    "named_trained_modules",
]


def named_trained_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """`model.named_modules()` without those inside a weight average the model holds.

    The model itself is kept even if it is an `AveragedModel`: then it is what is trained.
    """
    skipped: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in skipped):
            continue
        if name and isinstance(module, AveragedModel):
            skipped.append(name + ".")
            continue
        yield name, module


def averaged_parameter_ids(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters that only a weight average inside `model` holds.

    A parameter the trained modules share with it (none, for AveragedModel's deep copy) is not
    one of them.
    """
    averaged = {
        id(p)
        for name, module in model.named_modules()
        if name and isinstance(module, AveragedModel)
        for p in module.parameters()
    }
    if not averaged:  # the common case: no weight average inside
        return averaged
    modules = named_trained_modules(model)
    trained = {id(p) for _, module in modules for p in module.parameters(recurse=False)}
    return averaged - trained


def _signature(module: torch.nn.Module, leave: set[int]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The names and shapes of `module`'s parameters, without those whose id is in `leave`."""
    return tuple(
        (name, tuple(p.shape)) for name, p in module.named_parameters() if id(p) not in leave
    )


def copied_parameter_ids(model: torch.nn.Module, held: set[int]) -> set[int]:
    """The parameters of a user's own weight average inside `model`, told by structure.

    An EMA class of one's own (`self.shadow = copy.deepcopy(net)`, timm's `ModelEmaV2` holding
    `self.module`; eval mode or not) is a wrapper whose parameters all lie in one child, a copy
    of a module the optimizer trains: the same parameter names and shapes, none of them shared,
    and none of the copy's in the optimizer (`held`, parameter ids) while all of the original's
    are. Two towers of one architecture are not taken (the wrapper must have no twin), nor a
    one-layer copy (a wrapped `nn.Linear(d, d)` looks like any other); `AveragedModel` is
    `averaged_parameter_ids`'.
    """
    named = [(n, m) for n, m in model.named_modules() if not isinstance(m, AveragedModel)]
    counts: dict[tuple[tuple[str, tuple[int, ...]], ...], int] = {}
    for _, module in named:
        key = _signature(module, set())
        counts[key] = counts.get(key, 0) + 1
    found: set[int] = set()
    for name, wrapper in named:
        own = {id(p) for p in wrapper.parameters()}
        children = [c for c in wrapper.children() if any(True for _ in c.parameters())]
        if not name or len(children) != 1 or not own or own & held or own & found:
            continue
        (copy,) = children
        layers = sum(1 for m in copy.modules() if any(True for _ in m.parameters(recurse=False)))
        if layers < 2 or own != {id(p) for p in copy.parameters()}:
            continue
        if counts[_signature(wrapper, set())] > 1:
            continue  # the wrapper has a twin: two towers of one architecture
        target = _signature(copy, set())
        for other_name, other in named:
            if other_name == name or other_name.startswith(name + "."):
                continue
            ancestor = not other_name or name.startswith(other_name + ".")
            originals = [p for p in other.parameters() if id(p) not in own]
            if (
                originals
                and all(id(p) in held for p in originals)
                and _signature(other, own if ancestor else set()) == target
            ):
                found |= own
                break
    return found


class AverageWatch:
    """Notices a weight average inside the model updated between a window's micro-batches.

    `update_parameters` adds one to the average's `n_averaged` buffer in place, so its version
    counter (read on the host: no device sync) says whether the window saw an update.

    Args:
        model: The model (unwrapped).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._averages = [
            (name, module)
            for name, module in model.named_modules()
            if name and isinstance(module, AveragedModel)
        ]
        self.buffer_names = {  # as the buffer watch names them (state_dict keys)
            f"{name}.{key}" for name, module in self._averages for key, _ in module.named_buffers()
        }
        self._opened: list[tuple[str, torch.nn.Module, torch.Tensor, int]] = []
        self._streak = 0  # consecutive split windows inside which an average was updated
        self._warned = False

    def open(self) -> None:
        """Note each average's update count as a window opens."""
        self._opened = []
        for name, module in self._averages:
            count = getattr(module, "n_averaged", None)
            if isinstance(count, torch.Tensor) and not count.is_inference():
                self._opened.append((name, module, count, count._version))

    def close(self, micro_batches: int) -> str | None:
        """At a commit of `micro_batches`: the warning's text (once) if an average moved in it."""
        opened, self._opened = self._opened, []
        updates = {}  # each average's updates inside the window (version counter steps)
        for name, module, count, version in opened:
            now = getattr(module, "n_averaged", None)
            updates[name] = count._version - version if now is count else 1  # 1: reassigned
        moved = [name for name, n in updates.items() if n > 0]
        if micro_batches < 2 or not moved:
            self._streak = 0
            return None
        # One update inside one window may be a per-epoch SWA under partial_window="carry" (its
        # window straddles the epoch's end); after every micro_step() it is in every window.
        self._streak += 1
        if self._warned or (self._streak < 2 and max(updates.values()) < 2):
            return None
        self._warned = True
        return (
            f"the weight average {', '.join(moved)} (AveragedModel) inside the model was "
            f"updated within a window of {micro_batches} micro-batches: an EMA or SWA is "
            "updated once per optimizer step, so call update_parameters() only when "
            "result.stepped is True (README, 'Weight averaging: EMA and SWA'); after every "
            "micro_step() it takes accumulation_steps updates per step."
        )
