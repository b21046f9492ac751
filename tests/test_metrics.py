"""Prometheus metrics (docs/operations.md#metrics) read from the package registry equal the stats they
mirror: a real store on a real disk tier, the engine on the tiny model, the LMCache adapters. The
registry is process-wide, so every check compares deltas (after minus before)."""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path

import pytest
import torch

from lmcache_vericache import compressors, metrics
from lmcache_vericache.backends import DiskTier, DualTierStore
from lmcache_vericache.backends.store import FULL_SUFFIX
from lmcache_vericache.engine import VeriCacheEngine

TIER = "disk"
STORE = {  # StoreStats field -> (metric, labels beyond tier)
    "full_hits": ("vericache_store_hits_total", {"path": "full"}),
    "compressed_misses": ("vericache_store_misses_total", {"path": "compressed"}),
    "full_misses": ("vericache_store_misses_total", {"path": "full"}),
    "corrupt": ("vericache_store_rejected_total", {"reason": "corrupt"}),
    "unauthenticated": ("vericache_store_rejected_total", {"reason": "unauthenticated"}),
    "invalid": ("vericache_store_rejected_total", {"reason": "invalid"}),
    "cancelled": ("vericache_store_cancelled_reads_total", {}),
    "puts": ("vericache_store_puts_total", {}),
    "put_errors": ("vericache_store_put_errors_total", {}),
    "bytes_read": ("vericache_store_read_bytes_total", {}),
    "bytes_written": ("vericache_store_written_bytes_total", {}),
}
HISTOGRAMS = ("vericache_store_full_read_seconds", "vericache_store_put_seconds")
ENGINE = ("requests_total", "rounds_total", "drafted_tokens_total", "emitted_tokens_total", "swap_seconds_total",
          "recomputed_chunks_total", "cached_chunks_total", "accepted_tokens_sum", "accepted_tokens_count",
          "swap_wait_seconds_sum", "swap_wait_seconds_count")


