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
K/V planes ``[2, L, T, W]`` are the engine's ``kv_2ltd`` layout and are found by every host.
vLLM-on-CPU's fused paged planes ``[L, T, 2W]`` hold vLLM's block tiles, not token rows
(:mod:`lmcache_vericache.backends.fused_planes`): with ``vllm_cpu_tiling`` (default ``auto``: the ISA vLLM picks on this host)
they are stored token-major with a compressed copy, in layout ``vllm_cpu_fused.<isa>.b<block>``,
which the package's proposer in a vLLM beside this server reads to draft (its ``lmcache_store``
option), and tiled back on load; with ``none`` (or a dtype the compressors do not take, partial
blocks), as they come, full-only, in layout ``vllm_cpu_fused``. Either way a server configured with
another tiling never serves its chunks to an engine that tiles otherwise.

Any other object (another shape, a dtype that is not KV's, a width the head count does not divide:
LMCache's own ``lmcache bench l2`` hands over 1-D ``uint8`` buffers) is stored whole: its raw bytes
as a 1-D ``uint8`` full value, checksummed, never compressed, in the key space of layout
``opaque[<shape>]`` and the object's dtype, so an object of another shape or dtype under the same
``ObjectKey`` is never served it. Each one also gets a shape-free marker (layout ``opaque_mark``)
naming its store key, so a lookup that passes no layout (the bench does; LMCache's server always
passes the group's layout) still finds it, also after a restart.

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
from ...compressors.codec import CHUNK_DTYPES
from ...workers import torch_serial
from .. import fused_planes as fp
from ..config import StoreConfig
from ..keys import LAYOUT_2LTD, KeySpace

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger(__name__)


LAYOUT_VLLM_CPU_FUSED = fp.LAYOUT_VLLM_CPU_FUSED
#: An object that is not KV, stored whole as raw bytes; the layout tag carries its shape.
LAYOUT_OPAQUE = "opaque"
#: The shape-free marker of an opaque object: its value is the object's store key.
LAYOUT_OPAQUE_MARK = "opaque_mark"
# Key spaces cached per (model, layout, tokens, dtype): bounded, as ranks or shapes may be many.
_MAX_SPACES = 4096


def object_layout(shape: Sequence[int]) -> tuple[str, int]:
    """``(layout, tokens)`` of an MP object of ``shape``; raises ``ValueError`` for other shapes."""
    if len(shape) == 4 and shape[0] == 2:
        return LAYOUT_2LTD, int(shape[2])
    if len(shape) == 3 and shape[-1] % 2 == 0:
        return LAYOUT_VLLM_CPU_FUSED, int(shape[1])
    raise ValueError(f"unsupported MP object shape {tuple(shape)}: expected [2, L, T, W] or [L, T, 2*W]")


def kv_layout(shape: Sequence[int], dtype: torch.dtype, num_kv_heads: int) -> tuple[str, int] | None:
    """``(layout, tokens)`` of an object the store keeps as KV: a non-empty :func:`object_layout`
    shape of a floating dtype whose per-plane width ``num_kv_heads`` divides (what the store checks
    full KV chunks for on read). ``None`` for any other object: it is stored whole (opaque)."""
    try:
        layout, tokens = object_layout(shape)
    except ValueError:
        return None
    width = int(shape[-1]) if layout == LAYOUT_2LTD else int(shape[-1]) // 2
    if not dtype.is_floating_point or any(int(s) <= 0 for s in shape) or width % num_kv_heads:
        return None
    return layout, tokens


def opaque_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a 1-D ``uint8`` tensor (a view where ``t`` is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


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

    def __init__(self, store: StoreConfig, vllm_cpu_tiling: str = "auto", vllm_cpu_block_size: int = 128) -> None:
        fp.check_tiling(vllm_cpu_tiling, vllm_cpu_block_size)
        self.store = store
        self.vllm_cpu_tiling = vllm_cpu_tiling  # how vLLM-on-CPU tiles its blocks (module docstring)
        self.vllm_cpu_block_size = vllm_cpu_block_size  # vLLM-on-CPU's block size (its default: 128)

    @classmethod
    def from_dict(cls, d: dict) -> VeriCacheL2AdapterConfig:
        d = dict(d)
        tiling = {k: d.pop(k) for k in ("vllm_cpu_tiling", "vllm_cpu_block_size") if k in d}
        cfg = StoreConfig.parse(d, where="L2 adapter_params")
        if cfg.num_kv_heads is None:
            raise ValueError("L2 adapter_params: 'num_kv_heads' is required (the server does not know the model)")
        return cls(cfg, **tiling)

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
    * Objects: KV chunks (:func:`kv_layout`) as the module docstring says; any other object whole
      and byte for byte (:data:`LAYOUT_OPAQUE`), found by a lookup without a layout through its
      marker. A value that fails its checksum is a miss (and deleted), never wrong bytes.
    * Locking: the capacity tiers never evict on their own, so lookup is a presence check and
      ``submit_unlock`` has nothing to release.
    * Thread-safe: called by LMCache's store and prefetch controller threads; shared state is the
      thread-safe store plus the result tables and counters under ``_lock``.
    """

    def __init__(self, config: VeriCacheL2AdapterConfig, l1_memory_desc: Any = None) -> None:
        super().__init__()
        self.config = config.store
        self.tiling, self.block_size = config.vllm_cpu_tiling, config.vllm_cpu_block_size
        self.store = config.store.build()
        self._layouts: dict[tuple, Any] = {}  # (dtype, head size) -> (tile layout or None, layout name)
        self._layouts_lock = threading.Lock()
        self._spaces: dict[tuple, KeySpace] = {}
        self._efds = {op: create_event_notifier() for op in ("store", "lookup", "load")}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._results: dict[str, dict[L2TaskId, Any]] = {op: {} for op in self._efds}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="vericache-l2-store", initializer=torch_serial)
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="vericache-l2-load", initializer=torch_serial)
        self._closed = False
        self._opaque_seen: set[tuple] = set()
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
        return self._key(key, shape, dtype)[0]

    def _key(self, key: ObjectKey, shape: Sequence[int], dtype: torch.dtype) -> tuple[str, bool, Any]:
        """``(store key, is KV, tile layout)`` of ``key`` for an object of ``shape``/``dtype``; the
        tile layout is a fused plane's that is stored token-major (:meth:`_tiles`), else ``None``."""
        kv = kv_layout(shape, dtype, self.store.num_kv_heads)
        tiles = None
        if kv is None:  # not KV: the layout binds the exact shape, the space the dtype
            layout, tokens = LAYOUT_OPAQUE + "[" + ",".join(str(int(s)) for s in shape) + "]", 1
        else:
            layout, tokens = kv
            if layout == LAYOUT_VLLM_CPU_FUSED:
                tiles, layout = self._tiles(shape, dtype)
        return self._space(key, layout, tokens, dtype).key(key.chunk_hash), kv is not None, tiles

    def _tiles(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[Any, str]:
        """``(tile layout, layout name)`` of a fused plane of ``shape``: the tiling undone on store
        (:mod:`.fused_planes`), or ``(None, "vllm_cpu_fused")`` where it is stored as it comes
        (``vllm_cpu_tiling: none`` or resolved to it, a plane of partial blocks, a dtype the
        compressors do not take, tiles not known here: ``amx``, another architecture's)."""
        heads = self.store.num_kv_heads
        head_size = int(shape[-1]) // (2 * heads)
        if dtype not in CHUNK_DTYPES or not fp.fits(shape, self.block_size, heads):
            return None, LAYOUT_VLLM_CPU_FUSED
        spec = (dtype, head_size)
        with self._layouts_lock:  # one warning per spec, whichever thread asks first
            if spec not in self._layouts:
                try:
                    isa = fp.isa_of(self.tiling, dtype, self.block_size, head_size)
                except Exception as e:  # a torch without the AMX probe: stored as they come
                    isa = f"unknown ({type(e).__name__}: {e})"
                tiles = fp.block_layout(isa, self.block_size, head_size)
                if tiles is None and self.tiling != "none":
                    logger.warning("VeriCacheL2Adapter: vLLM-on-CPU %s planes (head size %d) are stored as they "
                                   "come, full-only (no compressed copy to draft from): ISA %s tiles are not "
                                   "known here", dtype, head_size, isa)
                name = fp.layout_name(isa, self.block_size) if tiles is not None else LAYOUT_VLLM_CPU_FUSED
                self._layouts[spec] = (tiles, name)
            return self._layouts[spec]

    def _mark_key(self, key: ObjectKey) -> str:
        """Store key of the shape-free marker of the opaque object last stored under ``key``."""
        return self._space(key, LAYOUT_OPAQUE_MARK, 1, torch.uint8).key(key.chunk_hash)

    def _space(self, key: ObjectKey, layout: str, tokens: int, dtype: torch.dtype) -> KeySpace:
        layout = fp.qualified(layout, key.kv_rank, key.object_group_id, key.cache_salt)
        spec = (key.model_name, layout, tokens, dtype)
        space = self._spaces.get(spec)
        if space is None:
            if len(self._spaces) >= _MAX_SPACES:
                self._spaces.clear()
            space = self._spaces[spec] = self.config.key_space(
                model=key.model_name, dtype=dtype, chunk_size=tokens, layout=layout)
        return space

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
                if not self._store_one(key, obj.tensor):
                    continue
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

    def _store_one(self, key: ObjectKey, t: torch.Tensor) -> bool:
        """Store one object; ``False`` where it was already stored. Raises on failure."""
        skey, kv, tiles = self._key(key, t.shape, t.dtype)
        if kv:
            if self.store.has_full(skey):
                return False
            # Token rows are worth compressing (fused planes only once made token-major), and only
            # in the dtypes the compressors take.
            chunk = fp.token_major(t, tiles, self.store.num_kv_heads) if tiles is not None else kv_2ltd_view(t)
            self.store.put(skey, chunk, compress=(t.dim() == 4 and t.dtype in CHUNK_DTYPES) or tiles is not None)
            return True
        self._note_opaque(t)
        written = not self.store.has_full(skey)
        if written:
            self.store.put(skey, opaque_bytes(t), compress=False)
        mkey = self._mark_key(key)
        if written or not self.store.has_full(mkey):  # the marker goes second: it names a stored value
            name = torch.frombuffer(bytearray(skey.encode()), dtype=torch.uint8)
            self.store.put(mkey, name, compress=False, replace=True)
        return written

    def _note_opaque(self, t: torch.Tensor) -> None:
        """Log the first object of each shape/dtype stored whole (a few dozen at most); a warning for
        one shaped like KV, which a wrong ``num_kv_heads`` would also send here."""
        spec = (tuple(t.shape), t.dtype)
        with self._lock:
            if spec in self._opaque_seen or len(self._opaque_seen) >= 64:
                return
            self._opaque_seen.add(spec)
        try:
            object_layout(t.shape)
            kv_shaped = t.dtype.is_floating_point and t.numel() > 0
        except ValueError:
            kv_shaped = False
        (logger.warning if kv_shaped else logger.info)(
            "VeriCacheL2Adapter: %s %s objects are not KV chunks of %d heads: stored whole "
            "(full-only, checksummed, no compressed copy)%s", tuple(t.shape), t.dtype, self.store.num_kv_heads,
            "; if they are KV, check num_kv_heads" if kv_shaped else "")

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
            if desc is None or not desc.shapes:  # no layout: only an opaque object's marker names it
                hit = self._marked(k)
            else:
                hit = self.store.has_full(self.key(k, desc.shapes[0], desc.dtypes[0]))
            if hit:
                hits.append(i)
        bitmap.batched_set(hits)
        self._count(lookups=len(keys), lookup_hits=len(hits))
        return bitmap

    def _marked(self, key: ObjectKey) -> bool:
        """An opaque object stored under ``key`` is present: its verified marker names a stored value."""
        mkey = self._mark_key(key)
        if not self.store.has_full(mkey):  # (no read, so the store's full_misses count loads only)
            return False
        name = self.store.get_full(mkey, kv=False)  # a bad marker is a miss (and deleted)
        if name is None or name.dtype != torch.uint8 or name.dim() != 1:
            return False
        try:
            skey = bytes(name.numpy()).decode()
        except UnicodeDecodeError:
            return False
        # The value it names must be of this key's chunk hash (the part after the space id).
        return "-" in skey and skey[skey.index("-"):] == mkey[mkey.index("-"):] and self.store.has_full(skey)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        return None

    # -- load -----------------------------------------------------------------------------------
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("load", self._readers, self._load, Bitmap(len(keys)), list(keys), list(objects))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop("load", task_id)

    def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        bitmap = Bitmap(len(keys))
        # A buffer with no tensor gets a key no value has (a miss) instead of failing the task.
        resolved = [self._load_key(k, o) for k, o in zip(keys, objects, strict=True)]
        skeys = [skey for skey, _, _ in resolved]
        handle = self.store.prefetch(skeys, not_kv=[skey for skey, kv, _ in resolved if not kv])  # in parallel
        loaded = []
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            full = handle.wait(i)
            if full is None:
                continue
            _, kv, tiles = resolved[i]
            try:  # an opaque object's buffer as the bytes it was stored as (same shape and dtype: same key)
                dst = kv_2ltd_view(obj.tensor) if kv else obj.tensor.view(-1).view(torch.uint8)
            except (AttributeError, ValueError, RuntimeError):  # no tensor, no chunk shape, not contiguous
                dst = None
            if dst is None or dst.shape != full.shape or dst.dtype != full.dtype:
                logger.error(
                    "VeriCacheL2Adapter: %s is %s %s but the load buffer is %s %s; treated as a miss",
                    skeys[i], tuple(full.shape), full.dtype,
                    None if dst is None else tuple(dst.shape), None if dst is None else dst.dtype,
                )  # fmt: skip
                continue
            if tiles is not None:  # stored token-major: back into vLLM's tiles
                fp.tile_into(full, tiles, self.store.num_kv_heads, obj.tensor)
            else:
                dst.copy_(full)
            bitmap.set(i)
            loaded.append(key)
        self._count(loaded_chunks=len(loaded), load_misses=len(keys) - len(loaded))
        if loaded:
            self._notify_keys_accessed(loaded)
        return bitmap

    def _load_key(self, key: ObjectKey, obj: MemoryObj) -> tuple[str, bool, Any]:
        try:
            return self._key(key, obj.tensor.shape, obj.tensor.dtype)
        except (AttributeError, ValueError):
            return "unloadable-" + key.chunk_hash.hex(), True, None

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
