"""LMCache multiprocess (MP) adapter: the dual-tier store as an ``L2AdapterInterface``.

Loaded by the LMCache server (``configs/lmcache-server-l2.json``)::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "lmcache_vericache.backends.lmcache.l2_adapter",
        "class_name": "VeriCacheL2Adapter",
        "adapter_params": {"capacity": "disk", "disk_path": "/var/cache/kv", "num_kv_heads": 8}}'

``adapter_params`` are :class:`~lmcache_vericache.backends.config.StoreConfig` keys; LMCache finds
:class:`VeriCacheL2AdapterConfig` by name and a bad key fails the server's start with an error
naming it. The server has no model config, so ``num_kv_heads`` is required here.

Keys: an ``ObjectKey``'s ``chunk_hash`` is the server's prefix chain (``blake3`` by default, as
the engine computes it); the store key is :meth:`KeySpace.key` of it in the space of
(``model_id`` or the key's model name, the object's dtype and token count, its layout, the hash
scheme, the compressor), with the key's rank, object group and cache salt as qualifiers. Split
K/V planes ``[2, L, T, W]`` are the engine's ``kv_2ltd`` layout and are found by every host;
vLLM-on-CPU's fused paged planes ``[L, T, 2W]`` are not token-major, get a layout of their own
(``vllm_cpu_fused``) and are stored full-only, so no other host is ever served one.

As in-process, LMCache loads and stores **full** chunks through this adapter (exact KV).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from ... import metrics as M
from ...workers import torch_serial
from ..config import StoreConfig
from ..keys import LAYOUT_2LTD, KeySpace

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger(__name__)


#: vLLM-on-CPU's fused K/V plane ``[L, T, 2W]`` (LMCache ``kv_size == 1``): rows are paged
#: blocks tiled in vLLM's own order, not tokens (docs/host-notes.md#vllm-cpu-block-layout).
LAYOUT_VLLM_CPU_FUSED = "vllm_cpu_fused"


def object_layout(shape: Sequence[int]) -> tuple[str, int]:
    """``(layout, tokens)`` of an MP object of ``shape``; raises ``ValueError`` for other shapes."""
    if len(shape) == 4 and shape[0] == 2:
        return LAYOUT_2LTD, int(shape[2])
    if len(shape) == 3 and shape[-1] % 2 == 0:
        return LAYOUT_VLLM_CPU_FUSED, int(shape[1])
    raise ValueError(f"unsupported MP object shape {tuple(shape)}: expected [2, L, T, W] or [L, T, 2*W]")


def kv_2ltd_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the store's ``[2, L, T, W]`` chunk, as a view (writes go through to ``t``).

    MP objects are ``[2, L, T, H*D]`` for engines with split K/V planes, or one fused plane
    ``[L, T, 2*W]`` (:data:`LAYOUT_VLLM_CPU_FUSED`), which is viewed as its two halves. The view
    is exact both ways, so full chunks round-trip bit for bit whatever the engine's layout."""
    if t.dim() == 4 and t.shape[0] == 2:
        return t
    if t.dim() == 3 and t.shape[-1] % 2 == 0:
        layers, tokens, width = t.shape
        return t.view(layers, tokens, 2, width // 2).permute(2, 0, 1, 3)
    raise ValueError(f"unsupported MP object shape {tuple(t.shape)}: expected [2, L, T, W] or [L, T, 2*W]")


class VeriCacheL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` of the plugin JSON: flat ``DualTierStore.from_config`` keys, validated
    when the server parses its arguments (a bad key raises ``ValueError`` naming it)."""

    def __init__(self, store: StoreConfig) -> None:
        self.store = store

    @classmethod
    def from_dict(cls, d: dict) -> VeriCacheL2AdapterConfig:
        cfg = StoreConfig.parse(d, where="L2 adapter_params")
        if cfg.num_kv_heads is None:
            raise ValueError("L2 adapter_params: 'num_kv_heads' is required (the server does not know the model)")
        return cls(cfg)

    @classmethod
    def help(cls) -> str:
        return (
            "VeriCache dual-tier L2 adapter; adapter_params are StoreConfig keys, e.g. "
            '{"capacity": "disk", "disk_path": "/tmp/kv", "num_kv_heads": 8, "compressor": "int8"}'
        )


class VeriCacheL2Adapter(L2AdapterInterface):
    """L2 adapter over a :class:`~lmcache_vericache.backends.store.DualTierStore`.

    * Submit-then-poll: every ``submit_*`` returns a task id at once; the work runs on this
      adapter's threads (one writer, two readers for lookups and loads), the result is recorded
      and the operation's own eventfd signalled. ``query_*`` / ``pop_*`` hand each result out
      exactly once.
    * Ownership: stored and load-buffer objects belong to the caller and stay valid until their
      task completes. A store copies the chunk's bytes into the store before completing; a load
      writes the verified full chunk into the caller's buffer (a shape/dtype mismatch is a miss).
    * Locking: the capacity tiers never evict on their own, so lookup is a presence check and
      ``submit_unlock`` has nothing to release.
    * Thread-safe: called by LMCache's store and prefetch controller threads; shared state is the
      thread-safe store plus the result tables and counters under ``_lock``.
    """

    def __init__(self, config: VeriCacheL2AdapterConfig, l1_memory_desc: Any = None) -> None:
        super().__init__()
        self.config = config.store
        self.store = config.store.build()
        self._spaces: dict[tuple, KeySpace] = {}
        self._efds = {op: create_event_notifier() for op in ("store", "lookup", "load")}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._results: dict[str, dict[L2TaskId, Any]] = {op: {} for op in self._efds}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="vericache-l2-store", initializer=torch_serial)
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="vericache-l2-load", initializer=torch_serial)
        self._closed = False
        self.stats = {
            "stored_chunks": 0,
            "store_failures": 0,
            "lookups": 0,
            "lookup_hits": 0,
            "loaded_chunks": 0,
            "load_misses": 0,
        }

    def key(self, key: ObjectKey, shape: Sequence[int], dtype: torch.dtype) -> str:
        """Store key of ``key`` for an object of ``shape``/``dtype`` (the shared scheme)."""
        layout, tokens = object_layout(shape)
        qual = "".join(f"/{n}.{v}" for n, v in (("rank", key.kv_rank), ("group", key.object_group_id),
                                                  ("salt", key.cache_salt)) if v)
        spec = (key.model_name, layout + qual, tokens, dtype)
        space = self._spaces.get(spec)
        if space is None:
            space = self._spaces[spec] = self.config.key_space(
                model=key.model_name, dtype=dtype, chunk_size=tokens, layout=layout + qual)
        return space.key(key.chunk_hash)

    # -- event fds ------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._efds["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efds["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efds["load"].fileno()

    # -- task plumbing --------------------------------------------------------------------------
    def _submit(
        self, op: str, pool: ThreadPoolExecutor, fn: Callable[..., Any], failed: Any, *args: Any
    ) -> L2TaskId:
        with self._lock:
            task_id = next(self._ids)

        def run() -> None:
            try:
                result = fn(*args)
            except Exception:  # a task must always complete, or the controller waits forever
                logger.exception("VeriCacheL2Adapter %s task %d failed", op, task_id)
                result = failed
            with self._lock:
                self._results[op][task_id] = result
            self._efds[op].notify()

        pool.submit(run)
        return task_id

    def _pop(self, op: str, task_id: L2TaskId) -> Any:
        with self._lock:
            return self._results[op].pop(task_id, None)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self.stats[name] += d
                if d:
                    M.L2[name].inc(d)  # Prometheus: vericache_l2_<name>_total

    # -- store ----------------------------------------------------------------------------------
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(
            "store", self._writer, self._store, L2StoreResult(False, 0), list(keys), list(objects)
        )

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._results["store"] = self._results["store"], {}
        return done

    def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        failures, stored, sizes = 0, [], []
        for key, obj in zip(keys, objects, strict=True):
            try:
                skey = self.key(key, obj.tensor.shape, obj.tensor.dtype)
                if self.store.has_full(skey):
                    continue
                # Only split K/V planes have token rows worth compressing (see LAYOUT_VLLM_CPU_FUSED).
                self.store.put(skey, kv_2ltd_view(obj.tensor), compress=obj.tensor.dim() == 4)
            except Exception as e:  # logged by the store for tier errors; reported per task
                logger.error("VeriCacheL2Adapter: store of %s failed: %s", key, e)
                failures += 1
                continue
            stored.append(key)
            sizes.append(obj.get_size())
        self._count(stored_chunks=len(stored), store_failures=failures)
        if stored:
            self._notify_keys_stored(stored, sizes)
        return L2StoreResult(failures == 0, sum(sizes))

    # -- lookup ---------------------------------------------------------------------------------
    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        return self._submit(
            "lookup", self._readers, self._lookup, Bitmap(len(keys)), list(keys), dict(group_layout_descs or {})
        )

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop("lookup", task_id)

    def _lookup(self, keys: list[ObjectKey], descs: dict[int, MemoryLayoutDesc]) -> Bitmap:
        bitmap = Bitmap(len(keys))
        hits = []
        for i, k in enumerate(keys):
            desc = descs.get(k.object_group_id)
            if desc is None or not desc.shapes:  # no layout: cannot name the key, so a miss
                continue
            if self.store.has_full(self.key(k, desc.shapes[0], desc.dtypes[0])):
                hits.append(i)
        bitmap.batched_set(hits)
        self._count(lookups=len(keys), lookup_hits=len(hits))
        return bitmap

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        return None

    # -- load -----------------------------------------------------------------------------------
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("load", self._readers, self._load, Bitmap(len(keys)), list(keys), list(objects))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop("load", task_id)

    def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        bitmap = Bitmap(len(keys))
        # A buffer with no chunk shape gets a key no chunk has (a miss) instead of failing the task.
        skeys = [self._load_key(k, o) for k, o in zip(keys, objects, strict=True)]
        handle = self.store.prefetch(skeys)  # reads run in parallel
        loaded = []
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            full = handle.wait(i)
            if full is None:
                continue
            try:
                dst = kv_2ltd_view(obj.tensor)
            except (AttributeError, ValueError, RuntimeError):  # no tensor, or no chunk shape
                dst = None
            if dst is None or dst.shape != full.shape or dst.dtype != full.dtype:
                logger.error(
                    "VeriCacheL2Adapter: %s is %s %s but the load buffer is %s %s; treated as a miss",
                    skeys[i], tuple(full.shape), full.dtype,
                    None if dst is None else tuple(dst.shape), None if dst is None else dst.dtype,
                )  # fmt: skip
                continue
            dst.copy_(full)
            bitmap.set(i)
            loaded.append(key)
        self._count(loaded_chunks=len(loaded), load_misses=len(keys) - len(loaded))
        if loaded:
            self._notify_keys_accessed(loaded)
        return bitmap

    def _load_key(self, key: ObjectKey, obj: MemoryObj) -> str:
        try:
            return self.key(key, obj.tensor.shape, obj.tensor.dtype)
        except (AttributeError, ValueError):
            return "unloadable-" + key.chunk_hash.hex()

    # -- status / close -------------------------------------------------------------------------
    def report_status(self) -> dict:
        with self._lock:
            stats = dict(self.stats)
        store = self.store.stats
        return {
            "is_healthy": not self._closed,
            "type": type(self).__name__,
            **stats,
            "store": {k: getattr(store, k) for k in store.__dataclass_fields__},
        }

    def close(self) -> None:
        """Finish submitted tasks, close the store and the eventfds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.store.close()
        for efd in self._efds.values():
            efd.close()