def value(name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def snapshot() -> dict[str, float]:
    snap = {f: value(name, tier=TIER, **lab) for f, (name, lab) in STORE.items()}
    snap["compressed_hits"] = sum(value("vericache_store_hits_total", tier=TIER, path=p)
                                  for p in ("compressed_hot", "compressed_tier"))
    for p in ("compressed_hot", "compressed_tier"):
        snap[p] = value("vericache_store_hits_total", tier=TIER, path=p)
    for h in HISTOGRAMS:
        snap[h] = value(h + "_count", tier=TIER)
    for state in ("queued", "reading"):
        snap[state] = value("vericache_store_prefetch_reads", tier=TIER, state=state)
    snap.update({e: value("vericache_engine_" + e) for e in ENGINE})
    return snap


def delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in snapshot().items()}


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_engine_and_store_metrics_equal_their_stats(tiny_model, tmp_path, one_thread):
    """Two generates (the second finds the prompts' prefixes in the store) with two full chunks
    damaged in between: every counter moved exactly as the store's and the requests' stats."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (300, 200)]
    before = snapshot()
    eng = VeriCacheEngine(tiny_model, "streamingllm", {"keep_ratio": 0.25}, chunk_size=64, draft_len=6,
                          store={"capacity": "disk", "disk_path": str(tmp_path)}, full_kv="offload")
    results = eng.generate(prompts, 30)
    for key in eng.chunk_keys(prompts[0])[:2]:  # flip a byte in two full-chunk files
        f = eng.store.capacity._file(key + FULL_SUFFIX)
        raw = bytearray(f.read_bytes())
        raw[-7] ^= 0x40
        f.write_bytes(bytes(raw))
    results += eng.generate(prompts, 30)
    stats, d = eng.store.stats, delta(before)
    eng.close()

    for field in (*STORE, "compressed_hits"):
        assert d[field] == getattr(stats, field), field
    assert stats.corrupt == 2 and stats.puts > 0 and stats.full_hits > 0
    assert d["vericache_store_full_read_seconds"] == stats.full_hits + stats.full_misses
    assert d["vericache_store_put_seconds"] == stats.puts + stats.put_errors
    assert d["queued"] == d["reading"] == 0  # every prefetch finished

    rs = [r.stats for r in results]
    assert rs[2].cached_chunks > 0 and rs[2].recomputed_chunks == 2  # corrupt: deleted, recomputed once, put back
    assert d["requests_total"] == 4
    assert d["rounds_total"] == d["accepted_tokens_count"] == sum(s.rounds for s in rs)
    assert d["accepted_tokens_sum"] == sum(sum(s.accepted) for s in rs)
    assert d["drafted_tokens_total"] == sum(sum(s.drafted) for s in rs)
    assert d["emitted_tokens_total"] == sum(s.new_tokens for s in rs) == 4 * 30
    assert d["recomputed_chunks_total"] == sum(s.recomputed_chunks for s in rs)
    assert d["cached_chunks_total"] == sum(s.cached_chunks for s in rs)
    assert d["swap_wait_seconds_count"] == sum(s.rounds for s in rs)  # every round swapped a prefix in
    assert d["swap_wait_seconds_sum"] == pytest.approx(sum(s.swap_wait_s for s in rs))
    assert d["swap_seconds_total"] == pytest.approx(sum(s.swap_s for s in rs))


def test_store_paths_and_a_corrupt_full_chunk(tmp_path):
    full = torch.randn(2, 2, 16, 3 * 8, generator=torch.Generator().manual_seed(0))
    before = snapshot()
    with DualTierStore(compressors.get("int8"), DiskTier(tmp_path), num_kv_heads=3) as a:
        a.put("k", full)
        assert a.get_compressed("k") is not None  # hot
        with DualTierStore(compressors.get("int8"), DiskTier(tmp_path), num_kv_heads=3) as b:
            assert b.get_compressed("k") is not None and b.get_compressed("k") is not None  # tier, then hot
            f = b.capacity._file("k" + FULL_SUFFIX)
            f.write_bytes(f.read_bytes()[:-100])
            assert b.prefetch(["k"]).wait(0) is None
            stats = [a.stats, b.stats]
    d = delta(before)
    assert (d["compressed_hot"], d["compressed_tier"]) == (2, 1)
    assert d["corrupt"] == 1 and d["full_misses"] == 1 and d["puts"] == 1
    for field in STORE:
        assert d[field] == sum(getattr(s, field) for s in stats), field


def test_l2_adapter_counters_equal_report_status(tmp_path):
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    from lmcache_vericache.backends.lmcache.l2_adapter import VeriCacheL2Adapter, VeriCacheL2AdapterConfig

    def obj(t):
        meta = MemoryObjMetadata(t.shape, t.dtype, 0, t.numel() * t.element_size(), 1, fmt=MemoryFormat.KV_2LTD)
        return TensorMemoryObj(raw_data=t, metadata=meta, parent_allocator=None)

    names = ("stored_chunks", "store_failures", "lookups", "lookup_hits", "loaded_chunks", "load_misses")
    before = {n: value(f"vericache_l2_{n}_total") for n in names}
    adapter = VeriCacheL2Adapter(VeriCacheL2AdapterConfig.from_dict(
        {"capacity": "disk", "disk_path": str(tmp_path), "num_kv_heads": 3}))
    try:
        keys = [ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name="m", kv_rank=0) for i in range(3)]
        data = torch.randn(2, 2, 16, 24).to(torch.bfloat16)
        adapter._store(keys[:2], [obj(data.clone()), obj(data.clone())])
        assert adapter._lookup(keys, {0: MemoryLayoutDesc([data.shape], [data.dtype])}).get_indices_list() == [0, 1]
        adapter._load(keys, [obj(torch.zeros_like(data)) for _ in keys])
        status = adapter.report_status()
    finally:
        adapter.close()
    assert (status["stored_chunks"], status["lookup_hits"], status["loaded_chunks"]) == (2, 2, 2)
    assert {n: value(f"vericache_l2_{n}_total") - before[n] for n in names} == {n: status[n] for n in names}


def test_lmcache_plugin_counters_equal_its_stats(tmp_path):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from lmcache_vericache.backends.lmcache.plugin import check_backend
    from lmcache_vericache.testing.lmcache_engine import Engines

    cfg = LMCacheEngineConfig.from_file(str(Path(__file__).parents[1] / "configs" / "lmcache-vericache.yaml"))
    cfg.extra_config.update({"vericache.disk_path": str(tmp_path)})
    harness = Engines(lambda c: LMCacheMetadata(
        model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
        kv_shape=(2, 2, c.chunk_size, 3, 8), chunk_size=c.chunk_size))
    names = ("put_chunks", "put_errors", "put_dropped", "get_chunks", "get_misses")
    before = {n: value(f"vericache_lmcache_{n}_total") for n in names}
    try:
        tokens = torch.randint(0, 50_000, (2 * cfg.chunk_size,))
        kv = torch.randn(2, 2, len(tokens), 24).to(torch.bfloat16)
        engine_a, _ = harness.start(cfg, kv)
        backend_a = check_backend(engine_a)
        engine_a.store(tokens)
        backend_a.flush()
        harness.stop(engine_a)
        engine_b, _ = harness.start(cfg, torch.zeros_like(kv))
        backend_b = check_backend(engine_b)
        assert bool(engine_b.retrieve(tokens).all())
    finally:
        harness.stop_all()
    assert backend_a.stats["put_chunks"] == 2 and backend_b.stats["get_chunks"] == 2
    assert {n: value(f"vericache_lmcache_{n}_total") - before[n] for n in names} == \
        {n: backend_a.stats[n] + backend_b.stats[n] for n in names}


def test_serve_answers_http_with_the_documented_names():
    server = metrics.serve(0)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    for name in ("vericache_store_hits_total", "vericache_store_full_read_seconds", "vericache_store_prefetch_reads",
                 "vericache_engine_accepted_tokens", "vericache_engine_swap_wait_seconds",
                 "vericache_engine_emitted_tokens_total", "vericache_l2_lookup_hits_total",
                 "vericache_lmcache_put_dropped_total"):
        assert f"# TYPE {name} " in text and f"# HELP {name} " in metrics.render()
    # every metric has help text and is in docs/operations.md's table, and the table names no other
    readme = (Path(__file__).parents[1] / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"^\| `(vericache_\w+)`", readme, re.M))
    for prefix, alts in re.findall(r"^\| `(vericache_\w+_)\{([\w,]+)\}_total`", readme, re.M):
        documented |= {f"{prefix}{a}_total" for a in alts.split(",")}
    defined = set()
    for metric in metrics.registry.collect():
        assert metric.documentation, metric.name
        defined.add(metric.name + ("_total" if metric.type == "counter" else ""))
    assert defined == documented


def test_generate_metrics_port_is_checked_before_the_model_loads(capsys, monkeypatch):
    from lmcache_vericache import models
    from lmcache_vericache.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["generate", "--metrics-port", "70000"]) == 2
    assert "--metrics-port must be in 1..65535" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["generate", "--metrics-port", str(busy.getsockname()[1])]) == 2
    assert "vericache generate: error:" in capsys.readouterr().err
