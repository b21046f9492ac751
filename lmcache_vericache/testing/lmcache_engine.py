"""A real in-process ``LMCacheEngine`` on a CPU-only host, for tests and benchmarks.

There is no GPU here, so the engine's GPU side is LMCache's mock connector (``EngineType.MOCK``),
which moves no data. :class:`CopyingMockGPUConnector` extends it to copy between the memory
objects and a CPU tensor standing in for the paged GPU KV cache, so a test can check that what
``retrieve`` writes back is bit for bit what ``store`` read. Everything between the two (token
hashing, LocalCPU allocation, the put broadcast, lookup, the async prefetch, the backend, the
store and its tier) is LMCache's real code.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import torch
from lmcache.utils import EngineType
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import CreateGPUConnector
from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
from lmcache.v1.metadata import LMCacheMetadata

_ids = itertools.count()


class CopyingMockGPUConnector(MockGPUConnector):
    """The mock connector plus real copies: ``kv`` ([2, L, T, H*D]) is what ``store`` reads,
    ``out`` receives what ``retrieve`` writes."""

    def __init__(self, kv_shape: tuple, kv: torch.Tensor) -> None:
        super().__init__(kv_shape)
        self.kv, self.out = kv, torch.zeros_like(kv)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, s, e in zip(memory_objs, starts, ends):
            obj.tensor.copy_(self.kv[:, :, s:e])

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, s, e in zip(memory_objs, starts, ends):
            self.out[:, :, s:e] = obj.tensor


class ScheduleRecorder:
    """Stands in for vLLM's scheduler at the end of LMCache's async lookup RPC (needs vLLM's
    scheduler process); records the prefix length the storage manager reports."""

    def __init__(self) -> None:
        self.responses: dict[str, int] = {}
        self._answered = threading.Event()

    def send_response_to_scheduler(self, lookup_id: str, retrieved_length: int) -> None:
        self.responses[lookup_id] = retrieved_length
        self._answered.set()

    def wait(self, timeout: float = 30.0) -> None:
        """Like vLLM's scheduler: schedule the retrieve only after the lookup is answered."""
        assert self._answered.wait(timeout), "the async lookup was never answered"


class Engines:
    """Starts real LMCacheEngines with the copying mock connector; destroys them (closing their
    backends) in ``stop`` or at teardown."""

    def __init__(self, metadata: Callable[[LMCacheEngineConfig], LMCacheMetadata]) -> None:
        self._metadata = metadata
        self._ids: dict[int, str] = {}

    def start(self, cfg: LMCacheEngineConfig, kv: torch.Tensor, async_lookup_server=None):
        """A started engine (``post_init`` done) whose GPU side copies from ``kv`` ``[2, L, T, H*D]``."""
        md = self._metadata(cfg)
        assert isinstance(CreateGPUConnector(cfg, md, EngineType.MOCK), MockGPUConnector)
        connector = CopyingMockGPUConnector(md.kv_shape, kv)
        instance = f"vericache-test-{next(_ids)}"
        engine = LMCacheEngineBuilder.get_or_create(
            instance, cfg, md, connector, lambda *a, **k: None, lambda *a, **k: None
        )
        self._ids[id(engine)] = instance
        engine.post_init(async_lookup_server=async_lookup_server)
        return engine, connector

    def stop(self, engine) -> None:
        LMCacheEngineBuilder.destroy(self._ids.pop(id(engine)))

    def stop_all(self) -> None:
        for instance in self._ids.values():
            LMCacheEngineBuilder.destroy(instance)
        self._ids.clear()
