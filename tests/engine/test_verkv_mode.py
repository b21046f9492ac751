"""The two decoding modes on real SmolLM2 (docs/verkv.md): the exact mode with the KVFetch drafter is
token-identical to full-KV greedy decoding; verkv mode decodes without verification, and with a
vanishing epsilon (everything fetched) it is full-KV decoding again."""

from __future__ import annotations

import pytest

from lmcache_vericache.data import prompt_ids, stdlib_source
from lmcache_vericache.engine import VeriCacheEngine

NEW = 32  # tokens per decode (48 took 93 s per test on a 2-core AVX2 host; every check holds at 32)


@pytest.fixture(scope="module")
def prompt(smollm2):
    return prompt_ids(smollm2[1], stdlib_source("argparse.py"), 1024).tolist()


@pytest.fixture(scope="module")
def reference(smollm2, prompt):
    with VeriCacheEngine(smollm2[0], "poissoncomp", {"keep_ratio": 0.125}, store="resident") as eng:
        return eng.reference([prompt], NEW)[0].tokens


def engine(model, **kw) -> VeriCacheEngine:
    return VeriCacheEngine(model, "poissoncomp", {"keep_ratio": 0.125}, draft_len=8, **kw)


def test_exact_mode_with_the_kvfetch_drafter_is_identical(smollm2, prompt, reference):
    with engine(smollm2[0], verkv={"kvfetch_draft": True, "epsilon": 0.05}) as eng:
        [res] = eng.generate([prompt], NEW)
    assert res.tokens == reference
    fetch = res.stats.kvfetch
    assert fetch["decisions"] > 0 and 0 < fetch["tokens_fetched"] < fetch["tokens_attended"]
    assert res.stats.verify_s > 0 and res.stats.mean_accepted > 1


def test_verkv_mode_decodes_without_verification(smollm2, prompt, reference):
    with engine(smollm2[0], mode="verkv", verkv={"epsilon": 0.05}) as eng:
        [res] = eng.generate([prompt], NEW)
    assert len(res.tokens) == NEW and res.stats.verify_s == 0
    assert 0 < res.stats.kvfetch["fetch_fraction"] < 1
    with engine(smollm2[0], mode="verkv", verkv={"epsilon": 1e-12, "sketch_bits": None}) as eng:
        [exact] = eng.generate([prompt], NEW)
    assert exact.tokens == reference  # everything fetched: certified attention is exact attention


@pytest.mark.parametrize("kw,match", [
    ({"mode": "fast"}, "mode must be one of"),
    ({"mode": "verkv", "compressor": "int8"}, "needs compressor 'poissoncomp'"),
    ({"verkv": {"epsilon": -1}}, "epsilon"),
    ({"verkv": {"sketch_bits": 3}}, "sketch_bits"),
    ({"verkv": {"epsilon_": 0.1}}, "unknown option"),
])
def test_bad_decoding_options_fail_at_construction(tiny_model, kw, match):
    compressor = kw.pop("compressor", "poissoncomp")
    with pytest.raises(ValueError, match=match):
        VeriCacheEngine(tiny_model, compressor, **kw)


def test_the_shipped_verkv_store_config_runs(tiny_model):
    import json
    from pathlib import Path

    config = json.loads((Path(__file__).parents[2] / "configs" / "store-verkv.json").read_text())
    with VeriCacheEngine(tiny_model, store=config, draft_len=4) as eng:
        assert eng.mode == "verkv" and eng.compressor.name == "poissoncomp"
        [res] = eng.generate([[(7 * i) % 251 + 3 for i in range(600)]], 12)
    assert len(res.tokens) == 12 and res.stats.verify_s == 0 and res.stats.kvfetch["decisions"] > 0


def test_kvfetch_drafter_over_a_prefix_from_the_store_is_identical(smollm2, prompt, reference):
    """The second request finds the prompt's chunks in the store: its KVFetch prefix and its full
    cache come from the store's chunks (read once), and the output is still full-KV greedy."""
    with engine(smollm2[0], verkv={"kvfetch_draft": True}) as eng:
        eng.generate([prompt], 1)  # stores the prompt's chunks
        [res] = eng.generate([prompt], 24)
    assert res.stats.cached_chunks == (len(prompt) - 1) // 256  # one prompt token stays uncached
    assert res.tokens == reference[:24] and res.stats.kvfetch["decisions"] > 0


def test_verkv_serves_the_same_prompt_twice_in_one_batch(tiny_model):
    # The second request copies the first's set-up (a twin); a verkv request keeps no full cache,
    # so the twin must not clone one (it raised AttributeError before).
    prompt = [(7 * i) % 251 + 3 for i in range(600)]
    with VeriCacheEngine(tiny_model, "poissoncomp", {"keep_ratio": 0.125}, mode="verkv", draft_len=4) as eng:
        a, b = eng.generate([prompt, prompt], 12)
    assert a.tokens == b.tokens and len(a.tokens) == 12
