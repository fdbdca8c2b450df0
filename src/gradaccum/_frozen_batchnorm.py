"""`batchnorm="frozen"`: eval-mode BatchNorm for one micro-batch, whatever `loss_fn` switches.

A loss_fn that calls `model.train()` (a common defensive habit) would switch the frozen layers
back to batch statistics and running updates mid-window. Their `train()` is replaced for the
micro-batch by one that only records the mode asked for, set when the micro-batch is over, so
the `training` flag stays False throughout. Dynamo guards on that flag but not on module hooks:
a `torch.compile` graph traced without a hook (a plain step earlier in the process, even of
another instance of the class) would never run it, so the flag itself must stay frozen. A
forward pre-hook still freezes code that sets `.training` itself.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

__all__ = ["frozen"]


class _RecordedTrain:
    """A frozen layer's `train(mode)`: records `mode` in `asked[index]` and changes nothing."""

    def __init__(self, module: nn.Module, asked: list[bool | None], index: int) -> None:
        self.module, self.asked, self.index = module, asked, index

    def __call__(self, mode: bool = True) -> nn.Module:
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")  # as nn.Module.train
        self.asked[self.index] = mode
        return self.module

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # A copy made mid-micro-batch (an EMA teacher) is not frozen: its train() is the usual.
        twin = memo.get(id(self.module))
        if twin is None:
            twin = copy.deepcopy(self.module, memo)
        return types.MethodType(type(self.module).train, twin)


def _to_eval(module: nn.Module, args: tuple[Any, ...]) -> None:
    module.training = False  # code that set the flag itself: running statistics all the same


@contextlib.contextmanager
def frozen(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Run the body with every module in `modules` in eval mode; then the mode last asked for."""
    was = [m.training for m in modules]
    asked: list[bool | None] = [None] * len(modules)  # the last mode loss_fn asked for, if any
    for index, module in enumerate(modules):
        module.train(False)
        module.train = _RecordedTrain(module, asked, index)  # type: ignore[method-assign]
    handles = [m.register_forward_pre_hook(_to_eval) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, training, mode in zip(modules, was, asked, strict=True):
            del module.train  # the class's own method again, which sets the mode asked for
            if mode is None:
                module.training = training
            else:
                module.train(mode)
