"""Test-only: a training run sends itself signals at an exact position, to stop it there.

With `GRADACCUM_TEST_SIGNAL_AT=STEP:MICRO:SIG[+SIG]` in the environment (`SIG` one of TERM, INT,
KILL), a run patched by `install` sends itself those signals when it reaches STEP optimizer steps
and MICRO micro-batches of the next window: a stop lands mid-window deterministically. The patch
lives here, not in the library: `tests/cli/conftest.py` installs it for in-process calls of
`gradaccum.cli.main`, and `python -m tests.cli.signal_at ARGS...` runs `gradaccum ARGS...` with it.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from gradaccum.experiments.runner import Position, TrainingRun

HOOK = "GRADACCUM_TEST_SIGNAL_AT"
_ORIGINAL_RUN = TrainingRun.run


def _run_with_signals(self: TrainingRun, *, stop: Any = None, **kwargs: Any) -> Any:
    text = os.environ.get(HOOK)
    if not text:
        return _ORIGINAL_RUN(self, stop=stop, **kwargs)
    step, micro, names = text.split(":")
    signals = [signal.Signals[f"SIG{name}"] for name in names.split("+")]

    def stop_at(position: Position) -> bool:
        if (position.step, position.micro) == (int(step), int(micro)):
            for number in signals:
                os.kill(os.getpid(), number)
        return bool(stop(position)) if stop is not None else False

    return _ORIGINAL_RUN(self, stop=stop_at, **kwargs)


def install() -> None:
    """Patch `TrainingRun.run` to honour `GRADACCUM_TEST_SIGNAL_AT` (a no-op without it)."""
    TrainingRun.run = _run_with_signals  # type: ignore[method-assign]


if __name__ == "__main__":
    from gradaccum.cli import main

    install()
    sys.exit(main(sys.argv[1:]))
