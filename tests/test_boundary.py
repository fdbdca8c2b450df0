"""`gradaccum._boundary`: what the window boundary reads from the components."""

from __future__ import annotations

import torch

from gradaccum._boundary import nonfinite_names
from gradaccum.options import Precision
from gradaccum.precision import PrecisionRuntime
from gradaccum.window import Window


def _window(grad: torch.Tensor | None, loss: float) -> tuple[Window, PrecisionRuntime]:
    """A one-parameter window after one micro-batch of loss `loss` that left `grad`."""
    param = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    window, runtime = Window(), PrecisionRuntime(Precision.FP32, [param], accum_dtype=None)
    window.open([param], 1, loss_scale=1.0)
    runtime.open_window(1)
    param.grad = grad
    window.add(torch.tensor(loss, dtype=torch.float64), 1, 1, 1)
    return window, runtime


def test_nonfinite_names_name_the_gradient_and_otherwise_say_where_the_nan_came_from() -> None:
    window, runtime = _window(torch.tensor([1.0, float("nan")], dtype=torch.float64), 1.0)
    names = {id(window.params[0]): "net.weight"}
    assert nonfinite_names(window, runtime, names, world=2) == ("net.weight",)
    # One process, finite gradients: only the loss can be what was non-finite.
    window, runtime = _window(torch.ones(2, dtype=torch.float64), float("inf"))
    assert nonfinite_names(window, runtime, {}) == ("<none: the loss itself is non-finite>",)
    # Several ranks, this rank's loss and gradients finite: another rank's were not (the ranks
    # skip together, before the gradients are reduced); it used to blame this rank's loss.
    window, runtime = _window(torch.ones(2, dtype=torch.float64), 1.0)
    assert nonfinite_names(window, runtime, {}, world=2) == (
        "<none on this rank: another rank's loss or gradients are non-finite>",
    )
    window, runtime = _window(torch.ones(2, dtype=torch.float64), float("nan"))
    assert nonfinite_names(window, runtime, {}, world=2) == (
        "<none: the loss itself is non-finite>",
    )
    # One process, loss and gradients finite: the norm overflowed (it blamed the loss before).
    window, runtime = _window(torch.ones(2, dtype=torch.float64), 1.0)
    assert nonfinite_names(window, runtime, {}) == (
        "<none: every gradient is finite, their total 2-norm overflows float32>",
    )
