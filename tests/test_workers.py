"""Worker threads run PyTorch on one thread each, the serving thread keeps its cores (workers.py)."""

import threading

import torch

from lmcache_vericache import compressors
from lmcache_vericache.backends import DualTierStore
from lmcache_vericache.backends.tiers import MemoryTier
from lmcache_vericache.workers import torch_serial


def _threads_after_a_parallel_op() -> int:
    torch.randn(1 << 20).sum()
    return torch.get_num_threads()


def test_worker_pools_run_torch_on_one_thread_and_leave_the_callers_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what later threads start with (the xdist conftest sets 1): a worker must still get 1
    try:
        store = DualTierStore(compressors.get("int8"), MemoryTier(1 << 20), num_kv_heads=2)
        try:
            for pool in (store._pool, store._ckv_pool):
                assert pool.submit(_threads_after_a_parallel_op).result() == 1
        finally:
            store.close()
        assert torch.get_num_threads() == 2
        seen = []
        plain = threading.Thread(target=lambda: seen.append(_threads_after_a_parallel_op()))  # not a worker: untouched
        plain.start()
        plain.join()
        served = []
        worker = threading.Thread(target=lambda: (torch_serial(), served.append(_threads_after_a_parallel_op())))
        worker.start()
        worker.join()
        assert seen == [2] and served == [1]
    finally:
        torch.set_num_threads(before)
