"""Command-line test fixtures: the test-only signal hook of `tests.cli.signal_at`, in-process.

Session-wide, so module-scoped fixtures that train in-process get it too; it does nothing unless
`GRADACCUM_TEST_SIGNAL_AT` is set.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gradaccum.experiments.runner import TrainingRun
from tests.cli import signal_at


@pytest.fixture(autouse=True, scope="session")
def _signal_hook() -> Iterator[None]:
    original = TrainingRun.run
    signal_at.install()
    yield
    TrainingRun.run = original  # type: ignore[method-assign]
