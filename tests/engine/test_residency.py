"""Residency modes on the tiny model: ``resident`` never swaps a prefix it computed and swaps a prefix
read from the store exactly once; ``offload`` keeps only draft caches, swaps the full prefix into a
pooled verify cache every round, and a KV budget admits more offloaded requests than full-KV ones.
Every variant is token-identical to full-KV decoding."""

from __future__ import annotations

import pytest
from engine_helpers import random_prompts

from lmcache_vericache import compressors as C
from lmcache_vericache.backends import DualTierStore, MemoryTier
from lmcache_vericache.engine import Runtime, VeriCacheEngine

pytestmark = pytest.mark.usefixtures("one_thread")
SL = ("streamingllm", {"keep_ratio": 0.25})


def _eng(model, **kw):
    return VeriCacheEngine(model, *SL, chunk_size=64, draft_len=6, **kw)


def _store(model):
    return DualTierStore(C.get(SL[0], **SL[1]), MemoryTier(1 << 30), num_kv_heads=Runtime(model).num_kv_heads)


def test_resident_computed_prompt_never_swaps(tiny_model):
    prompts = random_prompts(2, [300, 200])
    ref = _eng(tiny_model).reference(prompts, 40)
    eng = _eng(tiny_model, full_kv="resident")
    out = eng.generate(prompts, 40)
    assert [o.tokens for o in out] == [r.tokens for r in ref]
    assert eng.last_run["full_kv"] == "resident" and eng.last_run["verify_buffers"] == 0
    assert all(o.stats.rounds > 1 and o.stats.bytes_moved == 0 for o in out)
    assert eng.store.stats.puts == 4 + 3  # the prompts still went to the store, for sharing


def test_resident_swaps_a_stored_prefix_once(tiny_model):
    prompts = random_prompts(1, [300])
    ref = _eng(tiny_model).reference(prompts, 40)
    store = _store(tiny_model)
    _eng(tiny_model, store=store).generate(prompts, 5)
    [out] = _eng(tiny_model, store=store, full_kv="resident").generate(prompts, 40)
    assert out.tokens == ref[0].tokens and out.stats.cached_chunks == 4 and out.stats.rounds > 1
    # one swap of the 4 cached chunks (poisoned until then), not one per round
    assert out.stats.bytes_moved == 4 * 64 * Runtime(tiny_model).kv_bytes_per_token()


def test_reference_reads_a_stored_prefix_up_to_the_first_missing_chunk(tiny_model):
    """The full-KV baseline of a served prefix: ``reference(stored_prefix=True)`` loads the leading
    full chunks the store holds instead of prefilling them, stops at the first one it lacks, and
    decodes the same tokens as a prefill."""
    prompts = random_prompts(2, [300, 257])
    ref = _eng(tiny_model).reference(prompts, 30)
    store = _store(tiny_model)
    eng = _eng(tiny_model, store=store)
    eng.generate(prompts, 2)  # stores 4 + 4 chunks
    out = eng.reference(prompts, 30, stored_prefix=True)
    assert [o.tokens for o in out] == [r.tokens for r in ref]
    assert [o.stats.cached_chunks for o in out] == [4, 4]  # 257 tokens: the last one stays uncached
    assert out[0].stats.bytes_moved == 4 * 64 * Runtime(tiny_model).kv_bytes_per_token()
    store.capacity.delete(eng.chunk_keys(prompts[0])[2] + store._full_sfx)
    again = eng.reference(prompts, 30, stored_prefix=True)
    assert [o.stats.cached_chunks for o in again] == [2, 4] and again[0].tokens == ref[0].tokens
    key = eng.chunk_keys(prompts[0])[1]  # a chunk of the wrong length under a key: not used
    store.put(key, store.get_full(key)[:, :, :32].contiguous(), compress=False, replace=True)
    assert eng.reference(prompts[:1], 30, stored_prefix=True)[0].stats.cached_chunks == 1
    assert [o.stats.cached_chunks for o in eng.reference(prompts, 3)] == [0, 0]  # default: prefill


