"""Decoding on the draft cache alone (``VeriCacheEngine.lossy``) and the helpers that compare outputs."""

from __future__ import annotations

import pytest
from engine_helpers import random_prompts

from lmcache_vericache.engine import VeriCacheEngine
from lmcache_vericache.engine.lossy import first_divergence, loops


def test_a_lossless_draft_cache_alone_decodes_what_the_full_kv_does(tiny_model, one_thread):
    # "none" keeps the KV exact: the draft cache alone must give full-KV greedy token for token,
    # for prompts of different lengths in one batch, and again once the store holds their chunks
    # (the prefix then comes from the store and the tail is fed over the draft cache).
    prompts = random_prompts(2, [200, 131])
    with VeriCacheEngine(tiny_model, "none", chunk_size=64, eos_ids=set()) as eng:
        ref = [r.tokens for r in eng.reference(prompts, 24)]
        assert [r.tokens for r in eng.lossy(prompts, 24)] == ref
        assert eng.store.stats.puts > 0
        assert [r.tokens for r in eng.lossy(prompts, 24)] == ref
        assert all(len(t) == 24 for t in ref)


def test_a_lossy_draft_cache_alone_drifts_from_full_kv_greedy(tiny_model, one_thread):
    [prompt] = random_prompts(1, [256])
    eng = VeriCacheEngine(tiny_model, "streamingllm", {"keep_ratio": 0.25}, chunk_size=64, store="resident")
    [ref] = eng.reference([prompt], 48)
    steps = []
    [lossy] = eng.lossy([prompt], 48, on_step=steps.append)
    assert steps == list(range(1, 49))
    assert lossy.tokens[0] == ref.tokens[0]  # the first token comes from the exact prefill
    assert first_divergence(lossy.tokens, ref.tokens) is not None
    [vc] = eng.generate([prompt], 48)
    assert vc.tokens == ref.tokens


def test_first_divergence_and_loops():
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) is None
    assert loops([5, 6, 7, 8] + [1, 2, 3] * 6)
    assert not loops(list(range(40)))


@pytest.mark.parametrize("n", [0, 1])
def test_loops_of_very_short_outputs_is_false(n):
    assert not loops(list(range(n)))
