"""Parameters that join the optimizer's trainable set in the middle of a window.

A window steps the parameters the optimizer held with `requires_grad=True` when it opened (see
`gradaccum._parameters.window_parameters`). One unfrozen, or added by `add_param_group`, between two
`micro_step()` calls gets a gradient from the window's later micro-batches only, and the
boundary never divides, clips, checks or (fp16) unscales it: `optimizer.step()` would move it by
a partial, loss-scaled sum. `JoinWatch` puts such gradients back as they were before the window,
just before the step, so the step is the full-batch one with the newcomer still out; it takes
part from the next window.

Example:
    >>> import torch
    >>> frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    >>> watch = JoinWatch(torch.optim.SGD([frozen], lr=0.1))
    >>> watch.open([])
    >>> frozen.requires_grad_(True).grad = torch.ones(2)  # unfrozen, then a backward
    >>> [tuple(p.shape) for p in watch.drop()], frozen.grad
    ([(2,)], None)
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from operator import is_, is_not

import torch

from gradaccum._warnings import warn_user

__all__ = ["JoinWatch", "warn_joined", "warn_left_out"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")
_PARAMS = operator.itemgetter("params")
_NONE = itertools.repeat(None)


class JoinWatch:
    """Notices the optimizer's parameters that start to require grad after a window opened.

    Both looks at the param groups are C-level `map`s over them (no Python frame per
    parameter) unless a parameter is frozen or joined.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer | None, model: torch.nn.Module | None = None
    ) -> None:
        self._optimizer, self._model = optimizer, model
        # The model's trainable parameters outside the optimizer when it was given: warned of
        # then (`_checks.check_optimizer`), or left out on purpose. Others are `left_out`.
        self._outside: set[int] | None = None
        if optimizer is not None and model is not None:
            held = set(map(id, self._every()))
            self._outside = {id(p) for p in model.parameters() if p.requires_grad} - held
        self._held: list[torch.nn.Parameter] = []
        self._aside: dict[int, torch.Tensor] = {}  # frozen parameters' own gradients
        self._armed = False

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose param groups are watched (the Accumulator's)."""
        return self._optimizer

    def open(self, held: Sequence[torch.nn.Parameter]) -> None:
        """Remember the window's own parameters (`held`: the optimizer's trainable ones).

        A frozen parameter that holds a gradient (left from before it was frozen) has it set
        aside, so that a backward after an unfreeze cannot add into it in place.
        """
        if self._optimizer is None:
            return
        self.drop()  # a window replaced by a loaded one: give back what it set aside
        self._held, self._aside = list(held), {}
        every = self._every()
        if len(every) != len(held):  # some are frozen
            frozen = list(itertools.filterfalse(_REQUIRES_GRAD, every))
            for param in itertools.compress(frozen, map(is_not, map(_GRAD, frozen), _NONE)):
                assert param.grad is not None  # `compress` kept those holding one
                self._aside[id(param)], param.grad = param.grad, None
        self._armed = True

    def drop(self) -> list[torch.nn.Parameter]:
        """Put back the gradients the window's newcomers hold; return those that got one.

        Frozen parameters get back the gradient set aside (still frozen or not); runs once per
        window (the boundary, or the window's end if it never got there).
        """
        if not self._armed or self._optimizer is None:
            return []
        self._armed = False
        every = self._every()
        trainable = list(itertools.compress(every, map(_REQUIRES_GRAD, every)))
        if len(trainable) == len(self._held) and all(map(is_, trainable, self._held)):
            newcomers: list[torch.nn.Parameter] = []  # the usual case: nobody joined
        else:
            inside = set(map(id, self._held))
            newcomers = [param for param in trainable if id(param) not in inside]
        joined = [param for param in newcomers if param.grad is not None]
        for param in newcomers:
            param.grad = self._aside.pop(id(param), None)
        if self._aside:  # still frozen: their own gradient back
            for param in every:
                if id(param) in self._aside:
                    param.grad = self._aside[id(param)]
        self._aside = {}
        return joined

    def save_refusal(self, micro_batches: int) -> ValueError | None:
        """The refusal of a save of the open window after its trainable set changed, if it did.

        Parameters that joined sit the window out (`drop` at its step), ones frozen inside it
        are stepped with the gradient of its earlier micro-batches; a saved window records
        neither, so a resume (its parameters read as the model now stands) refuses the state
        (another count of shapes) or steps the joined ones with the window (its gradient, when
        they were in it as the model's others): not the step of the run saved.
        """
        if not self._armed or self._optimizer is None:
            return None
        every = self._every()
        inside = set(map(id, self._held))
        joined = [p for p in itertools.compress(every, map(_REQUIRES_GRAD, every))]
        joined = [p for p in joined if id(p) not in inside]
        frozen = list(itertools.filterfalse(_REQUIRES_GRAD, self._held))
        if not joined and not frozen:
            return None
        names = {id(p): n for n, p in self._model.named_parameters()} if self._model else {}
        parts = []
        for changed, how in (
            (joined, "joined it (add_param_group, or unfrozen)"),
            (frozen, "were frozen"),
        ):
            if changed:
                shown = [names.get(id(p), f"<param of shape {tuple(p.shape)}>") for p in changed]
                listed = ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "")
                parts.append(f"{len(changed)} parameters ({listed}) {how}")
        return ValueError(
            f"acc.state_dict() inside a window ({micro_batches} micro-batches so far) whose "
            f"trainable parameters changed after it opened: {'; '.join(parts)}. A saved window "
            "cannot record that (the joined sit it out, the frozen are stepped with its earlier "
            "micro-batches), so a resume would refuse the state or step another update. Save "
            "at a window boundary (after a result with stepped=True), or settle this window "
            "first with acc.flush('step') (or acc.flush('drop')) and save then; freeze, unfreeze "
            "and add_param_group between windows. Nothing was saved."
        )

    def left_out(self, others: Sequence[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """Of `others` (the window's parameters outside the optimizer), those newly left out.

        They hold a gradient at the boundary, were not trainable outside the optimizer when
        it was given (unfrozen since, or new) and are not in it now: the step clears their
        gradient unused. Found once; an empty list after that.
        """
        outside = self._outside
        if not others or outside is None:
            return []
        found = [p for p in others if p.grad is not None and id(p) not in outside]
        if found:
            held = set(map(id, self._every()))
            found = [p for p in found if id(p) not in held]
        if found:
            self._outside = None  # warned once
        return found

    def _every(self) -> list[torch.nn.Parameter]:
        assert self._optimizer is not None
        groups = self._optimizer.param_groups
        return list(itertools.chain.from_iterable(map(_PARAMS, groups)))


def warn_joined(joined: Sequence[torch.nn.Parameter], names: dict[int, str]) -> None:
    """Warn that `joined` (from `JoinWatch.drop`) sat out this window's step."""
    if not joined:
        return
    shown = [names.get(id(p), f"<optimizer param of shape {tuple(p.shape)}>") for p in joined]
    listed = ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "")
    warn_user(
        UserWarning(
            f"{len(joined)} parameters ({listed}) were unfrozen or added to the optimizer in the "
            "middle of an accumulation window: their gradient covers only its later micro-batches, "
            "so it was dropped and they were not stepped; they take part from the next window. "
            "Unfreeze or add_param_group() between windows (after a result with stepped=True) "
            "to include them in a whole window."
        )
    )


def warn_left_out(
    left_out: Sequence[torch.nn.Parameter], names: dict[int, str], optimizer: torch.optim.Optimizer
) -> None:
    """Warn that `left_out` (from `JoinWatch.left_out`) got gradients nothing steps."""
    if not left_out:
        return
    shown = [names.get(id(p), f"<parameter of shape {tuple(p.shape)}>") for p in left_out]
    listed = ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "")
    name = type(optimizer).__name__
    warn_user(
        UserWarning(
            f"{len(left_out)} trainable parameters of the model ({listed}) got gradients in this "
            f"window but are in no param group of the {name} the Accumulator steps (they "
            "started to require grad after it was given: unfrozen, or new), so their gradients "
            "were cleared unused and nothing trains them. If you built a new optimizer over "
            "them (opt = AdamW(model.parameters()) after unfreezing), give it to the "
            "Accumulator between windows: acc.optimizer = opt (and acc.scheduler = a schedule "
            "built on it); until then the old one steps alone. Or add them to the one it steps: "
            "acc.optimizer.add_param_group({'params': [...]}); or keep them frozen with "
            "requires_grad_(False)."
        )
    )