def test_offload_refills_a_shared_verify_cache_every_round(tiny_model):
    """Two different prompts take turns on one verify cache: each round must swap its own prefix in
    (the cache holds the other request's KV before), or the tokens would differ."""
    prompts = random_prompts(2, [300, 300], seed=3)
    ref = _eng(tiny_model).reference(prompts, 40)
    eng = _eng(tiny_model, full_kv="offload", verify_buffers=1)
    out = eng.generate(prompts, 40)
    assert [o.tokens for o in out] == [r.tokens for r in ref]
    assert eng.last_run["full_kv"] == "offload" and eng.last_run["verify_buffers"] == 1
    per_round = 4 * 64 * Runtime(tiny_model).kv_bytes_per_token()
    assert all(o.stats.bytes_moved == o.stats.rounds * per_round for o in out)


def test_budget_admits_more_offloaded_than_full_kv_requests(tiny_model):
    """A budget of 3 full caches: resident runs 2 requests at a time (full + draft cache each),
    offload (chosen by auto) runs all 6 at once on 1 verify cache plus their draft caches (a 25%
    prefix and a short window); the held KV never exceeds the budget, and every request's tokens are
    the reference's."""
    prompts = random_prompts(6, [600] * 6, seed=4)
    ref = _eng(tiny_model).reference(prompts, 30)
    budget = 3 * (600 + 30 + 8 + 2) * Runtime(tiny_model).kv_bytes_per_token()  # cap: + max_draft_len + 2
    resident = _eng(tiny_model, full_kv="resident", kv_budget_bytes=budget, max_draft_len=8)
    assert [o.tokens for o in resident.generate(prompts, 30)] == [r.tokens for r in ref]
    assert resident.last_run["max_active"] == 2 and resident.last_run["peak_kv_bytes"] <= budget
    auto = _eng(tiny_model, kv_budget_bytes=budget, max_draft_len=8)
    assert [o.tokens for o in auto.generate(prompts, 30)] == [r.tokens for r in ref]
    run = auto.last_run
    assert run["full_kv"] == "offload" and run["verify_buffers"] == 1
    assert run["max_active"] == 6 and run["peak_kv_bytes"] <= budget
    # without a budget, auto keeps the full KV resident
    free = _eng(tiny_model)
    free.generate(prompts[:2], 5)
    assert free.last_run["full_kv"] == "resident" and free.last_run["max_active"] == 2


def test_bad_residency_options(tiny_model):
    for kw, err in [(dict(full_kv="swap"), "full_kv must be one of"),
                    (dict(kv_budget_bytes=0), "kv_budget_bytes must be a positive int"),
                    (dict(verify_buffers=True), "verify_buffers must be a positive int"),
                    (dict(kv_budget_bytes=1.5), "kv_budget_bytes must be a positive int")]:
        with pytest.raises(ValueError, match=err):
            _eng(tiny_model, **kw)
    with pytest.raises(ValueError, match="needs a store"):
        _eng(tiny_model, store="resident", full_kv="offload")
    with pytest.raises(ValueError, match="cannot hold one verify buffer"):
        _eng(tiny_model, full_kv="offload", kv_budget_bytes=1000).generate(random_prompts(1, [100]), 2)


@pytest.mark.parametrize("full_kv", ["resident", "offload"])
@pytest.mark.parametrize("method", [SL, ("snapkv", {"keep_ratio": 0.25})])
def test_long_generation_compresses_generated_chunks(tiny_model, full_kv, method):
    """400 new tokens after a 300-token prompt: every filled chunk past the exact window joins the
    compressed prefix (the draft cache's exact part stays under a chunk + window + one round), and
    the tokens stay the reference's. Offload puts those chunks into the store and swaps them back."""
    prompts = random_prompts(2, [300, 170], seed=9)
    eng = VeriCacheEngine(tiny_model, *method, chunk_size=64, draft_len=6, full_kv=full_kv)
    ref = eng.reference(prompts, 400)
    exact = []
    out = eng.generate(prompts, 400, on_round=lambda r: exact.append(r.draft.n))
    assert [o.tokens for o in out] == [r.tokens for r in ref]
    assert max(exact) < 64 + eng.config.query_window + 6 + 1
    for o, n in zip(out, [300, 170]):
        assert o.stats.generated_chunks >= (n + 400 - 64 - eng.config.query_window - 7) // 64 - n // 64
    if full_kv == "offload":  # the last rounds swapped the generated chunks in too
        assert eng.store.stats.full_hits > sum(o.stats.rounds for o in out) * (300 // 64)
