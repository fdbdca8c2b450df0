"""The length a fixed-length schedule needs: what `OneCycleLR(total_steps=...)` should count.

The Accumulator steps its scheduler once per optimizer step, and a streamed epoch takes as many
as its windows: `math.ceil(len(loader) / k)` when `flush()` steps the shorter last window,
`len(loader) // k` when it drops it, and over the whole run `math.ceil(epochs * len(loader) / k)`
when it carries it. A schedule counted another way (per micro-batch, or with the floor under
`"step"`) runs out before the data: torch's `OneCycleLR` then raises "Tried to step N times",
which the Accumulator raises before any change (`gradaccum._commit.try_scheduler`). The
Accumulator adds a note to that error naming the formula for its own settings.

Example:
    >>> import torch
    >>> from gradaccum import Accumulator
    >>> model = torch.nn.Linear(2, 1)
    >>> acc = Accumulator(model, torch.optim.SGD(model.parameters()), accumulation_steps=4)
    >>> "total_steps=epochs * math.ceil(len(loader) / 4) optimizer steps" in _hint(acc)
    True
"""

from __future__ import annotations

from typing import Any

from gradaccum.options import PartialWindow, Tokens

__all__ = ["length_noted", "runs_out"]


def runs_out(scheduler: Any) -> bool:
    """Whether `scheduler` (or one it chains) has a fixed number of steps it cannot go past."""
    inner = getattr(scheduler, "_schedulers", ())
    return hasattr(scheduler, "total_steps") or any(map(runs_out, inner))


class length_noted:  # noqa: N801  (a context manager used like a function)
    """Around a window's close: a schedule that ran out at its try gets the run's length noted.

    A class, not a generator: it runs once per window.
    """

    __slots__ = ("acc", "scheduler")

    def __init__(self, acc: Any, scheduler: Any) -> None:
        self.acc, self.scheduler = acc, scheduler

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:  # the error goes on
        notes = getattr(error, "__notes__", ())
        if any("tried before optimizer.step()" in n for n in notes) and runs_out(self.scheduler):
            error.add_note(f"gradaccum: {_hint(self.acc)}")


def _hint(acc: Any) -> str:
    steps, mode = acc.accumulation_steps, acc.partial_window
    said = [
        "The Accumulator steps the scheduler once per optimizer step it takes, never per "
        "micro-batch or per call; count those steps."
    ]
    if isinstance(steps, Tokens):
        said.append(
            f"With accumulation_steps={steps!r} a window closes on its items' count, so the "
            "number of steps follows the data: count result.stepped over a first epoch, or "
            "stop the loop at the schedule's total_steps."
        )
    elif steps is not None:
        k = steps
        formula = {
            PartialWindow.STEP: f"epochs * math.ceil(len(loader) / {k})",
            PartialWindow.DROP: f"epochs * (len(loader) // {k})",
            PartialWindow.CARRY: f"math.ceil(epochs * len(loader) / {k})",
        }[mode]
        why = {
            PartialWindow.STEP: "each epoch's flush() steps its shorter last window",
            PartialWindow.DROP: "each epoch's flush() drops its last micro-batches",
            PartialWindow.CARRY: "windows run on across epochs, the last settled by flush('step')",
        }[mode]
        said.append(
            f"With micro_step(), accumulation_steps={k} and partial_window='{mode.value}' "
            f"({why}), the run takes total_steps={formula} optimizer steps, len(loader) "
            "counting micro-batches: size the schedule for them (in a SequentialLR, the last "
            "schedule for what its milestones leave)."
        )
    if acc.micro_batch_size is not None:
        said.append(
            "With step(), one step per call: total_steps=epochs * len(loader) optimizer "
            "steps, the loader yielding whole batches."
        )
    return " ".join(said)
