"""The connector's KV layout strategies on vLLM's own paged caches: the logical view on all six
``KVCacheLayout``s (allocated and viewed by vLLM's ``allocate_kv_cache``, as its GPU workers do),
checked against the attention backends' K/V split, and save -> store -> load round trips through
PagedTransfer and a real store. The CPU tile probe's own tests are test_paged_layout.py."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from lmcache_vericache import compressors  # noqa: E402
from lmcache_vericache.backends.keys import KeySpace  # noqa: E402
from lmcache_vericache.backends.store import DualTierStore  # noqa: E402
from lmcache_vericache.backends.tiers.memory import MemoryTier  # noqa: E402
from lmcache_vericache.connectors import paged_layout as pl  # noqa: E402
from lmcache_vericache.connectors.kv_layout import CpuBlockLayout, LogicalLayout, layout_for  # noqa: E402
from lmcache_vericache.connectors.paged_transfer import ConnectorStats, LoadSpec, PagedTransfer, SaveSpec  # noqa: E402
from lmcache_vericache.testing import paged_caches  # noqa: E402
from lmcache_vericache.testing.paged_caches import backend_kv  # noqa: E402

L, H, D, BLOCK, NUM_BLOCKS, CHUNK = 3, 2, 8, 16, 10, 32
LAYOUTS = list(KVCacheLayout)
# vLLM splits a block into kernel blocks only where a block is one dense page.
SPLIT = [(lay, None) for lay in LAYOUTS] + [(lay, 8) for lay in LAYOUTS if lay.is_layer_compact and lay.is_block_compact]


def vllm_caches(layout: KVCacheLayout, kernel_block: int | None = None, dtype=torch.float32) -> list[torch.Tensor]:
    return paged_caches.vllm_caches(layout, layers=L, heads=H, head_size=D, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                                    kernel_block=kernel_block, dtype=dtype, seed=len(layout.name) + layout.value[1])


@pytest.mark.parametrize("layout,kernel_block", SPLIT, ids=lambda x: getattr(x, "name", str(x)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_logical_layout_reads_and_writes_what_the_backends_read(layout, kernel_block, dtype):
    caches = vllm_caches(layout, kernel_block, dtype)
    kv = LogicalLayout(caches)
    assert kv.shared  # vLLM's one buffer: one index op for all layers
    before = [c.clone() for c in caches]
    slots = pl.slots_for(torch.tensor([7, 2, 9]), 5, 40, BLOCK)
    k, v = kv.gather(slots)
    for li, c in enumerate(caches):
        want_k, want_v = backend_kv(c, slots)
        assert torch.equal(k[li], want_k) and torch.equal(v[li], want_v)
    new_k, new_v = torch.randn(k.shape).to(dtype), torch.randn(v.shape).to(dtype)
    kv.scatter(slots, new_k, new_v)
    written = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    written[slots] = True
    for li, (c, old) in enumerate(zip(caches, before)):
        got_k, got_v = backend_kv(c, slots)
        assert torch.equal(got_k, new_k[li]) and torch.equal(got_v, new_v[li])
        rest = torch.arange(NUM_BLOCKS * BLOCK)[~written]
        assert all(torch.equal(a, b) for a, b in zip(backend_kv(c, rest), backend_kv(old, rest)))


def test_layers_in_separate_allocations_are_indexed_one_by_one():
    caches = [c.clone() for c in vllm_caches(KVCacheLayout.LBNHC)]  # own storage each, strides kept
    kv = LogicalLayout(caches)
    assert not kv.shared and len(kv.groups) == L
    slots = pl.slots_for(torch.tensor([4, 1]), 3, 30, BLOCK)
    new_k, new_v = torch.randn(L, H, 27, D), torch.randn(L, H, 27, D)
    kv.scatter(slots, new_k, new_v)
    k, v = kv.gather(slots)
    assert torch.equal(k, new_k) and torch.equal(v, new_v)
    assert torch.equal(backend_kv(caches[2], slots)[1], new_v[2])


def test_the_strategy_follows_the_cache_device():
    cpu = [torch.zeros(4, H, BLOCK, 2 * D) for _ in range(L)]
    assert isinstance(layout_for(cpu, lambda: ["vec"] * L), CpuBlockLayout)
    assert isinstance(layout_for(vllm_caches(KVCacheLayout.LBHNC), lambda: [None] * L), CpuBlockLayout)
    with pytest.raises(RuntimeError, match="no 'isa'"):  # a CPU cache without vLLM's CPU backend
        layout_for(cpu, lambda: [None] * L).gather(torch.arange(4))


def wait_finished(t: PagedTransfer, rid: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while rid not in t.take_finished():
        assert time.monotonic() < deadline, f"the load of {rid} never finished"
        time.sleep(0.01)


def transfer(store: DualTierStore, caches: list[torch.Tensor]) -> PagedTransfer:
    space = KeySpace(model="test", dtype=str(caches[0].dtype), chunk_size=CHUNK, compressor=store.compressor.name)
    return PagedTransfer(store, space, CHUNK, BLOCK, LogicalLayout(caches), draft_tokens=0, load_timeout_s=30,
                         stats=ConnectorStats())


@pytest.mark.parametrize("layout,kernel_block", SPLIT, ids=lambda x: getattr(x, "name", str(x)))
def test_save_store_load_round_trip(layout, kernel_block):
    """Chunks saved from random blocks of one cache load into other random blocks of a second one
    from a mid-chunk start (the blocks before it are vLLM's own, shared: never written); every
    position loaded reads back, through the backends' split, as it was saved."""
    store = DualTierStore(compressors.get("int8"), MemoryTier(1 << 30), num_kv_heads=H)
    src, dst = vllm_caches(layout, kernel_block), vllm_caches(layout, kernel_block)
    dst_before = [c.clone() for c in dst]
    prompt = list(range(100, 100 + 2 * CHUNK + 3))
    saver, loader = transfer(store, src), transfer(store, dst)
    keys = saver.space.token_keys(prompt)
    src_blocks, dst_blocks = [6, 0, 3, 8], [1, 9, 4, 5]
    try:
        saver.save([SaveSpec("a", [(keys[0], 0), (keys[1], CHUNK)], src_blocks)])
        saver.flush()
        assert saver.stats.saved_chunks == 2 and all(store.has_full(k) for k in keys)
        start = CHUNK // 2 + 3  # mid-chunk and mid-block
        loader.load(LoadSpec("b", keys, dst_blocks, start, 2 * CHUNK, prompt))
        wait_finished(loader, "b")
        assert loader.take_errors() == set()
    finally:
        saver.close()
        loader.close()
        store.close()
    src_slots = pl.slots_for(torch.tensor(src_blocks), start, 2 * CHUNK, BLOCK)
    dst_slots = pl.slots_for(torch.tensor(dst_blocks), start, 2 * CHUNK, BLOCK)
    untouched = pl.slots_for(torch.tensor(dst_blocks), 0, start, BLOCK)
    for li in range(L):
        assert all(torch.equal(a, b) for a, b in zip(backend_kv(dst[li], dst_slots), backend_kv(src[li], src_slots)))
        assert all(torch.equal(a, b) for a, b in zip(backend_kv(dst[li], untouched), backend_kv(dst_before[li], untouched)))
