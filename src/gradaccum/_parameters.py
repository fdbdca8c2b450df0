"""Which parameters a window accumulates into: the optimizer's first, then the model's others.

Kept apart from `gradaccum.window` (which re-exports both) so that the window stays small.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable

import torch

from gradaccum._structure import StructureWatch
from gradaccum._window_registry import busy_error

__all__ = ["ModelParameters", "trainable_parameters", "window_parameters"]

_SHAPE = operator.attrgetter("shape")
_PARAMS, _REQUIRES_GRAD = operator.itemgetter("params"), operator.attrgetter("requires_grad")


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's parameters that require grad, each once, in registration order.

    Raises:
        ValueError: If the model has no trainable parameter.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no parameter with requires_grad=True; there is nothing "
            "to accumulate. Unfreeze at least one parameter."
        )
    return params


def window_parameters(
    model_params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> tuple[list[torch.nn.Parameter], int]:
    """The parameters a window accumulates into, and how many of them (first) the optimizer holds.

    Read when a window opens, not once at construction: a parameter unfrozen or an optimizer
    group added between windows takes part in the next one.

    Args:
        model_params: The model's parameters (`model.parameters()`, or a list of them).
        optimizer: The optimizer, whose parameters come first, in its order.
    """
    every = list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
    params = list(itertools.compress(every, map(_REQUIRES_GRAD, every)))  # C-level passes
    seen = set(map(id, params))
    if len(seen) < len(params):  # a parameter in two groups: keep its first place
        params = list({id(p): p for p in params}.values())
    held = len(params)
    model_params = list(model_params)
    trainable = list(itertools.compress(model_params, map(_REQUIRES_GRAD, model_params)))
    if seen.issuperset(map(id, trainable)):  # the usual case: the optimizer holds them all
        return params, held
    for param in trainable:
        if id(param) not in seen:
            seen.add(id(param))
            params.append(param)
    return params, held


class ModelParameters:
    """The model's parameters and their names, as the windows read them, watched for resizes.

    They are read once (walking the modules each window would cost time), so a parameter that
    changes shape afterwards is noticed when a window opens or a streamed micro-batch comes:
    `resize_token_embeddings` swaps the embedding's data in place, and replaces an untied output
    embedding by a new parameter. The optimizer's state and the open window's gradients are of
    the old shape, so the optimizer would fail halfway through its step, and a replaced
    parameter the optimizer does not hold would silently not train: both are refused first.

    Args:
        model: The model whose parameters the windows accumulate into.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self.names: dict[int, str] = {}  # refreshed in place: the engine holds this dict
        self.params: list[torch.nn.Parameter] = []
        self._read()
        self._structure = StructureWatch(self._ids)  # a head set after building: read again

    def _ids(self) -> tuple[int, ...]:
        return tuple(map(id, self._model.parameters()))

    def _read(self) -> None:
        self.names.clear()
        self.names.update({id(p): n for n, p in self._model.named_parameters()})
        self.params = list(self._model.parameters())
        self._shapes = [p.shape for p in self.params]

    def _resized(self) -> list[tuple[torch.nn.Parameter, torch.Size]]:
        if list(map(_SHAPE, self.params)) == self._shapes:  # the usual case, in C-level passes
            return []
        return [(p, s) for p, s in zip(self.params, self._shapes, strict=True) if p.shape != s]

    def resize_error(self) -> ValueError | None:
        """The error for an open window whose parameters changed shape since it opened, if any.

        The caller discards the window and raises it.
        """
        resized = self._resized()
        if resized:
            return ValueError(
                f"{_described(resized, self.names)} changed shape in the middle of an "
                "accumulation window: its earlier micro-batches ran the model before the change "
                f"(their gradients are of the old shape). {_FIX} The window was discarded."
            )
        return None

    def for_window(
        self, optimizer: torch.optim.Optimizer, *, loading: bool = False
    ) -> tuple[list[torch.nn.Parameter], int]:
        """`window_parameters` for a window about to open, after checking for resizes.

        `loading`: for a state about to be loaded, with the optimizer's (`load_checkpoint`
        loads the accumulator first): the optimizer's present state is not checked.

        Raises:
            ValueError: If a parameter changed shape and the optimizer holds state of its old
                shape, or new parameters replaced it that the optimizer does not hold; nothing
                has changed.
            RuntimeError: If another Accumulator's open window holds gradients of the
                parameters (`busy_error`); nothing has changed.
        """
        resized = self._resized()
        if resized:
            names = self.names
            stale = [] if loading else [(p, s) for p, s in resized if _old_state(optimizer, p, s)]
            if stale:
                raise ValueError(
                    f"{_described(stale, names)} changed shape since this Accumulator was "
                    f"built, but the optimizer holds state (e.g. Adam's moments) of the old "
                    f"shape: its step would fail halfway. {_FIX}"
                )
            old = set(map(id, self.params))
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            fresh = dict(self._model.named_parameters())
            orphans = [n for n, p in fresh.items() if p.requires_grad and id(p) not in old | held]
            if orphans:
                raise ValueError(
                    f"{_described(resized, names)} changed shape since this Accumulator was "
                    f"built, and new parameters replaced others ({', '.join(orphans[:3])}) "
                    f"that the optimizer does not hold: they would not train. {_FIX}"
                )
            self._read()
        if (ids := self._structure.look()) is not None:  # modules set since: read them
            self._read()
        params, optimizers = window_parameters(self.params, optimizer)
        if ids is not None and not loading:
            _refuse_replaced(params[:optimizers], self.names, optimizer)
            self._structure.settle(ids)
        if not loading and (busy := busy_error(params, self.names)) is not None:
            raise busy  # another Accumulator's open window holds gradients of these
        return params, optimizers


