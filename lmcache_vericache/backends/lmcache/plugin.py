"""LMCache in-process adapter: the dual-tier store as a ``StoragePluginInterface`` backend.

Switched on by LMCache YAML (``configs/lmcache-vericache.yaml``)::

    chunk_size: 256
    pre_caching_hash_algorithm: sha256_cbor   # the chain the engine computes too (keys.py)
    storage_plugins: [vericache]
    extra_config:
      storage_plugin.vericache.module_path: lmcache_vericache.backends.lmcache.plugin
      storage_plugin.vericache.class_name: VeriCacheBackend
      vericache.capacity: disk              # every other ``vericache.<key>`` is a StoreConfig key
      vericache.disk_path: /var/cache/kv

Keys: LMCache hands over ``CacheEngineKey``\ s whose ``chunk_hash`` is LMCache's prefix chain;
the store key is :meth:`KeySpace.key` of it, in the space of (``vericache.model_id`` or LMCache's
model name, the key's dtype, LMCache's chunk size, ``kv_2ltd``, the hash algorithm, the
compressor), the same key the engine computes from the tokens. LMCache serves **full** chunks only
(it restores exact KV); the compressed copy each put also makes is for drafters sharing the store.

LMCache 0.5.6 logs and swallows exceptions raised by a plugin's constructor, leaving the engine
without the backend. The constructor therefore logs its error at ERROR naming the offending key,
records it, and :func:`check_backend` raises it again after start-up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from ... import metrics as M
from ...workers import torch_serial
from ..config import StoreConfig
from ..keys import HASH_SCHEMES, KeySpace
from ..store import DualTierStore

logger = logging.getLogger(__name__)

#: Namespace of this package's own keys in LMCache's ``extra_config``.
KEY_PREFIX = "vericache."

# Constructor errors by class name, for check_backend (LMCache only logs them).
_construction_errors: dict[str, BaseException] = {}


def store_params(extra_config: Mapping[str, Any] | None, prefix: str = KEY_PREFIX) -> dict[str, Any]:
    """The ``<prefix><key>`` entries of ``extra_config`` as ``{key: value}``."""
    return {k[len(prefix) :]: v for k, v in (extra_config or {}).items() if k.startswith(prefix)}


class VeriCacheBackend(StoragePluginInterface):
    """LMCache storage backend over a :class:`DualTierStore`.

    Contract with LMCache 0.5.6 (``docs/architecture.md#data-path-of-one-request-per-host``, "LMCache in-process"):

    * Keys map to the store by :meth:`_key` (the shared key scheme); values are ``KV_2LTD`` chunks
      ``[2, L, T, H*D]``.
    * Put is a broadcast after which LMCache drops its reference: each object is ref-counted up
      until a single background writer has copied it into the store (the store keeps bytes), then
      released. ``exists_in_put_tasks`` covers that window. At most :attr:`MAX_PENDING_PUTS` chunks
      wait for the writer (the objects they pin are LocalCPU memory); beyond that puts are dropped
      and counted. Writes fail as logged errors, never into LMCache's store path.
    * Reads return objects allocated from ``local_cpu_backend`` holding one reference that the
      caller owns. ``batched_get_non_blocking`` returns the hit *prefix* only and releases
      everything else it allocated. Reads wait on the store's prefetch in a worker thread and
      never block LMCache's event loop.
    * Pinning: the capacity tiers (disk, Redis) never evict on their own, so ``pin`` is a
      presence check and ``unpin`` a no-op.
    * Thread-safety: all methods may be called from LMCache's engine thread and its storage loop
      at once; shared state is the thread-safe store plus ``_inflight`` under ``_lock``.
    """

    #: Chunks queued for the writer before further puts are dropped (bounds pinned LocalCPU memory).
    MAX_PENDING_PUTS = 256

    def __init__(
        self,
        dst_device: str = "cpu",
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        name = type(self).__name__
        try:
            self.store, self._spaces = self._create_store(config, metadata)
        except Exception as e:
            _construction_errors[name] = e
            logger.error("%s not created, LMCache will run without it: %s", name, e)
            raise
        _construction_errors.pop(name, None)
        self._lock = threading.Lock()
        self._inflight: dict[CacheEngineKey, Future] = {}
        # One writer keeps puts in order and bounds the CPU spent compressing behind LMCache's back.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="vericache-put", initializer=torch_serial)
        self._closed = False
        # Chunks written / failed / dropped (queue full), served / missed, batched_get_non_blocking calls.
        self.stats = {"put_chunks": 0, "put_errors": 0, "put_dropped": 0, "get_chunks": 0, "get_misses": 0,
                      "async_gets": 0}

    @staticmethod
    def _create_store(config: Any, metadata: Any) -> tuple[DualTierStore, dict[str, KeySpace]]:
        if config is None or metadata is None:
            raise ValueError("needs LMCache's config and metadata")
        if metadata.use_mla or getattr(config, "use_layerwise", False) or metadata.get_num_groups() != 1:
            raise ValueError("supports KV_2LTD chunks only (no MLA, no use_layerwise, one layer group)")
        where = "LMCache extra_config"
        cfg = StoreConfig.parse(store_params(config.extra_config), where=where, prefix=KEY_PREFIX)
        cfg = cfg.with_heads(metadata.kv_shape[3], where=where, prefix=KEY_PREFIX)
        algorithm = getattr(config, "pre_caching_hash_algorithm", "builtin")
        if cfg.hash_scheme is None and algorithm not in HASH_SCHEMES:
            # Python's hash() chains differ per process unless PYTHONHASHSEED is set: chunks stay
            # private to LMCache instances with the same seed and are never found by other hosts.
            logger.warning("LMCache pre_caching_hash_algorithm=%r: chunks are found only by LMCache "
                           "instances hashing the same way; use sha256_cbor to share them", algorithm)
        scheme = {"sha256_cbor_64bit": "sha256_cbor"}.get(algorithm, algorithm)
        space = lambda scheme: cfg.key_space(model=metadata.model_name, dtype=metadata.kv_dtype,  # noqa: E731
                                             chunk_size=config.chunk_size, scheme=scheme)
        spaces = {"": space(scheme) if scheme in HASH_SCHEMES or cfg.hash_scheme else _private_space(space, scheme)}
        return cfg.build(), spaces

    def key(self, key: CacheEngineKey) -> str:
        """Store key of ``key``: the shared scheme, with LMCache's rank and tags as qualifiers."""
        space = self._spaces[""]
        if key.world_size != 1 or key.worker_id != 0 or key.tags:
            # Another tensor-parallel slice or a tagged request: never interchangeable with rank 0's.
            space = self._spaces.setdefault(f"{key.world_size}/{key.worker_id}/{key.tags}", _qualified(
                space, f"tp{key.world_size}.{key.worker_id}" + "".join(f".{t}" for t in key.tags or ())))
        if str(key.dtype).removeprefix("torch.") != space.dtype:
            space = _qualified(space, f"dtype.{key.dtype}")
        return space.key(key.chunk_hash)

    def __str__(self) -> str:
        return type(self).__name__

    # -- lookup ---------------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return not self._closed and self.store.has_full(self.key(key))

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._inflight

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """Number of leading keys present (capacity-tier lookups may hit the network: run off-loop)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.batched_contains, keys, pin)

    def pin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    # -- write path -----------------------------------------------------------------------------
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future] | None:
        if self._closed:
            return None
        futures = []
        for key, obj in zip(keys, objs, strict=True):
            if obj.get_memory_format() != MemoryFormat.KV_2LTD:
                logger.error("%s: cannot store %s in format %s", self, key, obj.get_memory_format())
                continue
            if self.exists_in_put_tasks(key) or self.store.has_full(self.key(key)):
                continue  # (a racing duplicate put is harmless: same bytes, atomic tier writes)
            with self._lock:
                if len(self._inflight) >= self.MAX_PENDING_PUTS:
                    # Backpressure without stalling inference: a cache may skip a write; the
                    # chunk is recomputed (and offered again) the next time it is needed.
                    self._count("put_dropped")
                    if self.stats["put_dropped"] & (self.stats["put_dropped"] - 1) == 0:  # 1, 2, 4, ...
                        logger.warning("%s: %d puts pending, dropped %d chunk puts so far", self,
                                       len(self._inflight), self.stats["put_dropped"])
                    continue
                obj.ref_count_up()  # released by _write once the store has copied it
                fut = self._writer.submit(self._write, key, obj, on_complete_callback)
                self._inflight[key] = fut
            futures.append(fut)
        return futures

    def _write(self, key: CacheEngineKey, obj: MemoryObj, on_complete: Callable | None) -> None:
        try:
            # No chunk offset reaches a backend in LMCache: positions are chunk-relative (start=0).
            self.store.put(self.key(key), obj.tensor)
            ok = True
        except Exception as e:  # logged by the store for tier errors; never raise into LMCache
            ok = False
            logger.error("%s: put of %s failed: %s", self, key, e)
        finally:
            obj.ref_count_down()
            with self._lock:
                self._inflight.pop(key, None)
                self._count("put_chunks" if ok else "put_errors")
        if ok and on_complete is not None:
            on_complete(key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every put submitted so far is in the store (or failed, logged)."""
        with self._lock:
            pending = list(self._inflight.values())
        wait_futures(pending, timeout)

    # -- read path ------------------------------------------------------------------------------
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        if self._closed:
            return None
        return self._to_memory_obj(key, self.store.get_full(self.key(key)))

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """Objects for the longest prefix of ``keys`` that could be read, in order. Reads of all
        keys start at once (bounded by the store's read pool); after the first miss the rest are
        cancelled and nothing after it is returned or kept."""
        if self._closed or not keys:
            return []
        with self._lock:
            self.stats["async_gets"] += 1
        handle = self.store.prefetch([self.key(k) for k in keys])
        out: list[MemoryObj] = []
        try:
            for i, key in enumerate(keys):
                obj = self._to_memory_obj(key, await handle.wait_async(i))
                if obj is None:
                    break
                out.append(obj)
        finally:
            handle.cancel()
        return out

    def _to_memory_obj(self, key: CacheEngineKey, full: torch.Tensor | None) -> MemoryObj | None:
        """Copy a full chunk into a LocalCPU allocation (LMCache writes hits back into LocalCPU)."""
        obj = None
        if full is not None and self.local_cpu_backend is not None:
            obj = self.local_cpu_backend.allocate(full.shape, full.dtype, MemoryFormat.KV_2LTD)
            if obj is None:
                logger.warning("%s: LocalCPU could not allocate %s for %s", self, tuple(full.shape), key)
            else:
                obj.tensor.copy_(full)
        with self._lock:
            self._count("get_chunks" if obj is not None else "get_misses")
        return obj

    def _count(self, name: str) -> None:
        """One more ``name`` in ``stats`` and in Prometheus (``vericache_lmcache_<name>_total``); under ``_lock``."""
        self.stats[name] += 1
        M.PLUGIN[name].inc()

    # -- management -----------------------------------------------------------------------------
    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        # The store has no delete: chunks are immutable, shared, and the tiers bound themselves.
        return False

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        """Finish queued writes, then close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown(wait=True)
        self.store.close()


def check_backend(engine_or_storage_manager: Any, cls: type = VeriCacheBackend) -> StoragePluginInterface:
    """The ``cls`` backend of a started LMCache engine (or its ``StorageManager``).

    LMCache swallows backend constructor errors; call this after ``post_init`` to fail loudly:
    raises ``RuntimeError`` carrying the constructor's error (e.g. the bad config key) when the
    backend is missing."""
    manager = getattr(engine_or_storage_manager, "storage_manager", engine_or_storage_manager)
    backends = getattr(manager, "storage_backends", None)
    if backends is None:
        raise RuntimeError(f"{engine_or_storage_manager!r} has no storage backends (engine not started?)")
    for backend in backends.values():
        if isinstance(backend, cls):
            return backend
    err = _construction_errors.get(cls.__name__)
    cause = f": {type(err).__name__}: {err}" if err else " (is it listed in storage_plugins?)"
    raise RuntimeError(f"LMCache started without the {cls.__name__} backend{cause}") from err


def _qualified(space: KeySpace, qualifier: str) -> KeySpace:
    from dataclasses import replace

    return replace(space, layout=f"{space.layout}/{qualifier}")


def _private_space(space: Callable[[str], KeySpace], algorithm: str) -> KeySpace:
    """A space for a hash algorithm the shared scheme does not define: its own layout tag keeps
    its keys apart from every shared one (same chain values can mean other tokens)."""
    return _qualified(space("blake3"), f"hash.{algorithm}")
