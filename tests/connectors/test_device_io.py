"""CudaIO's ordering contract, driven through PagedTransfer with a real store and vLLM-allocated
caches: the streams and events are a recording fake (no GPU here), everything else is real.
Events complete only when the test says so (or when the host synchronizes on one), so "reported
before the device finished" cannot pass by luck."""

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
from lmcache_vericache.connectors.device_io import CudaIO  # noqa: E402
from lmcache_vericache.connectors.kv_layout import LogicalLayout  # noqa: E402
from lmcache_vericache.connectors.paged_transfer import ConnectorStats, LoadSpec, PagedTransfer, SaveSpec  # noqa: E402
from lmcache_vericache.testing.paged_caches import backend_kv, vllm_caches  # noqa: E402
from lmcache_vericache.testing.streams import FakeStreams  # noqa: E402

L, H, D, BLOCK, CHUNK = 3, 2, 8, 16, 32


def chunk_bytes(caches) -> int:
    return 2 * L * CHUNK * H * D * caches[0].element_size()


def rig(slabs: int = 8):
    store = DualTierStore(compressors.get("int8"), MemoryTier(1 << 30), num_kv_heads=H)
    caches = vllm_caches(KVCacheLayout.LBNHC, layers=L, heads=H, head_size=D, block_size=BLOCK, num_blocks=10)
    fake = FakeStreams()
    layout = LogicalLayout(caches)
    gather, scatter = layout.gather, layout.scatter
    layout.gather = lambda *a: (fake.note("gather"), gather(*a))[1]  # noqa: E731 (to see where it runs)
    layout.scatter = lambda *a: (fake.note("scatter"), scatter(*a))[1]  # noqa: E731
    space = KeySpace(model="test", dtype="float32", chunk_size=CHUNK, compressor="int8")
    io = CudaIO(fake, chunk_bytes(caches), slabs * chunk_bytes(caches), wait_s=5)
    t = PagedTransfer(store, space, CHUNK, BLOCK, layout, 0, 30, ConnectorStats(), io=io)
    return store, caches, fake, t


def until(cond, timeout: float = 30) -> None:  # liveness only: a loaded host is slow
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_load_writes_after_compute_and_is_reported_after_its_event():
    store, caches, fake, t = rig()
    prompt = list(range(2 * CHUNK + 1))
    keys = t.space.token_keys(prompt)
    fulls = [torch.randn(2, L, CHUNK, H * D) for _ in keys]
    for i, (k, f) in enumerate(zip(keys, fulls)):
        store.put(k, f, start=i * CHUNK)
    blocks = [3, 8, 1, 6]
    try:
        t.load(LoadSpec("r", keys, blocks, 0, 2 * CHUNK, prompt))
        until(lambda: len(fake.ops("record")) == 3)  # the compute mark + one event per chunk
        time.sleep(0.05)
        assert t.take_finished() == set()  # written on the "device", not completed there yet
        fake.complete()
        assert t.take_finished() == {"r"}
    finally:
        t.close()
        store.close()
    mark, *rest = fake.log
    assert mark[:2] == ("record", "compute")  # taken on vLLM's thread, on the compute stream
    for i in range(2):  # per chunk, on the load stream: wait for compute, H2D, scatter, event
        wait, h2d, scatter, event = rest[4 * i:4 * i + 4]
        assert [e[0] for e in (wait, h2d, scatter, event)] == ["wait", "h2d", "scatter", "record"]
        assert wait[2] == mark[2] and len({wait[1], h2d[1], scatter[1], event[1]}) == 1 and wait[1] != "compute"
    slots = pl.slots_for(torch.tensor(blocks), 0, 2 * CHUNK, BLOCK)
    want = torch.cat(fulls, dim=2).view(2, L, 2 * CHUNK, H, -1).transpose(2, 3)
    for li in range(L):
        k, v = backend_kv(caches[li], slots)
        assert torch.equal(k, want[0, li]) and torch.equal(v, want[1, li])


def test_a_load_waits_for_a_pinned_slab_until_an_earlier_copy_completed():
    store, caches, fake, t = rig(slabs=1)
    prompt = list(range(2 * CHUNK + 1))
    keys = t.space.token_keys(prompt)
    for i, k in enumerate(keys):
        store.put(k, torch.randn(2, L, CHUNK, H * D), start=i * CHUNK)
    try:
        t.load(LoadSpec("r", keys, [0, 1, 2, 3], 0, 2 * CHUNK, prompt))
        until(lambda: len(fake.ops("h2d")) == 1)
        time.sleep(0.1)
        assert len(fake.ops("h2d")) == 1  # one slab, its copy in flight: the second chunk waits
        fake.complete()
        until(lambda: len(fake.ops("h2d")) == 2)
        fake.complete()
        until(lambda: "r" in t.take_finished())
        assert t.take_errors() == set()
    finally:
        t.close()
        store.close()


def test_a_save_gathers_on_compute_and_is_put_after_its_copy_completed():
    store, caches, fake, t = rig()
    prompt = list(range(CHUNK))
    key = t.space.token_keys(prompt)[0]
    puts = []
    put = store.put
    store.put = lambda *a, **kw: (fake.note("put"), puts.append(a[0]), put(*a, **kw))  # noqa: E731
    try:
        t.save([SaveSpec("s", [(key, 0)], [5, 2])])
        t.flush()
    finally:
        t.close()
    names = [e[0] for e in fake.log]
    assert names == ["gather", "record", "wait", "d2h", "keep", "record", "sync", "put"]
    gather, mark, wait, d2h, keep, event, sync, _ = fake.log
    assert gather[1] == mark[1] == "compute" and wait[2] == mark[2]
    assert wait[1] == d2h[1] == event[1] != "compute" and sync[2] == event[2]
    assert keep[2] == d2h[1]  # the gathered chunk is the save stream's until its copy completed, not until put
    assert puts == [key]
    got = store.get_full(key)
    store.close()
    k, v = backend_kv(caches[1], pl.slots_for(torch.tensor([5, 2]), 0, CHUNK, BLOCK))
    assert torch.equal(got[0, 1].view(CHUNK, H, -1).transpose(0, 1), k)
    assert torch.equal(got[1, 1].view(CHUNK, H, -1).transpose(0, 1), v)


