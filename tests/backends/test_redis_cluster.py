"""The ``redis_cluster`` capacity tier on a real local Redis Cluster (3 masters + 3 replicas,
started by the fixtures of ``lmcache_vericache.testing.servers``): chunks spread over the masters,
a dead master, its replica taking over, and the engine reusing a shared prefix through it."""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import Counter

import pytest
import torch

from lmcache_vericache.backends import StoreConfig
from lmcache_vericache.backends.store import COMPRESSED_SUFFIX, FULL_SUFFIX
from lmcache_vericache.backends.tiers import TierError
from lmcache_vericache.backends.tiers.redis_cluster import RedisClusterTier
from lmcache_vericache.testing.servers import free_port

N = 30


def make_chunks(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, 16, 24, generator=g).bfloat16() for _ in range(n)]


def config(cluster, prefix: str | None = None) -> StoreConfig:
    return StoreConfig.parse({"compressor": "int8", "num_kv_heads": 3, "capacity": "redis_cluster",
                              "redis_cluster_urls": cluster.url,
                              "redis_prefix": prefix or f"rc-{uuid.uuid4().hex}:"})


def owners(store, cluster, keys: list[str]) -> dict[str, int]:
    """Port of the master holding each chunk (its full and compressed values share one slot)."""
    return {k: cluster.owner(store.capacity.keyslot(k + FULL_SUFFIX)) for k in keys}


def key_on(store, cluster, port: int, stem: str) -> str:
    """A fresh chunk key whose slot is on the master at ``port``."""
    return next(k for k in (f"{stem}{i}" for i in range(10_000))
                if cluster.owner(store.capacity.keyslot(k + FULL_SUFFIX)) == port)


def test_round_trip_is_bit_exact_and_spreads_over_all_masters(shared_redis_cluster):
    cluster, prefix = shared_redis_cluster, f"rt-{uuid.uuid4().hex}:"
    cfg, chunks, keys = config(cluster, prefix), make_chunks(N), [f"chunk{i}" for i in range(N)]
    with cfg.build() as a:
        assert isinstance(a.capacity, RedisClusterTier) and a.capacity.name == "redis_cluster"
        for i, (k, kv) in enumerate(zip(keys, chunks)):
            a.put(k, kv, start=16 * i)
        assert all(torch.equal(a.get_full(k), kv) for k, kv in zip(keys, chunks))
        with cfg.build() as b:  # another host: nothing hot, every value comes from the cluster
            got = b.prefetch(keys).wait(timeout=30)
            assert all(torch.equal(g, kv) for g, kv in zip(got, chunks))
            for k in keys:
                mine, theirs = a.get_compressed(k), b.get_compressed(k)
                assert all(torch.equal(mine.buffers[n], theirs.buffers[n]) for n in mine.buffers)
            s = b.stats
            assert (s.full_hits, s.full_misses, s.compressed_hits, s.corrupt) == (N, 0, N, 0)
        # A chunk's two values share a slot (hash tag); the chunks cover every master.
        slots = [a.capacity.keyslot(k + FULL_SUFFIX) for k in keys]
        assert slots == [a.capacity.keyslot(k + COMPRESSED_SUFFIX) for k in keys]
        per_master = Counter(cluster.owner(s) for s in slots)
        assert sorted(per_master) == sorted(cluster.masters()) and len(per_master) == 3
        # ... and each master really holds its chunks (the cluster's own view, key by key).
        for port, n in per_master.items():
            stored = list(cluster.client(port).scan_iter(match=f"{prefix}*", count=1000))
            assert len(stored) == 2 * n
            assert all(int(cluster.client(port).cluster("KEYSLOT", k)) in slots for k in stored)


