"""Store faults under a running decode, with the real model, a real Redis server and real files:

* the Redis server killed (SIGKILL) after the first rounds: every later round's full chunks miss,
  the engine logs and counts the misses and recomputes the chunks' exact KV, and the output equals
  plain full-KV greedy decoding token for token;
* a full chunk damaged on disk mid-decode: it fails its digest (counted by the store), is never
  verified against (the verify buffer's prefix is NaN-poisoned: only swapped-in or recomputed KV
  can fill it), is recomputed and put back, and the output is identical.
"""

from __future__ import annotations

import logging

import pytest

from lmcache_vericache.backends import StoreConfig
from lmcache_vericache.backends.store import FULL_SUFFIX
from lmcache_vericache.data import prompt_ids, stdlib_source
from lmcache_vericache.engine import VeriCacheEngine

pytestmark = pytest.mark.e2e
METHOD, PARAMS, N_NEW, CHUNKS = "streamingllm", {"keep_ratio": 0.25}, 64, 4


@pytest.fixture(scope="module")
def case(smollm2):
    """A 1024-token stdlib prompt (4 chunks) and its plain full-KV greedy continuation."""
    model, tok = smollm2
    prompt = prompt_ids(tok, stdlib_source("json/decoder.py"), CHUNKS * 256).tolist()
    [ref] = VeriCacheEngine(model, METHOD, PARAMS, store="resident").reference([prompt], N_NEW)
    return model, prompt, ref.tokens


def _kill_after(rounds: int, action):
    def on_round(r):
        if r.stats.rounds == rounds:
            action()
    return on_round


def test_redis_killed_mid_decode_finishes_identically(case, redis_server_factory, caplog):  # noqa: F811
    model, prompt, ref = case
    server = redis_server_factory()
    store = StoreConfig.parse({"compressor": METHOD, "compressor_params": PARAMS, "num_kv_heads": 3,
                               "capacity": "redis", "redis_url": server.url}).build()
    with store, caplog.at_level(logging.WARNING):
        eng = VeriCacheEngine(model, store=store, draft_len=16, full_kv="offload")  # a swap every round
        [out] = eng.generate([prompt], N_NEW, on_round=_kill_after(2, server.kill))
        assert server.proc.poll() is not None  # really dead before the decode finished
        s = out.stats
        assert out.tokens == ref, "output diverged from full-KV greedy after the Redis server died"
        assert s.rounds > 2 and s.recomputed_chunks == CHUNKS * (s.rounds - 2)  # every round after the kill
        assert store.stats.full_misses == s.recomputed_chunks and store.stats.full_hits == 2 * CHUNKS
    assert any("missed in the store" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert any("redis tier" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    print(f"\n{s.rounds} rounds, {s.recomputed_chunks} chunks recomputed after the kill, "
          f"{s.mean_accepted:.1f} tokens/round")


def test_corrupt_full_chunk_on_disk_is_never_verified_against(case, tmp_path, caplog):
    model, prompt, ref = case
    eng = VeriCacheEngine(model, METHOD, PARAMS, store={"capacity": "disk", "disk_path": str(tmp_path)}, draft_len=16,
                          full_kv="offload")  # a swap every round
    victim = eng.store.capacity._file(eng.chunk_keys(prompt)[1] + FULL_SUFFIX)

    def damage():  # one flipped payload bit, in place, as a bad disk would do
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        victim.write_bytes(bytes(raw))

    with eng, caplog.at_level(logging.WARNING):
        [out] = eng.generate([prompt], N_NEW, on_round=_kill_after(1, damage))
        s, st = out.stats, eng.store.stats
    assert out.tokens == ref
    # chunk 1: detected in the round after the damage, deleted, recomputed once, rewritten; later
    # rounds swap the rewritten chunk in
    assert s.rounds > 2 and s.recomputed_chunks == 1
    assert st.corrupt == st.full_misses == 1
    assert s.bytes_moved == (CHUNKS * s.rounds - 1) * 256 * eng.rt.kv_bytes_per_token()
    assert any("is corrupt" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
