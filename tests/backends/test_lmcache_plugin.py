"""The in-process adapter inside a real LMCacheEngine built from configs/lmcache-vericache.yaml.

There is no GPU here, so the engine's GPU side is LMCache's mock connector (``EngineType.MOCK``),
which moves no data. :class:`CopyingMockGPUConnector` extends it to copy between the memory
objects and a CPU tensor standing in for the paged GPU KV cache, so a test can check that what
``retrieve`` writes back is bit for bit what ``store`` read. Everything between the two (token
hashing, LocalCPU allocation, the put broadcast, lookup, the async prefetch, the backend, the
store and the disk/Redis tier) is the real code.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from pathlib import Path

import pytest
import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from lmcache_vericache.backends.lmcache.plugin import VeriCacheBackend, check_backend
from lmcache_vericache.backends.store import FULL_SUFFIX
from lmcache_vericache.testing.lmcache_engine import Engines, ScheduleRecorder

YAML = Path(__file__).parents[2] / "configs" / "lmcache-vericache.yaml"
LAYERS, HEADS, HEAD_DIM = 2, 3, 8
_ids = itertools.count()


def load_config(**extra: object) -> LMCacheEngineConfig:
    cfg = LMCacheEngineConfig.from_file(str(YAML))
    cfg.extra_config.update(extra)
    return cfg


def make_metadata(cfg: LMCacheEngineConfig) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="vericache-test",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, cfg.chunk_size, HEADS, HEAD_DIM),
        chunk_size=cfg.chunk_size,
    )


@pytest.fixture
def engines():
    harness = Engines(make_metadata)
    yield harness
    harness.stop_all()


def prompt(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (num_tokens,), generator=g)
    kv = torch.randn(2, LAYERS, num_tokens, HEADS * HEAD_DIM, generator=g).to(torch.bfloat16)
    return tokens, kv


def chunk_keys(engine, tokens: torch.Tensor) -> list:
    return [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]


@pytest.fixture(params=["disk", "redis"])
def tier_config(request, tmp_path) -> dict:
    """The shipped YAML's extra_config overrides for each real capacity tier."""
    if request.param == "disk":
        return {"vericache.disk_path": str(tmp_path / "kv")}
    server = request.getfixturevalue("redis_server")
    return {
        "vericache.capacity": "redis",
        "vericache.redis_url": server.url,
        "vericache.redis_prefix": f"plugin-test-{next(_ids)}:",
    }


def test_shipped_yaml_enables_the_backend():
    cfg = LMCacheEngineConfig.from_file(str(YAML))
    assert cfg.storage_plugins == ["vericache"]
    assert cfg.extra_config["storage_plugin.vericache.module_path"] == VeriCacheBackend.__module__
    assert cfg.extra_config["storage_plugin.vericache.class_name"] == VeriCacheBackend.__name__


def test_store_then_retrieve_in_a_fresh_engine_is_bit_exact(engines, tier_config):
    """Engine A stores three chunks; the backend receives them; engine B (empty LocalCPU, same
    capacity tier, as after a restart or on another host) retrieves them through the backend."""
    cfg = load_config(**tier_config)
    tokens, kv = prompt(3 * cfg.chunk_size)

    engine_a, _ = engines.start(cfg, kv)
    backend_a = check_backend(engine_a)
    engine_a.store(tokens)
    backend_a.flush()
    keys = chunk_keys(engine_a, tokens)
    assert backend_a.stats["put_chunks"] == 3
    assert all(backend_a.store.contains(backend_a.key(k)) for k in keys)
    # the compressed copy for the drafter is there too
    assert all(backend_a.store.get_compressed(backend_a.key(k)) is not None for k in keys)
    engines.stop(engine_a)

    engine_b, conn_b = engines.start(cfg, torch.zeros_like(kv))
    backend_b = check_backend(engine_b)
    assert engine_b.lookup(tokens) == len(tokens)
    mask = engine_b.retrieve(tokens)
    assert bool(mask.all())
    assert backend_b.stats["get_chunks"] == 3
    assert torch.equal(conn_b.out.view(torch.int16), kv.view(torch.int16))


