"""Shared fixtures of the store tests: KV chunks (the Redis and lm:// server fixtures are in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

HEADS, HEAD_DIM, LAYERS, TOKENS = 3, 8, 2, 16


def make_chunk(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, TOKENS, HEADS * HEAD_DIM, generator=g).to(dtype)


@pytest.fixture
def chunks() -> list[torch.Tensor]:
    return [make_chunk(i) for i in range(6)]


@pytest.fixture
def nixl_tier_cls():
    pytest.importorskip("nixl_cu12", reason="nixl-cu12 not installed (optional extra 'nixl')")
    from lmcache_vericache.backends.tiers.nixl import NixlTier

    return NixlTier