def test_tier_errors_startup_nodes_and_config(shared_redis_cluster, redis_server):
    cluster = shared_redis_cluster
    with pytest.raises(TierError, match="bad url"):
        RedisClusterTier("http://127.0.0.1:1")
    with pytest.raises(TierError, match="bad url") as e:
        RedisClusterTier("redis://u:s3cret@127.0.0.1:1,redis://127.0.0.1:2")  # credentials differ
    assert "s3cret" not in str(e.value)
    with pytest.raises(TierError, match="cannot reach") as e:
        RedisClusterTier(f"redis://u:s3cret@127.0.0.1:{free_port()}")
    assert "s3cret" not in str(e.value) and "***" in str(e.value)
    with pytest.raises(TierError, match="Cluster mode is not enabled"):
        RedisClusterTier(redis_server.url.removesuffix("/0"))
    with pytest.raises(TierError, match="hash tag"):
        RedisClusterTier(cluster.url, prefix="{team}:")
    # Any reachable startup node is enough, in any position.
    with RedisClusterTier(f"redis://127.0.0.1:{free_port()}, {cluster.startup_urls[-1]}", prefix="sn:") as t:
        t.put("a/b", b"v")
        assert bytes(t.get("a/b")) == b"v" and t.contains("a/b") and t.keyslot("a/b") == t.keyslot("a/c")
        assert "sn:" in repr(t)
    for bad, message in [
        ({}, "redis_cluster_urls is required for capacity 'redis_cluster'"),
        ({"redis_cluster_urls": " , "}, "redis_cluster_urls is required"),
        ({"redis_cluster_urls": "redis://h:1,http://u:pw@h:2"}, r"redis_cluster_urls: 'http://u:\*\*\*@h:2' is not"),
        ({"redis_cluster_urls": cluster.url, "redis_prefix": "{x}:"}, "redis_prefix '{x}:' must not contain"),
    ]:
        with pytest.raises(ValueError, match=f"^store config: {message}"):
            StoreConfig.parse({"num_kv_heads": 3, "capacity": "redis_cluster", **bad})
    cfg = StoreConfig.parse({"capacity": "redis_cluster", "redis_cluster_urls": "redis://u:pw@h:1,redis://u:pw@h:2"})
    assert "pw" not in repr(cfg) and "redis://u:***@h:1,redis://u:***@h:2" in repr(cfg)