def test_async_loading_prefetches_through_the_backend(engines, tier_config):
    cfg = load_config(**tier_config)
    cfg.enable_async_loading = True
    tokens, kv = prompt(3 * cfg.chunk_size, seed=1)

    writer, _ = engines.start(cfg, kv)
    writer.store(tokens)
    check_backend(writer).flush()

    recorder = ScheduleRecorder()
    reader, conn = engines.start(cfg, torch.zeros_like(kv), async_lookup_server=recorder)
    backend = check_backend(reader)
    reader.async_lookup_and_prefetch(lookup_id="req-1", tokens=tokens)
    recorder.wait()
    assert recorder.responses == {"req-1": len(tokens)}
    mask = reader.retrieve(tokens, req_id="req-1")
    assert bool(mask.all())
    assert backend.stats["async_gets"] == 1 and backend.stats["get_chunks"] == 3
    assert torch.equal(conn.out.view(torch.int16), kv.view(torch.int16))


def test_batched_get_non_blocking_returns_only_the_hit_prefix(engines, tmp_path):
    cfg = load_config(**{"vericache.disk_path": str(tmp_path / "kv")})
    tokens, kv = prompt(3 * cfg.chunk_size, seed=2)
    engine, _ = engines.start(cfg, kv)
    backend = check_backend(engine)
    engine.store(tokens)
    backend.flush()
    keys = chunk_keys(engine, tokens)
    # Lose the middle chunk's full copy: chunk 0 is served, chunk 2 must not be.
    backend.store.capacity.delete(backend.key(keys[1]) + FULL_SUFFIX)

    objs = asyncio.run(backend.batched_get_non_blocking("lookup", keys))
    assert len(objs) == 1
    assert objs[0].get_ref_count() == 1  # the caller's reference, nothing else holds it
    assert torch.equal(objs[0].tensor.view(torch.int16), kv[:, :, : cfg.chunk_size].view(torch.int16))
    objs[0].ref_count_down()
    assert backend.stats["get_misses"] == 1


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"vericache.bogus_key": 1}, "vericache.bogus_key"),
        ({"vericache.capacity": "tape"}, "capacity"),
        ({"vericache.num_kv_heads": HEADS + 1}, "vericache.num_kv_heads"),
        ({"vericache.compressor": "no-such-method"}, "no-such-method"),
    ],
)
def test_bad_keys_are_a_visible_error_naming_the_key(engines, tmp_path, caplog, extra, named):
    cfg = load_config(**{"vericache.disk_path": str(tmp_path / "kv"), **extra})
    tokens, kv = prompt(cfg.chunk_size)
    with caplog.at_level(logging.ERROR, logger="lmcache_vericache"):
        engine, _ = engines.start(cfg, kv)
    # LMCache swallowed the constructor error and started without the backend ...
    assert not any(isinstance(b, VeriCacheBackend) for b in engine.storage_manager.storage_backends.values())
    # ... the error was logged naming the key, and check_backend fails loudly with it.
    assert any(named in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    with pytest.raises(RuntimeError, match="VeriCacheBackend") as exc:
        check_backend(engine)
    assert named in str(exc.value)


def test_cli_yaml_starts_an_engine_with_the_backend(engines, tmp_path, capsys):
    from lmcache_vericache.cli import main

    assert main(["lmcache-config", "--disk-path", str(tmp_path / "kv"), "--compressor", "int4"]) == 0
    path = tmp_path / "lmcache.yaml"
    path.write_text(capsys.readouterr().out)
    engine, _ = engines.start(LMCacheEngineConfig.from_file(str(path)), prompt(256)[1])
    assert check_backend(engine).store.compressor.name == "int4"


def test_put_queue_is_bounded_and_drops_are_counted(engines, tmp_path, monkeypatch):
    """A writer that cannot keep up (a slow tier) pins at most MAX_PENDING_PUTS LocalCPU objects;
    further puts are dropped and counted, never blocking LMCache's store path."""
    cfg = load_config(**{"vericache.disk_path": str(tmp_path / "kv")})
    tokens, kv = prompt(3 * cfg.chunk_size, seed=4)
    engine, _ = engines.start(cfg, kv)
    backend = check_backend(engine)
    release = threading.Event()
    slow_put = backend.store.put
    monkeypatch.setattr(backend.store, "put", lambda *a, **k: (release.wait(10), slow_put(*a, **k)))
    monkeypatch.setattr(backend, "MAX_PENDING_PUTS", 1)
    engine.store(tokens)  # returns at once although the writer is stuck on chunk 0
    assert backend.stats["put_dropped"] == 2
    release.set()
    backend.flush()
    stored = [backend.store.has_full(backend.key(k)) for k in chunk_keys(engine, tokens)]
    assert backend.stats["put_chunks"] == 1 and stored == [True, False, False]
