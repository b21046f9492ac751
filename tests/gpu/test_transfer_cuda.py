"""The connector's data path on a real GPU (PagedTransfer over CudaIO and TorchCuda, built by
``build_transfer`` as the connector's ``register_kv_caches`` builds it), for every vLLM KV layout,
kernel blocks smaller than vLLM's block, bf16 and fp16: ordering against a busy non-default
compute stream, pinned-pool pressure, memory held and no synchronize on the compute stream."""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_vericache import compressors
from lmcache_vericache.backends.keys import KeySpace
from lmcache_vericache.backends.store import DualTierStore
from lmcache_vericache.backends.tiers.memory import MemoryTier
from lmcache_vericache.connectors import paged_layout as pl
from lmcache_vericache.connectors.paged_transfer import ConnectorStats, LoadSpec, SaveSpec, build_transfer
from lmcache_vericache.testing.paged_caches import LAYOUTS, layout_caches, splittable

L, H, D, BLOCK, CHUNK, BLOCKS = 4, 2, 64, 32, 64, 24
CASES = [(lay, kb, dt) for lay in LAYOUTS for kb in ((None, 16) if splittable(lay) else (None,))
         for dt in (torch.bfloat16, torch.float16)]
IDS = [f"{lay}-kb{kb or BLOCK}-{str(dt)[6:]}" for lay, kb, dt in CASES]


def chunk_bytes(dtype: torch.dtype) -> int:
    return 2 * L * CHUNK * H * D * dtype.itemsize


def rig(layout: str, kernel_block: int | None, dtype: torch.dtype, slabs: int = 8):
    caches = layout_caches(layout, layers=L, heads=H, head_size=D, block_size=BLOCK, num_blocks=BLOCKS,
                           kernel_block=kernel_block, dtype=dtype, device="cuda")
    store = DualTierStore(compressors.get("int8"), MemoryTier(1 << 30), num_kv_heads=H)
    space = KeySpace(model="gpu-test", dtype=str(dtype)[6:], chunk_size=CHUNK, compressor="int8")
    t = build_transfer({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)}, lambda n: [None] * len(n),
                       store, space, num_kv_heads=H, chunk_size=CHUNK, block_size=BLOCK,
                       draft_tokens=0, load_timeout_s=30.0, pinned_pool_bytes=slabs * chunk_bytes(dtype),
                       stats=ConnectorStats())
    return caches, store, t


def stored_prompt(t, store, n_chunks: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 1000, (n_chunks * CHUNK + 1,), generator=g).tolist()
    keys = t.space.token_keys(prompt)
    fulls = [torch.randn(2, L, CHUNK, H * D, generator=g).to(dtype) for _ in keys]
    for i, (k, f) in enumerate(zip(keys, fulls)):
        store.put(k, f, start=i * CHUNK)
    return prompt, keys, fulls


def until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def read(t, blocks: list[int], n: int) -> torch.Tensor:
    """``[2, L, n, H*D]`` of the first ``n`` tokens of ``blocks``, on the host."""
    torch.cuda.synchronize()
    k, v = t.layout.gather(pl.slots_for(torch.tensor(blocks), 0, n, t.block_size))
    return torch.stack([k, v]).permute(0, 1, 3, 2, 4).reshape(2, L, n, H * D).cpu()


