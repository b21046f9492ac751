"""A shared store is untrusted input: keyed integrity (MAC), metadata that must match the store,
and reads that end when the store is closed. Real files and a real Redis server."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from lmcache_vericache import compressors
from lmcache_vericache.backends import DiskTier, DualTierStore, MemoryTier, StoreConfig
from lmcache_vericache.backends.mac import MAC_SUFFIXES
from lmcache_vericache.backends.store import COMPRESSED_SUFFIX
from lmcache_vericache.backends.tiers.redis import RedisTier
from lmcache_vericache.compressors import to_bytes

HEADS = 3
SECRET = b"team-secret-0123456789"


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(2, 2, 16, HEADS * 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.fixture(params=["disk", "redis"])
def tier_factory(request, tmp_path):
    """Builds tiers over one shared medium: two stores = two hosts sharing a disk or a Redis server."""
    if request.param == "disk":
        return lambda: DiskTier(tmp_path / "kv")
    url, prefix = request.getfixturevalue("redis_server").url, f"trust-{uuid.uuid4().hex}:"
    return lambda: RedisTier(url, prefix=prefix)


def test_mac_store_rejects_values_written_without_the_key(tier_factory):
    keyed = DualTierStore(compressors.get("int8"), tier_factory(), num_kv_heads=HEADS, mac_key=SECRET)
    other = DualTierStore(compressors.get("int8"), tier_factory(), num_kv_heads=HEADS, mac_key=b"x" * 16)
    plain = DualTierStore(compressors.get("int8"), tier_factory(), num_kv_heads=HEADS)
    with keyed, other, plain:
        keyed.put("k", chunk(0))
        assert torch.equal(keyed.get_full("k"), chunk(0))
        # Another key reads nothing it can use: rejected, counted, never returned, and not deleted
        # (it may be a good value of a host with another key).
        assert other.get_full("k") is None and other.stats.unauthenticated == 1
        assert not other.has_full("k") and torch.equal(keyed.get_full("k"), chunk(0))
        # A store without a key does not even see authenticated values (other names), and its own
        # plain values are invisible to the keyed store: no cross-talk, no deletion of each other.
        assert plain.get_full("k") is None and plain.stats.unauthenticated == 0
        plain.put("p", chunk(1))
        assert keyed.get_full("p") is None
        # A poisoned value: an attacker without the key writes a well-formed chunk (valid BLAKE3
        # digest) under the keyed store's name. It is rejected; the store stops reporting it and
        # the next put overwrites it.
        keyed.put("victim", chunk(2))
        from lmcache_vericache.backends.fullchunk import encode_full
        keyed.capacity.put("victim" + MAC_SUFFIXES[0], encode_full(chunk(3)))
        assert keyed.get_full("victim") is None and keyed.stats.unauthenticated == 1
        assert not keyed.has_full("victim")
        keyed.put("victim", chunk(2))
        assert torch.equal(keyed.get_full("victim"), chunk(2)) and keyed.has_full("victim")
        # A valid value moved to another key does not verify either (the tag binds the key).
        keyed.capacity.put("moved" + MAC_SUFFIXES[0], keyed.capacity.get("k" + MAC_SUFFIXES[0]))
        assert keyed.get_full("moved") is None and keyed.stats.unauthenticated == 2
        # A compressed value without the tag: rejected on the draft path too.
        keyed._hot.clear()
        good = keyed.capacity.get("k" + MAC_SUFFIXES[1])
        keyed.capacity.put("k" + MAC_SUFFIXES[1], good[:-32])
        assert keyed.get_compressed("k") is None and keyed.stats.unauthenticated == 3


def test_mac_key_comes_from_the_environment(monkeypatch, tmp_path):
    cfg = {"num_kv_heads": HEADS, "capacity": "disk", "disk_path": str(tmp_path), "mac_key_env": "VC_TEST_MAC"}
    with pytest.raises(ValueError, match="mac_key_env names 'VC_TEST_MAC', which must be set"):
        StoreConfig.parse(cfg).build()
    monkeypatch.setenv("VC_TEST_MAC", SECRET.decode())
    with StoreConfig.parse(cfg).build() as a:
        a.put("k", chunk(0))
        assert a._mac_key is not None
    monkeypatch.setenv("VC_TEST_MAC", "another-secret-of-enough-length")
    with StoreConfig.parse(cfg).build() as b:
        assert b.get_full("k") is None and b.stats.unauthenticated == 1


def test_compressed_chunks_must_match_the_store(tier_factory):
    """A well-formed compressed chunk of another method, parameters or head count, written under
    our key by another host, is an invalid miss and is deleted (so the next put rewrites it)."""
    with DualTierStore(compressors.get("int8"), tier_factory(), num_kv_heads=HEADS) as store:
        full = chunk(0)
        for foreign in (compressors.get("int4").compress(full, HEADS),
                        compressors.get("int8").compress(full, 1)):
            store.put("k", full)
            store._hot.clear()
            store.capacity.put("k" + COMPRESSED_SUFFIX, to_bytes(foreign))
            assert store.get_compressed("k") is None
            assert not store.capacity.contains("k" + COMPRESSED_SUFFIX)
        assert store.stats.invalid == 2
        store.put("k", full)
        store._hot.clear()
        assert store.get_compressed("k") is not None


def test_full_chunks_must_have_the_store_layout(tmp_path):
    from lmcache_vericache.backends.fullchunk import encode_full
    from lmcache_vericache.backends.store import FULL_SUFFIX

    with DualTierStore(compressors.get("int8"), DiskTier(tmp_path), num_kv_heads=HEADS) as store:
        store.capacity.put("a" + FULL_SUFFIX, encode_full(torch.zeros(2, 2, 16, 7)))  # 7 % 3 heads
        store.capacity.put("b" + FULL_SUFFIX, encode_full(torch.zeros(3, 2, 16, 24)))
        store.capacity.put("c" + FULL_SUFFIX, encode_full(torch.zeros(2, 2, 16, 24, dtype=torch.int32)))
        assert [store.get_full(k) for k in "abc"] == [None] * 3 and store.stats.invalid == 3


class _SlowTier(MemoryTier):
    def get(self, key):
        time.sleep(0.3)
        return super().get(key)


def test_wait_after_close_returns_misses():
    store = DualTierStore(compressors.get("int8"), _SlowTier(1 << 30), num_kv_heads=HEADS, max_concurrent_reads=1)
    store.put("a", chunk(0))
    handle = store.prefetch(["a"] * 6)
    closer = threading.Thread(target=store.close)
    closer.start()
    t0 = time.monotonic()
    out = handle.wait(timeout=10)  # used to block forever on the reads close() cancelled
    closer.join()
    assert time.monotonic() - t0 < 5
    assert out.count(None) >= 4 and all(o is None or torch.equal(o, chunk(0)) for o in out)


def test_header_edited_compressed_chunk_with_a_valid_digest_is_an_invalid_miss(tier_factory):
    """Another host writes a chunk whose frame and digest are right but whose header lies (a kept
    position past the chunk): the store counts it invalid, deletes it, and drafting never sees it."""
    from lmcache_vericache.compressors import codec

    with DualTierStore(compressors.get("streamingllm", keep_ratio=0.5), tier_factory(), num_kv_heads=HEADS) as store:
        store.put("k", chunk(0))
        store._hot.clear()
        header, payload = codec.unframe(store.capacity.get("k" + COMPRESSED_SUFFIX))
        header["shape"] = [2, 2, 2**27, HEADS * 8]  # 2^27 tokens declared
        store.capacity.put("k" + COMPRESSED_SUFFIX, codec.frame(header, payload))
        t0 = time.monotonic()
        assert store.get_compressed("k") is None and store.stats.invalid == 1
        assert time.monotonic() - t0 < 1.0 and not store.capacity.contains("k" + COMPRESSED_SUFFIX)
        assert torch.equal(store.get_full("k"), chunk(0))  # the full chunk is unaffected


def test_full_redis_server_fails_puts_whole_and_keeps_what_was_stored(redis_server):
    """A put is one pipelined round trip of full + compressed value; a server out of memory fails it
    with TierError, leaves no half-stored chunk, and every earlier chunk stays readable."""
    import redis as redis_py

    from lmcache_vericache.backends import TierError
    from lmcache_vericache.backends.store import FULL_SUFFIX

    prefix = f"full-{uuid.uuid4().hex}:"
    cfg = {"num_kv_heads": HEADS, "capacity": "redis", "redis_url": redis_server.url, "redis_prefix": prefix,
           "redis_timeout_s": 2.0}
    admin = redis_py.Redis.from_url(redis_server.url)
    with StoreConfig.parse(cfg).build() as store:
        store.put("before", chunk(0))
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]))
        try:
            with pytest.raises(TierError, match="OOM|maxmemory"):
                store.put("after", chunk(1))
        finally:
            admin.config_set("maxmemory", 0)
        assert not store.capacity.contains("after" + FULL_SUFFIX)
        assert not store.capacity.contains("after" + COMPRESSED_SUFFIX)
        assert torch.equal(store.get_full("before"), chunk(0)) and store.stats.put_errors == 1
        store.put("after", chunk(1))  # room again: stored
        assert torch.equal(store.get_full("after"), chunk(1))
