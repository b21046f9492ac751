"""Engine test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def reference_cache():
    """Plain full-KV greedy decodes, computed once per (prompts, length) for all compressors."""
    return {}


@pytest.fixture
def one_thread():
    """Tiny-model tests are dominated by per-op overhead; thread spin-up on a shared 2-core box makes
    them 20x slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
