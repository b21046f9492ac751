"""Proposer options: additional_config over VERICACHE_PROPOSER_* env, errors name the key."""

import pytest

from lmcache_vericache.connectors.proposer import ProposerOptions


def load(cfg=None, env=None, k=8):
    return ProposerOptions.load({"vericache_proposer": cfg} if cfg is not None else {}, env or {}, k)


def test_defaults_and_sources():
    assert load() == ProposerOptions()
    o = load({"compressor": "kivi", "compressor_params": {"bits": 2}, "window": 16},
             {"VERICACHE_PROPOSER_CHUNK_SIZE": "256", "VERICACHE_PROPOSER_COMPRESSOR": "int4"})
    assert (o.compressor, o.compressor_params, o.window, o.chunk_size) == ("kivi", {"bits": 2}, 16, 256)
    assert load(env={"VERICACHE_PROPOSER_MAX_DRAFT": "4"}).max_draft == 4
    assert load().draft_cache_bytes == "auto"
    assert load({"draft_cache_bytes": 0}).draft_cache_bytes == 0
    assert load(env={"VERICACHE_PROPOSER_DRAFT_CACHE_BYTES": "1073741824"}).draft_cache_bytes == 1 << 30
    assert load({"draft_cache_bytes": "auto"}, {"VERICACHE_PROPOSER_DRAFT_CACHE_BYTES": "5"}).draft_cache_bytes == "auto"


@pytest.mark.parametrize("cfg,env,key", [
    ({"chunk_sise": 128}, {}, "vericache_proposer.chunk_sise"),
    ({"chunk_size": 0}, {}, "vericache_proposer.chunk_size"),
    ({"window": -1}, {}, "vericache_proposer.window"),
    ({"max_draft": 9}, {}, "vericache_proposer.max_draft"),
    ({"compressor": "nope"}, {}, "vericache_proposer.compressor"),
    ({"compressor": "kivi", "compressor_params": {"bitz": 2}}, {}, "vericache_proposer.compressor_params"),
    ({"draft_cache_bytes": -1}, {}, "vericache_proposer.draft_cache_bytes"),
    ({"draft_cache_bytes": "lots"}, {}, "vericache_proposer.draft_cache_bytes"),
    ({"draft_cache_bytes": 1.5}, {}, "vericache_proposer.draft_cache_bytes"),
    ({"draft_cache_bytes": True}, {}, "vericache_proposer.draft_cache_bytes"),
    (None, {"VERICACHE_PROPOSER_DRAFT_CACHE_BYTES": "-5"}, "VERICACHE_PROPOSER_DRAFT_CACHE_BYTES"),
    (None, {"VERICACHE_PROPOSER_DRAFT_CACHE_BYTES": "Auto"}, "VERICACHE_PROPOSER_DRAFT_CACHE_BYTES"),
    (None, {"VERICACHE_PROPOSER_WINDOW": "x"}, "VERICACHE_PROPOSER_WINDOW"),
    (None, {"VERICACHE_PROPOSER_MAX_DRAFT": "true"}, "VERICACHE_PROPOSER_MAX_DRAFT"),
    (None, {"VERICACHE_PROPOSER_COMPRESOR": "int8"}, "VERICACHE_PROPOSER_COMPRESOR"),
])
def test_bad_options_name_the_key(cfg, env, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load(cfg, env)
