"""Shared pytest fixtures: deterministic seeding and a per-test data generator.

Tiny models, data generators and loss functions live in `tests/models.py`; plain reference
training steps (no gradaccum) live in `tests/reference.py`.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

# The models under test are tiny: extra intra-op threads only add synchronization, and on a shared
# 2-core machine they can slow a test down many times over.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    """Seed Python, NumPy and torch before every test, so each test runs the same way alone."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def generator() -> torch.Generator:
    """A seeded CPU generator for a test's own data, independent of the global RNG."""
    return torch.Generator().manual_seed(1234)
