"""Chunk keys are bound to the exact weights: models that differ in a single weight never share a
chunk, however late in the tensor the difference is."""

from __future__ import annotations

import torch

from lmcache_vericache import compressors
from lmcache_vericache.backends import DualTierStore, MemoryTier, model_fingerprint
from lmcache_vericache.engine import VeriCacheEngine
from lmcache_vericache.models import tiny_llama


def _one_weight_changed():
    model = tiny_llama(seed=0)
    with torch.no_grad():  # the very last value of the last layer's last tensor
        model.model.layers[-1].mlp.down_proj.weight[-1, -1] += 1e-3
    return model


def test_fingerprint_sees_every_weight():
    assert model_fingerprint(tiny_llama(seed=0)) == model_fingerprint(tiny_llama(seed=0))
    assert model_fingerprint(tiny_llama(seed=0)) != model_fingerprint(_one_weight_changed())
    assert model_fingerprint(tiny_llama(seed=0)) != model_fingerprint(tiny_llama(seed=0).to(torch.bfloat16))


def test_models_differing_in_one_weight_never_share_a_chunk():
    a, b = tiny_llama(seed=0), _one_weight_changed()
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    store = DualTierStore(compressors.get("int8"), MemoryTier(1 << 30), num_kv_heads=2)
    with store:
        eng_a = VeriCacheEngine(a, chunk_size=64, store=store)
        eng_b = VeriCacheEngine(b, chunk_size=64, store=store)
        assert not set(eng_a.chunk_keys(prompt)) & set(eng_b.chunk_keys(prompt))
        [out_a] = eng_a.generate([prompt], 24)
        [out_b] = eng_b.generate([prompt], 24)  # a's chunks are in the store: b must not use them
        assert out_a.stats.cached_chunks == 0 and out_b.stats.cached_chunks == 0
        assert out_a.tokens == eng_a.reference([prompt], 24)[0].tokens
        assert out_b.tokens == eng_b.reference([prompt], 24)[0].tokens
        [again_b] = eng_b.generate([prompt], 24)  # b's own chunks are found by b
        assert again_b.stats.cached_chunks == (300 - 1) // 64 and again_b.tokens == out_b.tokens


def test_fingerprint_is_cached_until_a_weight_changes(monkeypatch):
    model = tiny_llama(seed=0)
    first = model_fingerprint(model)
    calls = []
    import blake3 as b3
    real = b3.blake3
    monkeypatch.setattr("lmcache_vericache.backends.keys.blake3.blake3", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert model_fingerprint(model) == first and not calls  # cached: no hashing
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] += 1.0  # in place: bumps the version
    assert model_fingerprint(model) != first and calls
