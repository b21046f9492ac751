"""Admission: a request's set-up time (``stats.prefill_s``, which decode rates exclude) covers all of
setting it up, its cache's allocation included, for draft/verify and reference requests alike."""

from __future__ import annotations

import time

import pytest
from engine_helpers import random_prompts

from lmcache_vericache.engine import Runtime, VeriCacheEngine

pytestmark = pytest.mark.usefixtures("one_thread")
DELAY = 0.3


def test_setup_time_counts_the_cache_allocation(tiny_model, monkeypatch):
    # A zeroed 8k SmolLM2 cache takes 0.1-0.25 s to allocate; a tiny model's takes nothing, so the
    # real allocation is slowed by a fixed delay to see on which side of the clock it falls.
    new_cache = Runtime.new_cache

    def slow_new_cache(self, capacity):
        if capacity:  # the full cache (a draft cache starts at capacity 0)
            time.sleep(DELAY)
        return new_cache(self, capacity)

    monkeypatch.setattr(Runtime, "new_cache", slow_new_cache)
    prompts = random_prompts(2, [300, 200])
    eng = VeriCacheEngine(tiny_model, "streamingllm", {"keep_ratio": 0.25}, chunk_size=64, draft_len=4)
    for out in (eng.generate(prompts, 8), eng.reference(prompts, 8)):
        assert all(o.stats.prefill_s >= DELAY for o in out)
