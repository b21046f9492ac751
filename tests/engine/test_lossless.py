"""Greedy VeriCache output is token-identical to plain full-KV greedy decoding of the same model in
the same runtime (fp32), on real prompts of 1k-2k tokens, >= 128 new tokens, for every registered
compressor (first example of each). A failure reports the divergence position and the reference's
logit margin there (a tie has a margin near 0, a bug a large one)."""

from __future__ import annotations

import pytest
from engine_helpers import assert_identical, real_prompts, reference

from lmcache_vericache import compressors as C
from lmcache_vericache.engine import VeriCacheEngine

FAST = {"streamingllm", "int8"}  # one eviction, one quantization method run in the quick suite
CASES = [
    pytest.param(name, C.examples(name)[0], id=name,
                 marks=() if name in FAST else pytest.mark.slow)
    for name in C.available()
]


@pytest.mark.parametrize("name,params", CASES)
def test_greedy_identical_1k(smollm2, reference_cache, name, params):
    model, tok = smollm2
    prompt = real_prompts(tok, 1024)["stdlib/json/decoder.py"]
    eng = VeriCacheEngine(model, name, params, draft_len=16, full_kv="offload")  # the swap path
    [ref] = reference(eng, [prompt], 128, reference_cache)
    [out] = eng.generate([prompt], 128)
    assert len(out.tokens) == 128
    assert_identical(out.tokens, ref, f"{name} {params}")
    assert out.stats.rounds == len(out.stats.accepted) >= 128 // 17
    assert out.stats.bytes_moved > 0 and 0 <= out.stats.hidden_swap_fraction <= 1


# 2k x batch 2 costs several times the 1k case: one eviction and one low-bit method (sharing one
# reference decode) keep the engine's share of the full suite near 10 minutes.
CASES_2K = [c for c in CASES if c.values[0] in {"streamingllm", "int4"}]


@pytest.mark.slow
@pytest.mark.parametrize("name,params", CASES_2K)
def test_greedy_identical_2k_batch(smollm2, reference_cache, name, params):
    """Both real prompts (stdlib, HumanEval) at 2k tokens as one staggered batch, adaptive L, sharing
    one verify buffer."""
    model, tok = smollm2
    prompts = list(real_prompts(tok, 2048).values())
    # one verify buffer for two requests: they take turns, each round swapped in from the store
    eng = VeriCacheEngine(model, name, params, draft_len="auto", full_kv="offload", verify_buffers=1)
    refs = reference(eng, prompts, 128, reference_cache)
    outs = eng.generate(prompts, 128)
    for label, out, ref in zip(["stdlib", "humaneval"], outs, refs):
        assert_identical(out.tokens, ref, f"{name} {params} {label}")
