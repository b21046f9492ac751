"""Worker threads run PyTorch on one thread each, the serving thread keeps its cores (workers.py)."""

import threading

import torch

from lmcache_vericache import compressors
from lmcache_vericache.backends import DualTierStore
from lmcache_vericache.backends.tiers import MemoryTier
from lmcache_vericache.engine import swap


def test_worker_pools_run_torch_on_one_thread_and_leave_the_callers_count():
    threads = torch.get_num_threads()
    store = DualTierStore(compressors.get("int8"), MemoryTier(1 << 20), num_kv_heads=2)
    try:
        for pool in (swap._SWAP_POOL, store._pool, store._ckv_pool):
            assert pool.submit(lambda: (torch.randn(1 << 20).sum(), torch.get_num_threads())[1]).result() == 1
    finally:
        store.close()
    assert torch.get_num_threads() == threads
    seen = []
    def plain():  # a thread of the caller's own: untouched
        torch.randn(1 << 20).sum()
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=plain)
    t.start()
    t.join()
    assert seen == [threads]