def _refuse_replaced(
    held: list[torch.nn.Parameter], names: dict[int, str], optimizer: torch.optim.Optimizer
) -> None:
    """Refuse an optimizer left holding only parameters the model no longer has.

    A head replaced after the optimizer was built over it alone (`model.fc = nn.Linear(...)`,
    the backbone frozen): the window would run, no parameter of it would get a gradient.
    """
    if not held or any(id(p) in names for p in held):
        return
    raise ValueError(
        f"the {type(optimizer).__name__} holds none of the model's parameters any more: modules "
        "were set on the model after the optimizer was built (a replaced head, model.fc = "
        "nn.Linear(...)), and it holds the replaced ones. Build an optimizer over the model as "
        "it is now and give it to the Accumulator between windows, acc.optimizer = "
        "torch.optim.AdamW(model.fc.parameters()) (acc.scheduler = a schedule built on it), "
        "or add the new parameters: acc.optimizer.add_param_group({'params': "
        "model.fc.parameters()}). Nothing was changed."
    )


_FIX = (
    "Resize (resize_token_embeddings) before building the optimizer and the Accumulator; to "
    "resize during training, build a new optimizer and Accumulator afterwards."
)


def _old_state(
    optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, shape: torch.Size
) -> bool:
    """Whether the optimizer keeps a tensor of `shape` (the old one) for `param` (Adam's moments).

    A state loaded since for the new shape (a checkpoint of the resized model) is not stale.
    """
    state = optimizer.state.get(param, {})
    return any(isinstance(v, torch.Tensor) and v.shape == shape for v in state.values())


def _described(resized: list[tuple[torch.nn.Parameter, torch.Size]], names: dict[int, str]) -> str:
    parts = [
        f"{names.get(id(p), '<unnamed>')} ({tuple(s)} -> {tuple(p.shape)})" for p, s in resized
    ]
    more = f" and {len(parts) - 3} more" if len(parts) > 3 else ""
    return f"parameter{'s' if len(parts) > 1 else ''} {', '.join(parts[:3])}{more}"
