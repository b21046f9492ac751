"""Engine test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def reference_cache():
    """Plain full-KV greedy decodes, computed once per (prompts, length) for all compressors."""
    return {}
