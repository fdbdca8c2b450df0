"""pytest: collect this package's doctests only where Keras 3 is installed.

They run in the test process itself, on Keras's torch backend unless KERAS_BACKEND says otherwise:
torch is loaded there already, so TensorFlow is not imported into the whole test session. (The
backends are tested one per subprocess by tests/integrations/test_keras.py.)
"""

from __future__ import annotations

import importlib.util
import os
import sys

collect_ignore_glob = [] if importlib.util.find_spec("keras") else ["*.py"]
if "keras" not in sys.modules:
    os.environ.setdefault("KERAS_BACKEND", "torch")