def test_dead_master_gives_misses_for_its_slots_then_its_replica_serves_them(redis_cluster, caplog):
    cluster = redis_cluster
    cfg, chunks, keys = config(cluster), make_chunks(N, seed=1), [f"chunk{i}" for i in range(N)]
    writer, reader, hammer = cfg.build(), cfg.build(), cfg.build()
    stop, wrong, raised = threading.Event(), [], []

    def hammering(seed: int) -> None:  # concurrent reads through kill and failover: never wrong, never raise
        rng = random.Random(seed)
        while not stop.is_set():
            i = rng.randrange(N)
            try:
                got = hammer.get_full(keys[i])
                if got is not None and not torch.equal(got, chunks[i]):
                    wrong.append(keys[i])
            except Exception as e:  # noqa: BLE001 - the test's point
                raised.append(e)

    threads = [threading.Thread(target=hammering, args=(s,)) for s in range(3)]
    try:
        for i, (k, kv) in enumerate(zip(keys, chunks)):
            writer.put(k, kv, start=16 * i)
        cluster.wait_replicated()  # replicas get writes asynchronously: have them all before the kill
        own = owners(writer, cluster, keys)
        victim = Counter(own.values()).most_common(1)[0][0]
        [replica] = cluster.replicas_of(victim)
        lost = {k for k in keys if own[k] == victim}
        assert 0 < len(lost) < N
        for t in threads:
            t.start()

        cluster.hold_failovers()  # its replica must not take over yet
        cluster.kill(victim)
        with caplog.at_level(logging.ERROR):
            t0 = time.monotonic()
            got = reader.prefetch(keys).wait(timeout=30)
            for k, g, kv in zip(keys, got, chunks):
                assert g is None if k in lost else torch.equal(g, kv), k
            assert [reader.get_compressed(k) is None for k in keys] == [k in lost for k in keys]
            s = reader.stats
            assert (s.full_misses, s.full_hits, s.compressed_misses, s.corrupt) == (len(lost), N - len(lost), len(lost), 0)
            assert time.monotonic() - t0 < 10
            with pytest.raises(TierError, match="SET"):
                writer.put(key_on(writer, cluster, victim, "new"), chunks[0])
            elsewhere = key_on(writer, cluster, next(p for p in cluster.masters() if p != victim), "other")
            writer.put(elsewhere, chunks[1])
            assert torch.equal(reader.get_full(elsewhere), chunks[1])
        logged = [r for r in caplog.records if r.name.endswith("tiers.redis_cluster") and r.levelno == logging.ERROR]
        assert logged and len(logged) <= 3  # rate limited: one line per tier (three stores), not one per chunk

        cluster.hold_failovers(False)  # the replica takes over on its own
        t0 = time.monotonic()
        cluster.wait_ok(timeout=30)
        failover_s = time.monotonic() - t0
        assert cluster.owner(writer.capacity.keyslot(next(iter(lost)) + FULL_SUFFIX)) == replica
        time.sleep(reader.capacity.down_interval)  # the tier probes a dead node at most this often
        # The probe: refused by the dead master, the slot map re-read, served by the promoted replica
        # in the same call (concurrent reads of those slots skip the node while a probe runs).
        probe = keys.index(next(iter(lost)))
        assert torch.equal(reader.get_full(keys[probe]), chunks[probe])
        got = reader.prefetch(keys).wait(timeout=30)  # the same processes, no restart or reconnect call
        assert all(torch.equal(g, kv) for g, kv in zip(got, chunks))
        fresh = key_on(writer, cluster, replica, "new")
        writer.put(fresh, chunks[2])
        assert torch.equal(reader.get_full(fresh), chunks[2])

        cluster.restart(victim)  # the old master rejoins as a replica of the promoted one
        cluster.wait_replicas_linked()
        assert {n["port"]: (n["role"], n["master"]) for n in cluster.nodes()}[victim] == ("replica", replica)
        assert all(torch.equal(reader.get_full(k), kv) for k, kv in zip(keys, chunks))
        print(f"failover picked up {failover_s:.1f} s after release; {len(lost)}/{N} chunks on the dead master")
    finally:
        stop.set()
        for t in threads:
            if t.ident is not None:  # started
                t.join()
        for store in (writer, reader, hammer):
            store.close()
    assert not wrong and not raised, (wrong, raised[:3])


def test_engine_shares_a_prefix_through_the_cluster_and_survives_a_dead_master(redis_cluster, tiny_model):
    from lmcache_vericache.engine import VeriCacheEngine

    cluster = redis_cluster
    store = {"capacity": "redis_cluster", "redis_cluster_urls": cluster.url, "redis_prefix": "e2e:"}
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    with VeriCacheEngine(tiny_model, "int8", chunk_size=64, store=store) as eng:
        [first] = eng.generate([prompt], 30)
        [ref] = eng.reference([prompt], 30)
        keys = eng.chunk_keys(prompt)
    assert first.tokens == ref.tokens and first.stats.cached_chunks == 0
    with VeriCacheEngine(tiny_model, "int8", chunk_size=64, store=store) as eng:  # a second host
        [out] = eng.generate([prompt], 30)
    assert out.stats.cached_chunks == 4 and out.stats.recomputed_chunks == 0 and out.tokens == ref.tokens

    # offload: every round swaps the prefix in from the cluster, so rounds after the kill miss
    with VeriCacheEngine(tiny_model, "int8", chunk_size=64, store=store, full_kv="offload") as eng:
        own = owners(eng.store, cluster, keys)
        victim = Counter(own.values()).most_common(1)[0][0]
        cluster.hold_failovers()

        def kill_after_first_round(r) -> None:
            cluster.kill(victim)  # later rounds' swaps miss the chunks of its slots

        [out] = eng.generate([prompt], 30, draft_len=4, on_round=kill_after_first_round)
    assert out.stats.cached_chunks == 4 and out.stats.rounds > 1
    assert out.stats.recomputed_chunks > 0 and out.tokens == ref.tokens