@pytest.mark.parametrize("what", ["load", "save"])
def test_a_failed_copy_frees_its_slab_only_after_what_was_enqueued_before_the_error(what):
    # An upload (or download) may be in flight when the next step fails: the slab it reads must not
    # be handed to another copy before the device finished with it.
    store, caches, fake, t = rig(slabs=1)
    io = t.io
    store.close()
    t.close()

    def broken(*_):
        raise RuntimeError("failed after the copy was enqueued")

    with pytest.raises(RuntimeError, match="after the copy"):
        if what == "load":
            io.load(torch.randn(2, L, CHUNK, H * D), None, broken)
        else:
            fake.d2h = lambda host, dev: (FakeStreams.d2h(fake, host, dev), broken())
            io.save(lambda: torch.randn(2, L, CHUNK, H * D))
    assert io.pool.acquire(0) is None  # the slab waits for the failed copy's event
    fake.complete()
    assert io.pool.acquire(0) is not None


def test_a_save_dropped_on_a_full_queue_does_not_wait_on_vllms_thread(monkeypatch):
    # The writer is stuck in a slow put and the queue holds one save: the next is dropped. Its slab
    # comes back after its copy's event, without a synchronize on the calling (vLLM's) thread.
    import threading

    from lmcache_vericache.connectors import paged_transfer

    monkeypatch.setattr(paged_transfer, "SAVE_QUEUE", 1)  # before the writer starts on its queue
    store, caches, fake, t = rig(slabs=4)
    stuck = threading.Event()
    put = store.put
    store.put = lambda *a, **kw: (stuck.wait(10), put(*a, **kw))[1]  # noqa: E731
    keys = t.space.token_keys(list(range(4 * CHUNK)))
    try:
        blocks = list(range(6))
        t.save([SaveSpec("s", [(keys[0], 0)], blocks)])
        until(lambda: len(fake.ops("sync")) == 1)  # the writer took it, waited for its copy, is stuck in put
        t.save([SaveSpec("s", [(keys[1], CHUNK), (keys[2], 2 * CHUNK)], blocks)])
        assert t.stats.save_dropped == 1
        assert len(fake.ops("sync")) == 1  # still only the writer's: the drop did not wait
        fake.complete()
        assert len({t.io.pool.acquire(0), t.io.pool.acquire(0)} - {None}) == 2  # the dropped slab is back
    finally:
        stuck.set()
        t.close()
        store.close()


def test_a_pool_smaller_than_one_chunk_fails_naming_the_option():
    with pytest.raises(ValueError, match="pinned_pool_bytes"):
        CudaIO(FakeStreams(), chunk_bytes=1 << 20, pool_bytes=1 << 19, wait_s=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.BLHNC], ids=lambda x: x.name)
def test_cuda_round_trip_through_pinned_memory_and_streams(layout):
    """On a GPU: the real streams, events and pinned pool save chunks out of vLLM-allocated CUDA
    caches and load them into others, exactly (the backends' split as the oracle)."""
    from lmcache_vericache.connectors.device_io import TorchCuda

    store = DualTierStore(compressors.get("int8"), MemoryTier(1 << 30), num_kv_heads=H)
    shape = dict(layers=L, heads=H, head_size=D, block_size=BLOCK, num_blocks=10, device="cuda")
    src, dst = vllm_caches(layout, seed=1, **shape), vllm_caches(layout, seed=2, **shape)
    dst_before = [c.clone() for c in dst]
    space = KeySpace(model="test", dtype="float32", chunk_size=CHUNK, compressor="int8")

    def transfer(caches):
        io = CudaIO(TorchCuda(caches[0].device), chunk_bytes(caches), 4 * chunk_bytes(caches), wait_s=10)
        return PagedTransfer(store, space, CHUNK, BLOCK, LogicalLayout(caches), 0, 30, ConnectorStats(), io=io)

    prompt = list(range(2 * CHUNK + 1))
    keys = space.token_keys(prompt)
    saver, loader = transfer(src), transfer(dst)
    try:
        saver.save([SaveSpec("a", [(keys[0], 0), (keys[1], CHUNK)], [6, 0, 3, 8])])
        saver.flush()
        loader.load(LoadSpec("b", keys, [1, 9, 4, 5], CHUNK // 2 + 3, 2 * CHUNK, prompt))
        until(lambda: "b" in loader.take_finished())
        assert loader.take_errors() == set()
    finally:
        saver.close()
        loader.close()
        store.close()
    start = CHUNK // 2 + 3
    got = pl.slots_for(torch.tensor([1, 9, 4, 5]), start, 2 * CHUNK, BLOCK).cuda()
    want = pl.slots_for(torch.tensor([6, 0, 3, 8]), start, 2 * CHUNK, BLOCK).cuda()
    kept = pl.slots_for(torch.tensor([1, 9, 4, 5]), 0, start, BLOCK).cuda()
    for li in range(L):
        assert all(torch.equal(a, b) for a, b in zip(backend_kv(dst[li], got), backend_kv(src[li], want)))
        assert all(torch.equal(a, b) for a, b in zip(backend_kv(dst[li], kept), backend_kv(dst_before[li], kept)))
