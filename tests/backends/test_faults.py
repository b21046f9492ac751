"""Faults with real media: damaged values, a Redis server killed mid-run, a full disk, restarts
and a second process sharing one Redis store."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import redis
import torch

from lmcache_vericache import compressors
from lmcache_vericache.backends import DiskTier, DualTierStore, MemoryTier, StoreConfig, TierError
from lmcache_vericache.backends.store import COMPRESSED_SUFFIX, FULL_SUFFIX
from lmcache_vericache.backends.tiers.lm import LMServerTier
from lmcache_vericache.backends.tiers.redis import RedisTier

HEADS = 3
REPO = Path(__file__).resolve().parents[2]


def store_on(capacity, **kw) -> DualTierStore:
    return DualTierStore(compressors.get("int8"), capacity, num_kv_heads=HEADS, **kw)


def flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x40
    return bytes(b)


DAMAGE = {
    "payload_bit": lambda d: flip(d, len(d) // 2),
    "digest_bit": lambda d: flip(d, len(d) - 1),
    "header_bit": lambda d: flip(d, 6),
    "truncated": lambda d: d[: len(d) - 100],
    "truncated_to_header": lambda d: d[:20],
    "empty": lambda d: b"",
    "garbage": lambda d: os.urandom(len(d)),
}


class RawDisk:
    """Damages stored values in place, the way a bad disk or a torn copy would."""

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier

    def read(self, key: str) -> bytes:
        return self.tier._file(key).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        self.tier._file(key).write_bytes(data)


class RawRedis:
    def __init__(self, tier: RedisTier) -> None:
        self.client, self.prefix = redis.Redis.from_url(tier.url), tier.prefix

    def read(self, key: str) -> bytes:
        return self.client.get(self.prefix + key)

    def write(self, key: str, data: bytes) -> None:
        self.client.set(self.prefix + key, data)


class RawMemory:
    """Another writer of an in-process memory tier (its values are not the store's own)."""

    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier

    def read(self, key: str) -> bytes:
        return self.tier.get(key)

    def write(self, key: str, data: bytes) -> None:
        self.tier.put(key, data)


@pytest.fixture(params=["disk", "redis", "memory"])
def tier_and_raw(request, tmp_path):
    if request.param == "memory":
        tier = MemoryTier(1 << 30)
        return tier, RawMemory(tier)
    if request.param == "disk":
        tier = DiskTier(tmp_path)
        return tier, RawDisk(tier)
    tier = RedisTier(request.getfixturevalue("redis_server").url, prefix=f"f-{uuid.uuid4().hex}:")
    return tier, RawRedis(tier)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_full_chunks_are_counted_misses_never_returned(tier_and_raw, chunks, damage, caplog):
    tier, raw = tier_and_raw
    with store_on(tier) as store:
        store.put("bad", chunks[0])
        store.put("good", chunks[1])
        raw.write("bad" + FULL_SUFFIX, DAMAGE[damage](raw.read("bad" + FULL_SUFFIX)))
        with caplog.at_level(logging.ERROR):
            assert store.get_full("bad") is None
            out = store.prefetch(["good", "bad", "good"]).wait(timeout=10)
        assert out[1] is None and torch.equal(out[0], chunks[1]) and torch.equal(out[2], chunks[1])
        # the damaged value was deleted on the first read: counted once, then a plain miss
        assert store.stats.corrupt == 1 and store.stats.full_misses == 2
        assert any("'bad'" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        assert store.get_compressed("bad") is not None  # the hot copy is unaffected
        assert not store.has_full("bad")  # so LMCache hosts stop reporting a hit ...
        store.put("bad", chunks[0])  # ... and the next put rewrites it
        assert torch.equal(store.get_full("bad"), chunks[0])


def test_damaged_compressed_chunks_are_counted_misses(tier_and_raw, chunks):
    tier, raw = tier_and_raw
    with store_on(tier) as store:
        store.put("k", chunks[0])
        raw.write("k" + COMPRESSED_SUFFIX, DAMAGE["truncated"](raw.read("k" + COMPRESSED_SUFFIX)))
        store._hot.clear()  # as in a second instance: the compressed chunk must come from the tier
        assert store.get_compressed("k") is None and store.stats.corrupt == 1
        assert torch.equal(store.get_full("k"), chunks[0])
        store.put("k", chunks[0])  # the deleted compressed value is rewritten
        store._hot.clear()
        assert store.get_compressed("k") is not None


def test_redis_killed_mid_run_gives_misses_and_errors_not_crashes(redis_server_factory, chunks, caplog):
    server = redis_server_factory()
    store = store_on(RedisTier(server.url, socket_timeout=2.0))
    keys = [f"k{i}" for i in range(len(chunks))]
    for k, kv in zip(keys, chunks):
        store.put(k, kv)
    assert store.get_full("absent") is None and store.stats.tier_errors == 0  # a miss is not an error
    handle = store.prefetch(keys)
    server.kill()
    with caplog.at_level(logging.ERROR):
        got = handle.wait(timeout=30)  # whatever was read before the kill is intact, the rest misses
        assert all(g is None or torch.equal(g, c) for g, c in zip(got, chunks))
        errors = store.stats.tier_errors
        assert errors == sum(g is None for g in got)  # each failed read counted: the tier failed, not empty
        assert store.get_full("k0") is None and not store.has_full("k0")
        assert store.stats.tier_errors == errors + 2
        assert store.prefetch(keys).wait(timeout=30) == [None] * len(keys)
        with pytest.raises(TierError, match="SET"):
            store.put("new", chunks[0])
    assert any("redis tier" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    # The store keeps serving what it holds: compressed chunks for drafting are still hot.
    assert len(store.get_compressed_prefix(keys)) == len(keys) and store.contains("k0")
    assert store.get_compressed("new") is None and not store.contains("new")
    # A server back on the same address: the tier reconnects by itself.
    redis_server_factory(port=server.port)
    store.put("new", chunks[0])
    assert torch.equal(store.get_full("new"), chunks[0])
    store.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to fill (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_fails_puts_with_a_logged_error_and_keeps_earlier_chunks(small_tmpfs, caplog):
    big = torch.randn(2, 2, 256, HEADS * 64).bfloat16()  # ~390 KB full + ~200 KB compressed
    with store_on(DiskTier(small_tmpfs)) as store:
        store.put("first", big)
        with caplog.at_level(logging.ERROR), pytest.raises(TierError, match="No space left"):
            for i in range(10):
                store.put(f"more{i}", big + i)
        assert any("store put" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        assert store.stats.put_errors == 1
        assert torch.equal(store.get_full("first"), big)
        assert not [p for p in os.listdir(small_tmpfs) if p.endswith(".tmp")]  # no torn temp files
        failed = f"more{store.stats.puts - 1}"  # the put that hit the limit stored nothing readable
        assert store.get_full(failed) is None and store.get_compressed(failed) is None
    with store_on(DiskTier(small_tmpfs)) as again:  # and a restart still reads the earlier chunk
        assert torch.equal(again.get_full("first"), big)


def test_disk_restart_finds_earlier_chunks(tmp_path, chunks):
    with store_on(DiskTier(tmp_path)) as store:
        for i, kv in enumerate(chunks):
            store.put(f"k{i}", kv)
        expected = store.get_compressed("k3")
    with store_on(DiskTier(tmp_path)) as store:
        keys = [f"k{i}" for i in range(len(chunks))]
        assert all(store.contains(k) for k in keys)
        assert len(store.get_compressed_prefix(keys)) == len(chunks)
        got = store.get_compressed("k3")
        assert all(torch.equal(got.buffers[k], expected.buffers[k]) for k in expected.buffers)
        assert all(torch.equal(o, c) for o, c in zip(store.prefetch(keys).wait(timeout=10), chunks))


WRITER = textwrap.dedent(
    """
    import sys, torch
    from lmcache_vericache.backends import StoreConfig
    url, prefix = sys.argv[1], sys.argv[2]
    store = StoreConfig.parse({"compressor": "int8", "num_kv_heads": 3, "capacity": "redis",
                               "redis_url": url, "redis_prefix": prefix}).build()
    for i in range(4):
        g = torch.Generator().manual_seed(100 + i)
        store.put(f"shared{i}", torch.randn(2, 2, 16, 24, generator=g).bfloat16(), start=16 * i)
    store.close()
    """
)


def test_second_process_sees_first_process_chunks_through_redis(redis_server):
    prefix = f"mp-{uuid.uuid4().hex}:"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", WRITER, redis_server.url, prefix], check=True, cwd=REPO, env=env, timeout=120)
    expected = [torch.randn(2, 2, 16, 24, generator=torch.Generator().manual_seed(100 + i)).bfloat16() for i in range(4)]
    store = StoreConfig.parse(
        {"compressor": "int8", "num_kv_heads": 3, "capacity": "redis", "redis_url": redis_server.url, "redis_prefix": prefix}
    ).build()
    with store:
        keys = [f"shared{i}" for i in range(4)]
        ckvs = store.get_compressed_prefix(keys)
        assert len(ckvs) == 4 and [c.start for c in ckvs] == [0, 16, 32, 48]
        local = compressors.get("int8").compress(expected[2], 3, start=32)
        assert all(torch.equal(ckvs[2].buffers[k], local.buffers[k]) for k in local.buffers)
        full = store.prefetch(keys).wait(timeout=10)
        assert all(torch.equal(f, e) for f, e in zip(full, expected))


def test_lm_server_killed_gives_misses_and_failed_puts(chunks, caplog):
    from lmcache_vericache.testing.servers import LMServer

    server = LMServer()
    try:
        store = store_on(LMServerTier(server.url))
        store.put("k", chunks[0])
        assert torch.equal(store.get_full("k"), chunks[0])
        assert store.get_full("absent") is None and store.stats.tier_errors == 0
        server.kill()
        with caplog.at_level(logging.ERROR):
            assert store.get_full("k") is None and store.prefetch(["k"]).wait(timeout=30) == [None]
            assert store.stats.tier_errors == 2
            with pytest.raises(TierError, match="PUT"):
                store.put("k2", chunks[1])
        assert any("lm tier" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        assert store.get_compressed("k") is not None  # still hot
        store.close()
    finally:
        server.stop()
