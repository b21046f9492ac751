"""Capacity tiers against their contract, each on its real medium (memory, files, a Redis server, a Redis Cluster)."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from lmcache_vericache.backends.tiers import DiskTier, MemoryTier, TierError
from lmcache_vericache.backends.tiers.lm import LMServerTier
from lmcache_vericache.backends.tiers.memory import LRU
from lmcache_vericache.backends.tiers.redis import RedisTier
from lmcache_vericache.backends.tiers.redis_cluster import RedisClusterTier


@pytest.fixture(params=["memory", "disk", "nixl", "redis", "redis_cluster", "lm"])
def tier(request, tmp_path):
    if request.param == "memory":
        t = MemoryTier(8 << 20)
    elif request.param in ("disk", "nixl"):
        t = DiskTier(tmp_path / "tier") if request.param == "disk" else request.getfixturevalue("nixl_tier_cls")(tmp_path / "tier")
    elif request.param == "redis":
        t = RedisTier(request.getfixturevalue("redis_server").url, prefix=f"t-{uuid.uuid4().hex}:")
    elif request.param == "redis_cluster":
        t = RedisClusterTier(request.getfixturevalue("shared_redis_cluster").url, prefix=f"t-{uuid.uuid4().hex}:")
    else:
        t = LMServerTier(request.getfixturevalue("lm_server").url, namespace=f"t-{uuid.uuid4().hex}")
    yield t
    t.close()


def test_put_get_contains_delete(tier):
    assert tier.get("a") is None and not tier.contains("a")
    data = os.urandom(100_000)
    tier.put("a", data)
    tier.put("model/with/slashes@1@0@ff@bfloat16", b"x")
    tier.put("empty", b"")
    assert bytes(tier.get("a")) == data and tier.contains("a")
    assert bytes(tier.get("model/with/slashes@1@0@ff@bfloat16")) == b"x"
    assert bytes(tier.get("empty")) == b""
    tier.put("a", bytearray(b"new"))  # overwrite, from a mutable buffer
    assert bytes(tier.get("a")) == b"new"
    tier.delete("a")
    tier.delete("a")  # idempotent
    assert tier.get("a") is None
    assert tier.contains("a") == (tier.name == "lm")  # the lm:// protocol has no delete (documented)


def test_put_does_not_alias_mutable_input(tier):
    buf = bytearray(b"abcdef")
    tier.put("k", buf)
    buf[0] = ord("z")
    assert bytes(tier.get("k")) == b"abcdef"


def test_close_is_idempotent_and_put_after_close_fails(tier):
    tier.put("k", b"v")
    tier.close()
    tier.close()
    with pytest.raises(TierError, match="after close"):
        tier.put("k2", b"v")
    assert tier.get("k") is None


def test_bad_keys_are_rejected(tier):
    for key in ("", None, 3):
        with pytest.raises(ValueError):
            tier.put(key, b"v")


def test_concurrent_readers_never_see_partial_values(tier):
    small, big = b"s" * 1000, b"b" * 3_000_000
    tier.put("k", small)
    seen, stop = set(), threading.Event()

    def reader():
        while not stop.is_set():
            v = tier.get("k")
            seen.add(None if v is None else bytes(v[:1]) + str(len(v)).encode())

    def writer():
        for i in range(20):
            tier.put("k", big if i % 2 else small)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    writer()
    stop.set()
    for t in threads:
        t.join()
    assert seen <= {b"s1000", b"b3000000"}


def test_memory_tier_is_a_byte_bounded_lru():
    t = MemoryTier(300)
    for k in "abc":
        t.put(k, bytes(100))
    t.get("a")  # a is now most recent, b the oldest
    t.put("d", bytes(100))
    assert t.get("b") is None and t.get("a") is not None and t.get("d") is not None
    assert t.nbytes == 300
    with pytest.raises(TierError, match="larger than the tier"):
        t.put("huge", bytes(301))
    assert t.get("a") is not None  # a refused put evicts nothing


def test_lru_replacing_a_key_updates_its_size():
    lru: LRU[str] = LRU(100)
    lru.put("a", "x", 60)
    lru.put("a", "y", 30)
    lru.put("b", "z", 70)
    assert lru.nbytes == 100 and lru.get("a") == "y" and lru.get("b") == "z"


def test_disk_tier_restart_finds_what_was_stored(tmp_path):
    t = DiskTier(tmp_path)
    t.put("k1", b"one")
    t.put("k2", b"two")
    t.close()
    t2 = DiskTier(tmp_path)
    assert bytes(t2.get("k1")) == b"one" and bytes(t2.get("k2")) == b"two"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_disk_tier_bad_directory_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(TierError, match="cannot create directory"):
        DiskTier(f / "sub")


def test_redis_tier_bad_url_and_unreachable_server_fail_at_construction():
    from lmcache_vericache.testing.servers import free_port

    with pytest.raises(TierError, match="bad url"):
        RedisTier("http://127.0.0.1:1")
    with pytest.raises(TierError, match="cannot reach"):
        RedisTier(f"redis://127.0.0.1:{free_port()}/0")


def test_lm_tier_bad_url_and_unreachable_server_fail_at_construction():
    from lmcache_vericache.testing.servers import free_port

    with pytest.raises(TierError, match="bad url"):
        LMServerTier("redis://127.0.0.1:1")
    with pytest.raises(TierError, match="cannot reach"):
        LMServerTier(f"lm://127.0.0.1:{free_port()}")