def blocks_for(t, first: int, n_tokens: int) -> list[int]:
    """vLLM's block ids (of BLOCK tokens, whatever the kernel block) for ``n_tokens`` from ``first``."""
    return list(range(first, first + n_tokens // BLOCK))


@pytest.mark.parametrize("layout,kernel_block,dtype", CASES, ids=IDS)
def test_a_load_lands_after_the_compute_streams_earlier_writes(compute, spin, layout, kernel_block, dtype):
    caches, store, t = rig(layout, kernel_block, dtype)
    try:
        prompt, keys, fulls = stored_prompt(t, store, 2, dtype)
        blocks = blocks_for(t, 3, 2 * CHUNK)
        spin()  # the compute stream is busy; then it writes a sentinel where the load will write
        for c in caches:
            c.fill_(7.0)
        t.load(LoadSpec("r", keys, blocks, 0, 2 * CHUNK, prompt))
        until(lambda: "r" in t.take_finished())
        assert t.take_errors() == set()
        assert torch.equal(read(t, blocks, 2 * CHUNK), torch.cat(fulls, dim=2))  # not the sentinel
    finally:
        t.close()
        store.close()


@pytest.mark.parametrize("layout,kernel_block,dtype", CASES, ids=IDS)
def test_a_save_stores_what_the_forward_wrote_last(compute, spin, layout, kernel_block, dtype):
    caches, store, t = rig(layout, kernel_block, dtype)
    try:
        prompt = list(range(CHUNK + 1))
        key = t.space.token_keys(prompt)[0]
        blocks = blocks_for(t, 5, CHUNK)
        spin()  # the "forward": busy, then it overwrites the blocks
        for c in caches:
            c.fill_(3.0)
        t.save([SaveSpec("s", [(key, 0)], blocks)])
        t.flush()
        got = store.get_full(key)
        assert got is not None and bool((got == 3.0).all())
    finally:
        t.close()
        store.close()


def test_a_two_slab_pool_serves_eight_concurrent_loads(compute):
    caches, store, t = rig("LBNHC", None, torch.bfloat16, slabs=2)
    try:
        want = {}
        for r in range(8):
            prompt, keys, fulls = stored_prompt(t, store, 1, torch.bfloat16, seed=r)
            blocks = blocks_for(t, 2 * r, CHUNK)
            want[f"r{r}"] = (blocks, torch.cat(fulls, dim=2))
            t.load(LoadSpec(f"r{r}", keys, blocks, 0, CHUNK, prompt))
        done: set[str] = set()
        until(lambda: done.update(t.take_finished()) or done == set(want))
        assert t.take_errors() == set()
        for rid, (blocks, full) in want.items():
            assert torch.equal(read(t, blocks, CHUNK), full), rid
    finally:
        t.close()
        store.close()


def test_a_load_is_not_reported_before_its_write_completed(compute, spin):
    caches, store, t = rig("LBNHC", None, torch.bfloat16, slabs=1)
    try:
        prompt, keys, _ = stored_prompt(t, store, 1, torch.bfloat16)
        spin(1500)  # the load's write waits for this
        t.load(LoadSpec("r", keys, blocks_for(t, 0, CHUNK), 0, CHUNK, prompt))
        until(lambda: t.io.pool.acquire(0) is None, timeout=1.0)  # its upload holds the one slab: in flight
        assert "r" not in t.take_finished()
        until(lambda: "r" in t.take_finished())
        assert t.take_errors() == set()
    finally:
        t.close()
        store.close()


def test_gpu_memory_held_stays_within_the_chunks_in_flight(compute):
    """Loads stage each chunk's device copy until it is written, saves their gathered chunk until it
    is copied: what the transfer holds is a few chunks, not a pool's worth."""
    slabs = 4
    caches, store, t = rig("LBNHC", None, torch.bfloat16, slabs=slabs)
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        peak = base
        for r in range(6):
            prompt, keys, _ = stored_prompt(t, store, 2, torch.bfloat16, seed=r)
            t.load(LoadSpec(f"r{r}", keys, blocks_for(t, 4 * (r % 3), 2 * CHUNK), 0, 2 * CHUNK, prompt))
        done: set[str] = set()
        while done != {f"r{r}" for r in range(6)}:
            done.update(t.take_finished())
            peak = max(peak, torch.cuda.memory_allocated())
            time.sleep(0.001)
        t.save([SaveSpec("s", [(k, i * CHUNK) for i, k in enumerate(keys)], blocks_for(t, 0, 2 * CHUNK))])
        t.flush()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - base <= chunk_bytes(torch.bfloat16)  # nothing kept
        # a load in flight holds a pinned slab: at most ``slabs`` uploaded chunks, each with its
        # K/V concatenation while it is scattered
        assert peak - base <= 2 * slabs * chunk_bytes(torch.bfloat16)
    finally:
        t.close()
        store.close()


def test_no_synchronize_on_the_compute_stream(compute):
    """The hooks vLLM calls on its thread (a load started, a save after the forward) enqueue work
    and return: CUDA's sync debug mode raises on any synchronizing call they make."""
    caches, store, t = rig("LBNHC", 16, torch.bfloat16)
    try:
        prompt, keys, _ = stored_prompt(t, store, 1, torch.bfloat16)
        save_key = t.space.token_keys(list(range(CHUNK + 1)))[0]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            t.load(LoadSpec("r", keys, blocks_for(t, 0, CHUNK), 0, CHUNK, prompt))
            t.save([SaveSpec("s", [(save_key, 0)], blocks_for(t, 8, CHUNK))])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        until(lambda: "r" in t.take_finished())
        assert t.take_errors() == set()  # a synchronize in the loader would fail the load, not the test
        t.flush()
        assert store.get_full(save_key) is not None and t.stats.save_errors == 0
    finally:
        t.close()
        store.close()
