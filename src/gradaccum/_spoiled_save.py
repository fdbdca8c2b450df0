"""An open window changed since its last micro-batch is not saved: a resume would step it.

Between two `micro_step()` calls a loop may spoil the open window: an `optimizer.zero_grad()`
drops its gradients, a `model.load_state_dict(best)` (early stopping that restores the best
weights after a `break`) writes the weights its micro-batches ran at. The next `micro_step()` or
`flush()` refuses such a window (`Window.touched_gradients_error`). A checkpoint taken in between
did not look: it saved the spoiled window, and the resumed run stepped it silently (the earlier
micro-batches' gradients dropped, or taken at other weights: 1e-2 off the full-batch step). The
same check now runs when the state is saved (`Accumulator.state_dict()`, `save_checkpoint`),
with the norm pass of a window's last micro-batch (once per save); nothing is saved or changed.

Example:
    >>> import torch
    >>> from gradaccum import Accumulator
    >>> model = torch.nn.Linear(2, 1)
    >>> acc = Accumulator(model, torch.optim.SGD(model.parameters()), accumulation_steps=2)
    >>> _ = acc.micro_step(torch.ones(3, 2), lambda m, b: m(b).square().mean())
    >>> model.zero_grad()
    >>> try:
    ...     acc.state_dict()
    ... except RuntimeError as error:
    ...     "flush('drop')" in str(error)
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradaccum.window import Window

__all__ = ["refuse_spoiled_save"]

# What the refusals at a micro_step() say about the window; at a save it is kept.
_DISCARDED = (
    " The window was discarded; the weights are as written.",
    " This window was discarded; the other one is refused at its next micro_step().",
    " The window was discarded.",
)


def refuse_spoiled_save(window: Window, names: dict[int, str]) -> None:
    """Raise RuntimeError if the open `window` changed since its last micro-batch; change nothing.

    Args:
        window: The engine's window.
        names: Parameter names by `id`, for the message.

    Raises:
        RuntimeError: Naming what changed and the fix (`acc.flush('drop')`, then save).
    """
    if not window.is_open or not window.micro_batches:
        return
    problem = window.touched_gradients_error(names, final=True)
    if problem is None:
        return
    said = str(problem)
    for discarded in _DISCARDED:
        said = said.replace(discarded, "")
    raise RuntimeError(
        f"the Accumulator's open window ({window.micro_batches} micro-batches) was not saved: it "
        "changed after its last micro_step(), so a run resumed from it would step it silently. "
        f"{said} Nothing was saved and nothing changed (the window's next micro_step() or flush() "
        "refuses it). Call acc.flush('drop') to discard the window, then save; early stopping "
        "that restores the best weights: acc.flush('drop') before model.load_state_dict(best), "
        "or save the weights alone, save_checkpoint(path, model=model)."
    ) from None
