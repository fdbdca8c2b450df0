"""Without Keras, `import gradaccum(.keras)` works and the first use says how to install it."""

from __future__ import annotations

import subprocess
import sys


def test_gradaccum_keras_without_keras_names_the_extra():
    code = (
        "import sys\n"
        "sys.modules['keras'] = None  # as if keras were not installed\n"
        "import gradaccum, gradaccum.keras\n"
        "try:\n"
        "    from gradaccum.keras import accumulate\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install 'gradaccum[keras]'" in done.stdout
