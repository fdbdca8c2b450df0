"""A module outside the model that `loss_fn` runs in train mode: a distillation teacher.

A teacher (or any frozen network) held outside the model, in a closure, a global the loss
names, a `functools.partial` or the object a bound method belongs to, is not the model: none
of the model's checks see it. Left in train mode (a fresh `torchvision` model, or a loop's
`teacher.train()`), its BatchNorm normalizes each micro-batch with that micro-batch's
statistics and updates its running statistics once per micro-batch, so the targets it gives
depend on the split. In eval mode each item's output is its own, and the step is the
full-batch one.

Example:
    >>> import torch
    >>> teacher = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    >>> def loss_fn(model, batch):
    ...     return (model(batch) - teacher(batch)).pow(2).mean()
    >>> "teacher.eval()" in teacher_problem(loss_fn, torch.nn.Linear(3, 3))
    True
    >>> _ = teacher.eval()
    >>> teacher_problem(loss_fn, torch.nn.Linear(3, 3)) is None
    True
"""

from __future__ import annotations

from functools import partial

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._non_additive import find_non_additive

__all__ = ["held_outside", "teacher_problem"]


def _held_modules(loss_fn: object, depth: int = 2) -> list[tuple[str, torch.nn.Module]]:
    """The modules `loss_fn` holds by name, as `_random_draws.loss_generators` finds generators.

    Its closure, default arguments, the globals its code names (and, `depth` deep, those of the
    functions it names there), a partial's arguments, a bound method's object's attributes
    (and an `nn.Module` object's submodules) and a callable object's attributes.
    """
    found: dict[int, tuple[str, torch.nn.Module]] = {}

    def attributes(owner: object, prefix: str) -> list[tuple[str, object]]:
        values = list(getattr(owner, "__dict__", {}).items())
        if isinstance(owner, torch.nn.Module):
            values += list(owner._modules.items())
        return [(f"{prefix}{key}", value) for key, value in values]

    def visit(fn: object, left: int) -> None:
        values: list[tuple[str, object]] = []
        while isinstance(fn, partial):
            values += [("a partial's argument", v) for v in (*fn.args, *fn.keywords.values())]
            fn = fn.func
        code = getattr(fn, "__code__", None)
        if code is not None:
            cells = getattr(fn, "__closure__", None) or ()
            for name, cell in zip(code.co_freevars, cells, strict=False):
                try:
                    values.append((name, cell.cell_contents))
                except ValueError:  # an empty cell
                    continue
            defaults = [*(getattr(fn, "__defaults__", None) or ())]
            defaults += [*(getattr(fn, "__kwdefaults__", None) or {}).values()]
            values += [("a default argument", v) for v in defaults]
            owner = getattr(fn, "__self__", None)  # a bound method: its object's `self.teacher`
            values += attributes(owner, "self.") if owner is not None else []
            names = getattr(fn, "__globals__", {})
            values += [(name, names[name]) for name in code.co_names if name in names]
        elif not isinstance(fn, type):  # a callable object: what it holds
            values += attributes(fn, "")
        for name, value in values:
            if isinstance(value, torch.nn.Module):
                found.setdefault(id(value), (name, value))
            elif left > 1 and callable(value) and hasattr(value, "__code__"):
                visit(value, left - 1)

    visit(loss_fn, depth)
    return list(found.values())


def held_outside(loss_fn: object, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules `loss_fn` holds that share no module with `model`, with their names.

    A module holding the model (a GAN's generator and discriminator in one module, the
    generator being the model) gives its parts outside it (`gan.discriminator`).
    """
    inside = {id(m) for m in model.modules()}
    found: list[tuple[str, torch.nn.Module]] = []

    def split(name: str, held: torch.nn.Module) -> None:
        if not any(id(m) in inside for m in held.modules()):
            found.append((name, held))
        elif id(held) not in inside:  # holds the model: a GAN's module, `gan.discriminator`
            for child, module in held.named_children():
                split(f"{name}.{child}", module)

    for name, held in _held_modules(loss_fn):
        split(name, held)
    return found


def teacher_problem(loss_fn: object, model: torch.nn.Module) -> str | None:
    """Why a module `loss_fn` holds outside `model` makes the step split-dependent, or None.

    Told for a train-mode BatchNorm (or one without running statistics) in it, and for state
    its train-mode forward advances once per call (spectral norm's power iteration: a GAN's
    discriminator run in the generator's window). (Dropout alone is not: random draws per
    micro-batch are noise, as the model's own are.) Only modules that share nothing with the
    model: the model itself, a wrapper of it or a part of it held by the loss as well are the
    model's checks' concern.
    """
    for name, held in held_outside(loss_fn, model):
        norms = [
            f"{_call(name)}.{n}" if n else _call(name)
            for n, m in held.named_modules()
            if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)
        ]
        if norms:
            return _batchnorm_problem(name, norms)
        stateful = [
            f"{_call(name)}.{found.name}".replace(".<model>", "")
            for found in find_non_additive(held)
            if "SpectralNorm" in found.kind or "updates its buffers" in found.reason
        ]
        if stateful:
            return _stateful_problem(name, stateful)
    return None


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _batchnorm_problem(name: str, norms: list[str]) -> str:
    return (
        f"loss_fn runs {name}, a module outside the model, whose BatchNorm layers "
        f"({_shown(norms)}) are in train mode: each micro-batch is normalized with its own "
        "statistics, and the running statistics are updated once per micro-batch, so its "
        "outputs depend on the split and the step is not the full-batch one. If it is a frozen "
        f"teacher, put it in eval mode: {_call(name)}.eval() (after each model.train(), e.g. "
        "teacher.eval()); its running statistics then make each item's output its own "
        "(and its dropout, if any, is off). If it is trained too (a GAN's discriminator), "
        "its BatchNorm needs the same care as the model's (docs/batchnorm.md, 'GANs')."
    )


def _stateful_problem(name: str, stateful: list[str]) -> str:
    call = _call(name)
    return (
        f"loss_fn runs {name}, a module outside the model, in train mode: its forward advances "
        f"state at every call ({_shown(stateful)}: spectral norm's power iteration), once per "
        "micro-batch instead of once per batch, so later micro-batches divide its weight by "
        "another estimate and the step is not the full-batch one. Exact: advance it once per "
        f"window yourself, then keep it in eval mode for the window: with torch.no_grad(): "
        f"{call}(x) on any input in train mode, then {call}.eval() around acc.step() (or the "
        f"window's micro_step() calls) and {call}.train() after (a GAN's generator step "
        "through its discriminator; docs/batchnorm.md, 'GANs')."
    )


def _call(name: str) -> str:
    """How the user would write the module's name in code (`teacher`, `self.teacher`)."""
    plain = all(part.isidentifier() for part in name.split("."))  # `gan.discriminator`
    return name if plain or name.startswith("self.") else "teacher"
