"""pytest: collect this package's doctests only where Keras 3 is installed."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("keras") else ["*.py"]
