"""How often a training run writes its checkpoint: `--checkpoint-every N|Nstep|Nmicro`."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CheckpointEvery"]

_EVERY_PATTERN = re.compile(r"(\d+)\s*(step|steps|micro)?")


@dataclass(frozen=True)
class CheckpointEvery:
    """How often a run writes `checkpoint.pt`: every `count` optimizer steps or micro-batches."""

    count: int
    unit: str  # "step" or "micro"

    @classmethod
    def parse(cls, text: str) -> CheckpointEvery:
        """Read `N` or `Nstep` (optimizer steps) or `Nmicro` (micro-batches), N >= 1.

        Raises:
            ValueError: If `text` is none of these.
        """
        match = _EVERY_PATTERN.fullmatch(text.strip())
        if match is None or int(match.group(1)) < 1:
            raise ValueError(
                f"{text!r} is not N, Nstep or Nmicro with N >= 1 (e.g. 100 = every 100 optimizer "
                "steps, 40micro = every 40 micro-batches)"
            )
        unit = "micro" if match.group(2) == "micro" else "step"
        return cls(int(match.group(1)), unit)

    def due(self, *, micro_batches: int, step: int, window_ended: bool) -> bool:
        """Whether a checkpoint is due after a micro-batch.

        Args:
            micro_batches: Micro-batches run since the start of the run.
            step: Optimizer steps (windows) completed.
            window_ended: The micro-batch ended a window.
        """
        if self.unit == "micro":
            return micro_batches % self.count == 0
        return window_ended and step % self.count == 0

    def __str__(self) -> str:
        return f"{self.count}{self.unit}"

    def __repr__(self) -> str:
        return f"CheckpointEvery('{self}')"
