"""`import_transformers()`: transformers for a test module, or a skip saying why it cannot run."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def import_transformers() -> Any:
    """The `transformers` module; skips the calling module without the [hf] extra or a usable torch.

    transformers 5 needs torch >= 2.6: on older torch (gradaccum supports 2.4) it imports, but
    without its models ("PyTorch was not found").
    """
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    if not transformers.utils.is_torch_available():
        pytest.skip(
            f"transformers {transformers.__version__} cannot use torch {torch.__version__} "
            "(transformers 5 needs torch >= 2.6)",
            allow_module_level=True,
        )
    return transformers
