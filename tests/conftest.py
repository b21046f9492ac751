"""Shared fixtures: the real model (loaded once per session), the tiny random Llama, and real
Redis / Redis Cluster / LMCache ``lm://`` servers (``lmcache_vericache.testing.fixtures``)."""

from __future__ import annotations

import os

import pytest
import torch

from lmcache_vericache.testing.fixtures import (  # noqa: F401
    lm_server,
    redis_cluster,
    redis_server,
    redis_server_factory,
    shared_redis_cluster,
)


def pytest_configure(config):
    # Under pytest-xdist (`make test` runs the quick suite on two workers) each worker computes on
    # one core: two workers of two threads each on a 2-core machine spin against each other.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


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
