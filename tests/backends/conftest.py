"""Shared fixtures of the store tests: real Redis servers (tests/servers.py) and KV chunks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

try:
    from tests.servers import lm_server, redis_server, redis_server_factory  # noqa: F401
except ImportError:
    # cufile-python installs a top-level ``tests`` package into site-packages, which wins over this
    # repository's ``tests`` namespace package; load tests/servers.py by path instead.
    _spec = importlib.util.spec_from_file_location("tests.servers", Path(__file__).parents[1] / "servers.py")
    _servers = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
    sys.modules["tests.servers"] = _servers
    _spec.loader.exec_module(_servers)  # type: ignore[union-attr]
    lm_server, redis_server, redis_server_factory = _servers.lm_server, _servers.redis_server, _servers.redis_server_factory

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
