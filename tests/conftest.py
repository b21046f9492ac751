"""Shared fixtures: the real model (loaded once per session), the tiny random Llama, and real
Redis / LMCache ``lm://`` servers (tests/servers.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

# cufile-python installs a top-level ``tests`` package into site-packages, which wins over this
# repository's ``tests`` namespace package: register tests/servers.py under its name by path, once,
# so test modules can ``from tests.servers import ...`` and every directory sees its fixtures.
if "tests.servers" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("tests.servers", Path(__file__).parent / "servers.py")
    sys.modules["tests.servers"] = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
    _spec.loader.exec_module(sys.modules["tests.servers"])  # type: ignore[union-attr]
from tests.servers import lm_server, redis_server, redis_server_factory  # noqa: E402,F401


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct, fp32, eval mode, CPU."""
    from lmcache_vericache.models import load_model

    return load_model("smollm2", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model():
    """Random-weight 2-layer Llama (``tiny_llama(seed=0)``), fp32, eval mode."""
    from lmcache_vericache.models import tiny_llama

    return tiny_llama(seed=0)
