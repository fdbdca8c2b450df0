"""Finding the modules that make micro-batch accumulation inexact by construction.

BatchNorm in train mode (or without running statistics), dropout, spectral norm's power
iteration, other stateful parametrizations, and modules whose forward pre-hooks change their
buffers all compute something else on micro-batches than on one full batch. `find_non_additive`
lists them from the model alone; `hooked_buffers` and `changed_by_hooks` find the hooks that do so
once `gradaccum.verify.check_equivalence` has run the model, `diverged_buffers` the modules whose
forward updates a buffer (a running statistic) differently on micro-batches, `diverged_attributes`
likewise for plain attributes (a call counter, a hidden state kept), and `changed_parameters` those
whose forward writes their own weights (`nn.Embedding(max_norm=...)`); random draws are found by
`gradaccum._random_draws`. Everything here is used by `gradaccum.verify`.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.1))
    >>> [str(m) for m in find_non_additive(model)]
    ['1 (Dropout): draws random masks per micro-batch call']
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm as _LegacySpectralNorm

from gradaccum._averaged import named_trained_modules
from gradaccum._buffer_watch import is_observer

__all__ = [
    "NonAdditiveModule",
    "changed_by_hooks",
    "changed_parameters",
    "cuda_devices",
    "diverged_attributes",
    "diverged_buffers",
    "find_non_additive",
    "hooked_buffers",
    "ModulesRun",
]

_SPECTRAL_REASON = (
    "spectral_norm: every train-mode forward runs a power iteration that updates its buffers "
    "{}, so each micro-batch divides the weight by a different estimate than the full batch "
    "(exact in eval mode)"
)

_FREQUENCY_REASON = (
    "scale_grad_by_freq=True: each backward divides a row's gradient by how often its id occurs "
    "in that micro-batch, not in the batch, so rows looked up in several micro-batches get "
    "larger gradients"
)


@dataclass(frozen=True)
class NonAdditiveModule:
    """A module that makes micro-batches compute something else than one full batch.

    Its output for one item depends on the other items of its micro-batch (BatchNorm), on random
    draws per call (dropout), or on state that advances once per call (spectral norm).

    Attributes:
        name: Qualified module name in the model.
        kind: The module's (or its hook's) class name.
        reason: Why accumulation is inexact with it.
    """

    name: str
    kind: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.kind}): {self.reason}"


def find_non_additive(model: torch.nn.Module) -> list[NonAdditiveModule]:
    """List the modules that make micro-batch accumulation differ from a full batch.

    Parametrizations are probed on a copy (the RNG state is kept): one whose buffers change when
    it computes its weight, or whose weight changes from call to call, is listed. Hooks that
    change state are found by `check_equivalence`, which runs the model.

    Example:
        >>> import torch
        >>> [m.name for m in find_non_additive(torch.nn.Sequential(torch.nn.BatchNorm1d(3)))]
        ['0']
    """
    found = []
    for name, module in named_trained_modules(model):  # an EMA copy inside never runs in a step
        label, kind = name or "<model>", type(module).__name__
        # An eval-mode BatchNorm without running statistics still normalizes per batch.
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and (
            module.training or module.running_mean is None
        ):
            reason = (
                "normalizes with micro-batch statistics and updates running statistics "
                "once per micro-batch"
                if module.running_mean is not None
                else "normalizes with micro-batch statistics, even in eval mode "
                "(track_running_stats=False: no running statistics)"
            )
            found.append(NonAdditiveModule(label, kind, reason))
        elif module.training and (
            (isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0)
            or (isinstance(module, torch.nn.MultiheadAttention) and module.dropout > 0)
        ):
            found.append(NonAdditiveModule(label, kind, "draws random masks per micro-batch call"))
        if (
            isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))
            and module.scale_grad_by_freq
            and module.weight.requires_grad
        ):
            found.append(NonAdditiveModule(label, kind, _FREQUENCY_REASON))
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, _LegacySpectralNorm) and module.training:
                buffers = f"{hook.name}_u, {hook.name}_v"
                found.append(
                    NonAdditiveModule(label, "SpectralNorm", _SPECTRAL_REASON.format(buffers))
                )
        if parametrize.is_parametrized(module):
            for tensor, members in cast(torch.nn.ModuleDict, module.parametrizations).items():
                found += _stateful_parametrization(f"{name}.parametrizations.{tensor}", members)
    return found


def _stateful_parametrization(prefix: str, members: torch.nn.Module) -> list[NonAdditiveModule]:
    """Compute a copy of one tensor's parametrizations twice; list the members that keep state."""
    prefix = prefix.lstrip(".")
    found: dict[str, NonAdditiveModule] = {}
    for index, member in members.named_children():
        if type(member).__name__ == "_SpectralNorm" and member.training:  # known by its class
            reason = _SPECTRAL_REASON.format("_u, _v")
            found[index] = NonAdditiveModule(f"{prefix}.{index}", "_SpectralNorm", reason)
    try:
        probe = copy.deepcopy(members)
        before = {name: buffer.clone() for name, buffer in probe.named_buffers()}
        with torch.no_grad(), torch.random.fork_rng(devices=cuda_devices(probe.parameters())):
            first, second = probe(), probe()
        changed = [n for n, b in probe.named_buffers() if not torch.equal(b, before[n])]
        random = not changed and not torch.equal(first, second)
    except Exception:  # one that cannot run on its own (meta tensors...): judged by class alone
        return list(found.values())
    for owner in dict.fromkeys(name.rpartition(".")[0] for name in changed):
        shorts = ", ".join(n.rpartition(".")[2] for n in changed if n.rpartition(".")[0] == owner)
        kind = type(members.get_submodule(owner)).__name__
        reason = f"updates its buffers {shorts} each time it computes the weight, so each "
        reason += "micro-batch sees a different weight than the full batch"
        found.setdefault(owner, NonAdditiveModule(f"{prefix}.{owner}".rstrip("."), kind, reason))
    if random:
        reason = "computes a different weight on every call, so each micro-batch sees another one"
        found[""] = NonAdditiveModule(prefix, type(members).__name__, reason)
    return list(found.values())


