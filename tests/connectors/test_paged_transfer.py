"""PagedTransfer loads from a real dual-tier store into paged caches in vLLM's CPU layout."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from lmcache_vericache import compressors
from lmcache_vericache.backends.keys import KeySpace
from lmcache_vericache.backends.store import DualTierStore
from lmcache_vericache.backends.tiers.memory import MemoryTier
from lmcache_vericache.connectors import paged_layout as pl
from lmcache_vericache.connectors.kv_layout import CpuBlockLayout
from lmcache_vericache.connectors.load_drafter import LoadDrafter
from lmcache_vericache.connectors.model_guard import ModelGuard
from lmcache_vericache.connectors.paged_transfer import ConnectorStats, LoadSpec, PagedTransfer
from lmcache_vericache.engine import Runtime

pytest.importorskip("vllm._custom_ops")  # the layout probe runs vLLM's cache-write op
LAYERS, HEADS, HEAD, BLOCK, CHUNK = 2, 2, 64, 16, 32


def test_a_drafting_failure_does_not_fail_the_load(tiny_model, caplog):
    """The registered drafter cannot take these chunks (its model has head size 16, the chunks 64):
    drafting fails for real, the full chunks still load, every position exact, no block reported
    failed (a failed draft once failed the whole load and vLLM recomputed the prefix)."""
    g = torch.Generator().manual_seed(0)
    store = DualTierStore(compressors.get("int8"), MemoryTier(1 << 30), num_kv_heads=HEADS)
    space = KeySpace(model="test", dtype="float32", chunk_size=CHUNK, compressor=store.compressor.name)
    prompt = torch.randint(0, 256, (2 * CHUNK + 5,), generator=g).tolist()
    keys = space.token_keys(prompt[:2 * CHUNK])
    fulls = [torch.randn(2, LAYERS, CHUNK, HEADS * HEAD, generator=g) for _ in keys]
    for i, (key, full) in enumerate(zip(keys, fulls)):
        store.put(key, full, start=i * CHUNK)
    caches = [torch.zeros(8, HEADS, BLOCK, 2 * HEAD) for _ in range(LAYERS)]
    stats = ConnectorStats()
    drafter = LoadDrafter(ModelGuard())
    drafter.attach(Runtime(tiny_model))
    transfer = PagedTransfer(store, space, CHUNK, BLOCK, CpuBlockLayout(caches, lambda: ["vec"] * LAYERS), draft_tokens=8,
                             load_timeout_s=30, stats=stats, drafter=drafter)
    blocks = [5, 2, 7, 0, 3]  # 69 positions, not in order
    try:
        with caplog.at_level(logging.WARNING):
            transfer.load(LoadSpec("r", keys, blocks, 0, 2 * CHUNK, prompt))
            deadline = time.monotonic() + 30
            while "r" not in transfer.take_finished():
                assert time.monotonic() < deadline, "the load never finished"
                time.sleep(0.01)
    finally:
        transfer.close()
        store.close()
    assert "no drafts during the load of r" in caplog.text
    assert transfer.take_errors() == set()
    assert (stats.loads, stats.loaded_chunks, stats.failed_chunks, stats.compressed_chunks) == (1, 2, 0, 0)
    slots = pl.slots_for(torch.tensor(blocks), 0, 2 * CHUNK, BLOCK)
    for li, cache in enumerate(caches):
        k, v = pl.gather(cache, pl.layout_for(cache, "vec"), slots)
        want = torch.cat(fulls, dim=2)[:, li].view(2, 2 * CHUNK, HEADS, HEAD).transpose(1, 2)
        assert torch.equal(k, want[0]) and torch.equal(v, want[1])


def test_build_transfer_sorts_layers_by_index_and_checks_heads(tmp_path):
    """The worker's transfer, built without vLLM from the caches vLLM registers (what the
    connector's ``register_kv_caches`` calls): layers in index order (``layers.10`` after
    ``layers.2``), a head count other than the model's refused by name."""
    from lmcache_vericache.backends import StoreConfig
    from lmcache_vericache.backends.keys import KeySpace
    from lmcache_vericache.connectors.paged_transfer import ConnectorStats, build_transfer

    caches = {f"model.layers.{i}.self_attn.attn": torch.full((4, 2, 128, 64), float(i)) for i in (10, 2, 0)}
    store = StoreConfig.parse({"num_kv_heads": 2}).build()
    space = KeySpace(model="m", dtype="float32", chunk_size=128, compressor="int8")
    common = dict(chunk_size=128, block_size=128, draft_tokens=0, load_timeout_s=5.0, pinned_pool_bytes=1 << 20,
                  stats=ConnectorStats())
    try:
        t = build_transfer(caches, lambda names: ["vec"] * len(names), store, space, num_kv_heads=2, **common)
        assert [float(x[0, 0, 0, 0]) for x in t.layout.layers] == [0.0, 2.0, 10.0]
        with pytest.raises(ValueError, match="has 2 heads per rank, the model config 3"):
            build_transfer(caches, lambda names: ["vec"] * len(names), store, space, num_kv_heads=3, **common)
    finally:
        store.close()


def test_a_save_of_a_chunk_a_memory_store_holds_is_skipped_before_its_gather():
    """With ``capacity: memory`` the scheduler (another process under vLLM's multiprocessing) cannot
    see what the worker's store holds and plans every prompt chunk again each time a prompt comes back;
    the worker skips those before gathering them on vLLM's thread (each one once cost a gather)."""
    from lmcache_vericache.connectors.paged_transfer import SaveSpec

    class CountingLayout(CpuBlockLayout):
        gathers = 0

        def gather(self, slots):
            CountingLayout.gathers += 1
            return super().gather(slots)

    store = DualTierStore(compressors.get("int8"), MemoryTier(1 << 30), num_kv_heads=HEADS)
    space = KeySpace(model="test", dtype="float32", chunk_size=CHUNK, compressor=store.compressor.name)
    keys = space.token_keys(list(range(2 * CHUNK)))
    caches = [torch.randn(8, HEADS, BLOCK, 2 * HEAD) for _ in range(LAYERS)]
    stats = ConnectorStats()
    transfer = PagedTransfer(store, space, CHUNK, BLOCK, CountingLayout(caches, lambda: ["vec"] * LAYERS),
                             draft_tokens=0, load_timeout_s=30, stats=stats)
    try:
        transfer.save([SaveSpec("a", [(keys[0], 0)], [5, 2, 7, 0])])
        transfer.flush()
        assert stats.saved_chunks == 1 and store.has_full(keys[0]) and CountingLayout.gathers == 1
        transfer.save([SaveSpec("b", [(keys[0], 0), (keys[1], CHUNK)], [5, 2, 7, 0])])  # the same prompt again
        transfer.flush()
        assert stats.saved_chunks == 2 and store.has_full(keys[1]) and CountingLayout.gathers == 2  # keys[1] only
    finally:
        transfer.close()
        store.close()
