"""Random draws in a model's forward or its loss_fn: noticing them, and forking the generators.

Micro-batches draw other random numbers than one full batch (dropout masks, stochastic depth,
a VAE's noise, a diffusion model's timesteps), so `gradaccum.verify.check_equivalence` notes
which modules drew (`random_draws`; draws outside every forward, the loss_fn's own, add
`RANDOM_DRAWS`), whether anything drew at all (`rng_snapshot`, `rng_advanced`: torch's
generators, NumPy's, Python's and those the model holds), and runs both passes from the same
draws of all (`host_rng_forked` for NumPy's and Python's, next to `torch.random.fork_rng`; the
model's own are copied with it).

Example:
    >>> import random
    >>> before = rng_snapshot([])
    >>> with host_rng_forked():
    ...     _ = random.random()
    >>> rng_advanced(before, [])
    False
"""

from __future__ import annotations

import copy
import pickle
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch

from gradaccum._non_additive import NonAdditiveModule
from gradaccum._rng_state import held_generators

__all__ = [
    "RANDOM_DRAWS",
    "RngSnapshot",
    "generators_forked",
    "host_rng_forked",
    "loss_generators",
    "random_draws",
    "rng_advanced",
    "rng_snapshot",
]


# A forward (or loss_fn) drawing random numbers outside a dropout module: noise, stochastic depth,
# a VAE's reparameterization. Micro-batches draw other numbers than one full batch.
RANDOM_DRAWS = NonAdditiveModule(
    "<forward>",
    "random draws",
    "the forward or loss_fn drew random numbers (torch.randn_like, torch.rand, F.dropout, "
    "np.random, random, a generator of the model's or one loss_fn holds: negative sampling, "
    "a VAE's reparameterization, stochastic depth, noise, a diffusion model's timesteps, "
    "augmentation such as mixup/CutMix), and micro-batches draw other random numbers than the "
    "full batch",
)


# Python's and NumPy's global generators, as comparable plain values, then torch's states.
RngSnapshot = tuple[object, bytes, list[torch.Tensor]]


def rng_snapshot(devices: list[int], generators: Sequence[torch.Generator] = ()) -> RngSnapshot:
    """Python's and NumPy's generator states, then torch's: the CPU's, `devices`', `generators`'.

    `generators` are a model's own (`held_generators`). Python's and NumPy's count too: a model
    or loss_fn augmenting with `random`/`np.random` draws other numbers per micro-batch just as
    one drawing with torch does.
    """
    kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    host = np.asarray(keys).tobytes() + repr((kind, position, has_gauss, gauss)).encode()
    devices_states = [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
    devices_states += [generator.get_state() for generator in generators]
    return random.getstate(), host, devices_states


def rng_advanced(
    before: RngSnapshot, devices: list[int], generators: Sequence[torch.Generator] = ()
) -> bool:
    """Whether any RNG advanced since `before` was taken (with the same `generators`)."""
    python, host, states = rng_snapshot(devices, generators)
    return (
        python != before[0]
        or host != before[1]
        or any(not torch.equal(a, b) for a, b in zip(before[2], states, strict=True))
    )


@contextmanager
def host_rng_forked() -> Iterator[None]:
    """Python's and NumPy's global generators put back as they were when the block exits.

    `torch.random.fork_rng` does this for torch's alone; check_equivalence's two runs must start
    from the same draws of all three, and leave the caller's as they were.
    """
    python, numpy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


@contextmanager
def random_draws(
    model: torch.nn.Module, devices: list[int], known: set[str]
) -> Iterator[list[NonAdditiveModule]]:
    """Note the modules whose forward draws random numbers while the block runs.

    Dropout is known by its class, but stochastic depth (torchvision's `StochasticDepth`, timm's
    `DropPath`), `F.dropout` in a custom forward or injected noise are not: any forward that
    advances the CPU generator (or a CUDA one in `devices`, NumPy's or Python's) is, so each
    micro-batch draws other values than the full batch. The innermost such module is listed,
    unless `known` has it. Draws outside the model's forward (a diffusion loss_fn's timesteps
    and noise) add `RANDOM_DRAWS`, even when a module drew too (dropout in the same model). The
    list is filled when the block exits.
    """
    stack: list[RngSnapshot] = []
    drew: dict[str, str] = {}
    generators = held_generators(model)
    # The state since the last outermost forward (of the model, or of a part of it a loss_fn
    # calls itself); None once something drew outside every forward.
    last: RngSnapshot | None = rng_snapshot(devices, generators)

    def before(module: torch.nn.Module, args: Any) -> None:
        nonlocal last
        if not stack and last is not None and rng_advanced(last, devices, generators):
            last = None
        stack.append(rng_snapshot(devices, generators))

    def after(name: str, module: torch.nn.Module, args: Any, output: Any) -> None:
        nonlocal last
        if stack and rng_advanced(stack.pop(), devices, generators):
            drew[name] = type(module).__name__
        if not stack and last is not None:
            last = rng_snapshot(devices, generators)

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(partial(after, name), always_call=True))
    found: list[NonAdditiveModule] = []
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
    for name, kind in drew.items():  # the innermost: no module inside it drew too
        inner = any(other.startswith(f"{name}.") or not name for other in drew if other != name)
        if not inner and (name or "<model>") not in known:
            reason = "draws random numbers in its forward, so each micro-batch draws others"
            found.append(
                NonAdditiveModule(name or "<model>", kind, f"{reason} than the full batch")
            )
    if last is None or rng_advanced(last, devices, generators):
        found.append(RANDOM_DRAWS)


_GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def loss_generators(loss_fn: object, depth: int = 2) -> list[Any]:
    """The generators `loss_fn` draws from by name: negative sampling with its own generator.

    Read from its closure, its default arguments, the globals its code names (and, `depth`
    deep, those of the functions it names there), a `functools.partial`'s arguments and a
    callable object's (or a bound method's object's) attributes:
    torch, NumPy (`default_rng()`, `RandomState`) and Python (`random.Random`) generators. The
    global ones are forked by `check_equivalence` anyway; these were not, so its second pass drew
    other numbers than its first and the gap was blamed on the loss.
    """
    found: dict[int, Any] = {}

    def visit(fn: object, left: int) -> None:
        values: list[object] = []
        while isinstance(fn, partial):
            values += [*fn.args, *fn.keywords.values()]
            fn = fn.func
        code = getattr(fn, "__code__", None)
        if code is not None:
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    values.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
            values += [*(getattr(fn, "__defaults__", None) or ())]  # `def f(m, b, rng=rng)`
            values += [*(getattr(fn, "__kwdefaults__", None) or {}).values()]
            owner = getattr(fn, "__self__", None)  # a bound method: its object's `self.rng`
            values += list(getattr(owner, "__dict__", {}).values()) if owner is not None else []
            names = getattr(fn, "__globals__", {})
            values += [names[name] for name in code.co_names if name in names]
        elif not isinstance(fn, type):  # a callable object: what it holds
            values += list(getattr(fn, "__dict__", {}).values())
        for value in values:
            if isinstance(value, _GENERATORS):
                found.setdefault(id(value), value)
            elif left > 1 and callable(value) and hasattr(value, "__code__"):
                visit(value, left - 1)

    visit(loss_fn, depth)
    return list(found.values())


def _state(generator: Any) -> Any:
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, np.random.Generator):
        return copy.deepcopy(generator.bit_generator.state)
    if isinstance(generator, np.random.RandomState):
        return generator.get_state()
    return generator.getstate()


def _differ(now: Any, then: Any) -> bool:
    if isinstance(now, torch.Tensor):  # pickling a tensor is not byte-stable
        return not torch.equal(now, then)
    return pickle.dumps(now) != pickle.dumps(then)  # NumPy states hold arrays


def _set_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.setstate(state)


@contextmanager
def generators_forked(generators: Sequence[Any], drew: list[bool] | None = None) -> Iterator[None]:
    """`generators` put back as they were when the block exits; `drew` told if any advanced."""
    states = [_state(generator) for generator in generators]
    try:
        yield
    finally:
        if drew is not None:
            now = [_state(generator) for generator in generators]
            drew.append(any(map(_differ, now, states)))
        for generator, state in zip(generators, states, strict=True):
            _set_state(generator, state)