def hooked_buffers(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Copies of the buffers of every module that runs forward pre-hooks."""
    return {
        name: {key: buffer.clone() for key, buffer in module.named_buffers(recurse=False)}
        for name, module in model.named_modules()
        if module._forward_pre_hooks and next(module.buffers(recurse=False), None) is not None
    }


def changed_by_hooks(
    model: torch.nn.Module, before: dict[str, dict[str, torch.Tensor]], known: set[str]
) -> list[NonAdditiveModule]:
    """The hooked modules whose buffers one full-batch forward changed (not already listed)."""
    found = []
    modules = dict(model.named_modules())
    for name, buffers in before.items():
        current = dict(modules[name].named_buffers(recurse=False))
        changed = [k for k, old in buffers.items() if not torch.equal(current.get(k, old), old)]
        if changed and (name or "<model>") not in known:
            reason = (
                f"it runs forward pre-hooks and one forward changed its buffers "
                f"{', '.join(changed)}: its state advances once per micro-batch, so micro-batches "
                "see other states than the full batch"
            )
            found.append(NonAdditiveModule(name or "<model>", type(modules[name]).__name__, reason))
    return found


def diverged_buffers(
    full: torch.nn.Module, accumulated: torch.nn.Module, known: set[str]
) -> list[NonAdditiveModule]:
    """Modules whose own buffers ended differently after the micro-batches than the full batch.

    A forward that updates a running statistic (a custom normalization, an EMA) advances it
    once per micro-batch; a counter of items seen ends the same and is not listed. Modules
    already listed in `known` (BatchNorm, spectral norm...), or inside them, are skipped.
    """
    found = []
    modules = dict(accumulated.named_modules())
    for name, module in full.named_modules():
        label = name or "<model>"
        if any(label == k or label.startswith(f"{k}.") or k.startswith(f"{label}.") for k in known):
            continue
        other = dict(modules[name].named_buffers(recurse=False))
        changed = [
            key
            for key, buffer in module.named_buffers(recurse=False)
            if key in other and not torch.equal(buffer, other[key])
        ]
        if changed:
            buffers = ", ".join(changed)
            if is_observer(module):  # QAT: eval mode does not stop an observer
                reason = (
                    f"its observer updates its buffers {buffers} in every forward, in eval mode "
                    "too, once per micro-batch instead of once per batch, so later micro-batches "
                    "quantize with another range"
                )
            else:
                when = "" if module.training else ", even in eval mode,"
                reason = (
                    f"its forward updates its buffers {buffers}{when} once per micro-batch "
                    "instead of once per batch, so later micro-batches see another state"
                )
            found.append(NonAdditiveModule(label, type(module).__name__, reason))
    return found


def diverged_attributes(
    full: torch.nn.Module, accumulated: torch.nn.Module, known: set[str]
) -> list[NonAdditiveModule]:
    """Modules whose plain attributes (no buffer) ended differently after the micro-batches.

    A call counter (`self.calls += 1`) or a hidden state kept between calls (`self.h = h.detach()`)
    is state as much as a buffer is, but neither is in `named_buffers()`: numbers, tensors and
    tuples or lists of them are compared. Modules already listed in `known` are skipped.
    """
    found = []
    modules = dict(accumulated.named_modules())
    for name, module in full.named_modules():
        label = name or "<model>"
        if label in known:
            continue
        other = vars(modules[name])
        changed = [
            key
            for key, value in vars(module).items()
            if key != "training" and _plain(value) and not _same(value, other.get(key))
        ]
        if changed:
            reason = (
                f"its forward changes its attributes {', '.join(changed)} (plain Python state, "
                "not a buffer) once per micro-batch instead of once per batch; where the "
                "forward reads them, later micro-batches see another state"
            )
            found.append(NonAdditiveModule(label, type(module).__name__, reason))
    return found


def _plain(value: object) -> bool:
    """A number, a tensor that is no parameter, or a tuple or list of them (an LSTM's (h, c))."""
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_plain(item) for item in value)
    if isinstance(value, torch.Tensor):
        return not isinstance(value, torch.nn.Parameter)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(value: object, other: object) -> bool:
    if isinstance(value, (tuple, list)):
        return (
            isinstance(other, (tuple, list))
            and len(other) == len(value)
            and all(_same(a, b) for a, b in zip(value, other, strict=True))
        )
    if isinstance(value, torch.Tensor):
        return isinstance(other, torch.Tensor) and torch.equal(value, other)
    return bool(value == other)


def changed_parameters(
    original: torch.nn.Module, ran: torch.nn.Module, known: set[str]
) -> list[NonAdditiveModule]:
    """Modules whose parameters the forward itself wrote in place (no optimizer ran).

    `nn.Embedding(max_norm=...)` renormalizes the rows it looks up: each micro-batch then sees
    the rows the earlier ones renormalized, the full batch sees every row of the batch
    renormalized before any item is scored. Nothing differs while that lookup alone reads the
    weight; a tied weight (an LM head reading the embedding) reads all rows and differs.
    """
    found: dict[str, NonAdditiveModule] = {}
    before = dict(original.named_parameters())
    for name, param in ran.named_parameters():
        old = before.get(name)
        if old is None or torch.equal(param.detach(), old.detach().to(param.dtype)):
            continue
        owner, _, key = name.rpartition(".")
        label = owner or "<model>"
        if label in known or label in found:
            continue
        module = ran.get_submodule(owner)
        reason = (
            f"its forward wrote its parameter {key} in place, so each micro-batch reads the "
            "weights the earlier micro-batches left while the full batch reads them all "
            "changed before any item is scored; exact only if nothing but this module's own "
            "lookup reads them (a tied LM head reads every row)"
        )
        found[label] = NonAdditiveModule(label, type(module).__name__, reason)
    return list(found.values())


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Every CUDA device when any of `tensors` is on one (their RNGs are forked too), else none."""
    return list(range(torch.cuda.device_count())) if any(t.is_cuda for t in tensors) else []


class ModulesRun:
    """Which of `model`'s modules are called inside `with`: only those can make a step inexact.

    A module the model holds that never runs in a step (a user's EMA copy in train mode, a
    head used only at evaluation) changes nothing the step computes: its BatchNorm or dropout
    is not a cause. Every module counts as run (nothing is known) for a compiled model, whose
    inlined modules may not call the hook, or when no module was called.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._names = {id(m): name or "<model>" for name, m in model.named_modules()}
        self._compiled = any(type(m).__name__ == "OptimizedModule" for m in model.modules())
        self._ran: set[str] = set()
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    def __enter__(self) -> ModulesRun:
        if not self._compiled:  # compiled: all count as run, and torch warns of a global hook
            self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()

    def _seen(self, module: torch.nn.Module, args: object) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._ran.add(name)

    def ran(self, name: str) -> bool:
        """Whether the module `name` ran, or its parent (which may use it without calling it).

        A parent may call `F.batch_norm(x, self.bn.running_mean, ...)`. True when nothing is
        known.
        """
        parent = (name.rpartition(".")[0] or "<model>") if name != "<model>" else name
        return self._compiled or not self._ran or name in self._ran or parent in self._ran
