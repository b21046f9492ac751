"""VeriCache as a vLLM KV connector: the dual-tier store on vLLM's data path.

    --kv-transfer-config '{"kv_connector": "VeriCacheConnector",
        "kv_connector_module_path": "lmcache_vericache.connectors.vericache_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"capacity": "redis", "redis_url": "redis://127.0.0.1:6379"}}'

``kv_connector_extra_config`` is a store config (``backends.StoreConfig`` keys) plus the options of
:class:`ConnectorOptions`; a bad key or value stops vLLM at start-up, naming the key.

* **Scheduler side.** ``get_num_new_matched_tokens`` hashes the prompt's complete chunks with the
  package's one key scheme (model identity: :func:`~lmcache_vericache.backends.keys.folder_fingerprint`
  of the served weights, equal to the engine's digest of the same weights and dtype) and reports
  the longest stored prefix past vLLM's own prefix cache, loaded asynchronously. A store that fails
  (server down) is 0 hits, never an error. Complete prompt chunks vLLM computes are scheduled for
  saving (``build_connector_meta``), unless the store has them.
* **Worker side.** ``start_load_kv`` starts, per loading request, a background load: the store's
  compressed chunks are fetched at once and handed to the drafter (the ``custom_class`` proposer of
  :mod:`.proposer`, which drafts the continuation over them with the target model's weights while
  the full chunks are in flight), and the full chunks are prefetched and written into the request's
  blocks in vLLM's CPU layout (:mod:`.paged_layout`). A chunk that misses or fails its digest is
  reported through ``get_block_ids_with_load_errors``: vLLM recomputes from there (needs
  ``kv_load_failure_policy: recompute``; vLLM's default fails the request). ``wait_for_save`` copies
  each chunk to save out of the paged cache token-major (``KV_2LTD``) right after the forward and a
  writer thread ``put``\\ s it (full + compressed copy), off the forward's critical path.
* Threading: vLLM calls every hook from one thread per role; loads run on ``LOAD_THREADS``
  threads (concurrent loads of one prefix share each chunk's read: it crosses the link once) and
  write only the blocks of requests vLLM is not running yet (never blocks below vLLM's
  own computed prefix, which other requests may share); saves run on one writer thread with a
  bounded queue (a full queue drops the save and counts it: a lost save is a later miss).
* One store per process and config (scheduler and worker share it when vLLM runs them in one
  process), so ``capacity: memory`` works within one vLLM instance; share across instances with
  disk, redis, redis_cluster, lm or nixl.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import queue
import re
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..backends import StoreConfig
from ..backends.keys import KeySpace, folder_fingerprint
from ..backends.store import DualTierStore
from ..engine.cache import kv_to_2ltd
from ..options import parse_options
from . import drafts
from . import paged_layout as pl

logger = logging.getLogger("vllm." + __name__)  # shown by vLLM's log handler
Tensor = torch.Tensor
WHERE = "kv_connector_extra_config"
LOAD_THREADS = 8  # concurrent request loads (threads mostly wait on the store)
SAVE_QUEUE = 64


@dataclass(frozen=True)
class ConnectorOptions:
    """The connector's own keys of ``kv_connector_extra_config`` (the rest is the store config)."""

    chunk_size: int = 256  # tokens per stored chunk; a multiple of vLLM's block size
    save: bool = True  # store complete prompt chunks vLLM computes
    load: bool = True  # serve stored prefixes to vLLM
    # Drafts made over the compressed prefix while the full one loads (0: off). None: 32 where the
    # load moves by DMA (CUDA), 0 on a CPU host, where the load itself needs the cores (receiving,
    # verifying and writing the chunks) and drafting beside it made loads slower than they saved
    # (benchmarks/remote_prefix.py, README "Serving with vLLM").
    draft_tokens: int | None = None

    def validate(self) -> None:
        for name, low in (("chunk_size", 1), ("draft_tokens", 0)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")


def parse_extra_config(extra: Mapping[str, Any] | None) -> tuple[ConnectorOptions, StoreConfig]:
    """Connector options and store config from ``kv_connector_extra_config``; ``ValueError`` naming
    the key otherwise."""
    extra = dict(extra or {})
    own = {f.name for f in dataclasses.fields(ConnectorOptions)}
    store_keys = {f.name for f in dataclasses.fields(StoreConfig)}
    unknown = sorted(set(extra) - own - store_keys)
    if unknown:
        raise ValueError(f"{WHERE}: unknown key {', '.join(map(repr, unknown))}; valid keys: "
                         f"{', '.join(sorted(own))} (connector), {', '.join(sorted(store_keys))} (store)")
    opts = parse_options(ConnectorOptions, {k: v for k, v in extra.items() if k in own}, where=WHERE)
    config = StoreConfig.parse({k: v for k, v in extra.items() if k in store_keys}, where=WHERE)
    return opts, config


# -- one store per process and config --------------------------------------------------------------
_STORES: dict[str, DualTierStore] = {}
_STORES_LOCK = threading.Lock()


def _shared_store(config: StoreConfig) -> DualTierStore:
    with _STORES_LOCK:
        key = repr(config)
        if key not in _STORES:
            _STORES[key] = config.build()
        return _STORES[key]


# -- scheduler -> worker metadata -------------------------------------------------------------------
@dataclass
class LoadSpec:
    """Load chunks ``keys`` (tokens ``[stop - len(keys)*chunk, stop)``) into ``block_ids``, writing
    positions from ``start`` on (before it are vLLM's own blocks)."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    start: int
    stop: int
    prompt: list[int]


@dataclass
class SaveSpec:
    """Save chunks ``(key, first token)`` of one request, read from its ``block_ids``."""

    req_id: str
    chunks: list[tuple[str, int]]
    block_ids: list[int]


@dataclass
class VeriCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class ConnectorStats:
    """Counters of one connector instance (``connector_stats`` reads them inside vLLM)."""

    lookups: int = 0  # prompts looked up (scheduler)
    lookup_errors: int = 0  # lookups the store failed (counted as 0 hits)
    hit_tokens: int = 0  # tokens reported to vLLM as loadable (scheduler)
    loads: int = 0  # requests loaded (worker)
    loaded_chunks: int = 0
    failed_chunks: int = 0  # chunks missing / corrupt at load: vLLM recomputes them
    failed_blocks: int = 0
    load_s: float = 0.0  # summed wall time of loads
    compressed_chunks: int = 0  # compressed chunks handed to the drafter
    saved_chunks: int = 0
    save_dropped: int = 0  # saves dropped (queue full)
    save_errors: int = 0


_INSTANCES: dict[str, VeriCacheConnector] = {}


def connector_stats(_model: Any = None) -> dict[str, Any]:
    """``LLM.apply_model`` helper: counters of this process's connectors (after their queued saves
    are written), their store's, and the load drafter's."""
    out: dict[str, Any] = {}
    for role, c in _INSTANCES.items():
        c.flush()
        out[role] = {**dataclasses.asdict(c.stats), "store": dataclasses.asdict(c.store.stats)}
    out["drafts"] = drafts.stats()
    return out


class VeriCacheConnector(KVConnectorBase_V1):
    """vLLM KV connector over a :class:`DualTierStore` (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.opts, config = parse_extra_config(extra)
        mc = vllm_config.model_config
        self.draft_tokens = self.opts.draft_tokens
        if self.draft_tokens is None:
            self.draft_tokens = 0 if str(getattr(vllm_config.device_config, "device_type", "cpu")) == "cpu" else 32
        self.block_size = int(vllm_config.cache_config.block_size)
        if self.opts.chunk_size % self.block_size:
            raise ValueError(f"{WHERE}: chunk_size {self.opts.chunk_size} must be a multiple of vLLM's "
                             f"block size {self.block_size}")
        if vllm_config.cache_config.cache_dtype not in ("auto", str(mc.dtype).removeprefix("torch.")):
            raise ValueError(f"{WHERE}: kv cache dtype {vllm_config.cache_config.cache_dtype!r} is not supported "
                             "(the store keeps the model dtype)")
        self.config = config.with_heads(mc.get_total_num_kv_heads(), where=WHERE)
        self.space = self._key_space(mc)
        self.store = _shared_store(self.config)
        self.stats = ConnectorStats()
        _INSTANCES["scheduler" if role == KVConnectorRole.SCHEDULER else "worker"] = self
        # scheduler state, per request id
        self._hits: dict[str, int] = {}  # hit end found by the last lookup
        self._pending: dict[str, LoadSpec] = {}
        self._blocks: dict[str, list[int]] = {}
        self._prompts: dict[str, list[int]] = {}
        self._saved_to: dict[str, int] = {}  # prompt tokens before this are saved or known stored
        # worker state
        self._layers: list[Tensor] = []
        self._layouts: list[pl.BlockLayout] | None = None
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self._inflight: dict[str, Future] = {}  # full-chunk reads shared by concurrent loads
        self._ckv_lock = threading.Lock()
        self._loader: ThreadPoolExecutor | None = None
        self._saves: queue.Queue | None = None
        self._writer: threading.Thread | None = None

    def _key_space(self, mc: Any) -> KeySpace:
        model = self.config.model_id
        if model is None:
            folder = Path(str(mc.model))
            if not folder.is_dir():
                raise ValueError(f"{WHERE}: model {mc.model!r} is not a local folder: set model_id to name its "
                                 "exact weights (keys must bind them)")
            model = folder_fingerprint(folder, mc.dtype)
        return self.config.key_space(model=model, dtype=mc.dtype, chunk_size=self.opts.chunk_size)

    # == scheduler side =============================================================================
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.opts.load:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        # The last prompt token is always computed by vLLM (it samples the first output from it).
        keys = self.space.token_keys(prompt[:len(prompt) - 1])
        self.stats.lookups += 1
        n = 0
        try:
            for key in keys:
                if not self.store.has_full(key):
                    break
                n += 1
        except Exception as e:  # a dead store is a miss, never an error
            self.stats.lookup_errors += 1
            logger.warning("vericache connector: lookup failed (%s: %s); serving without the store",
                           type(e).__name__, e)
            n = 0
        stop = n * self.opts.chunk_size
        if stop <= num_computed_tokens:
            self._hits.pop(request.request_id, None)
            return 0, False
        self._hits[request.request_id] = stop
        return stop - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens <= 0 or rid not in self._hits:
            return
        stop = self._hits.pop(rid)
        start = stop - num_external_tokens
        c = self.opts.chunk_size
        prompt = list(request.prompt_token_ids)
        keys = self.space.token_keys(prompt[:stop])[start // c:]
        self._pending[rid] = LoadSpec(rid, keys, list(blocks.get_block_ids()[0]), start, stop, prompt)
        self.stats.hit_tokens += num_external_tokens
        self._saved_to[rid] = stop  # what we load is stored already

    def build_connector_meta(self, scheduler_output: Any) -> VeriCacheConnectorMetadata:
        meta = VeriCacheConnectorMetadata(loads=list(self._pending.values()))
        self._pending.clear()
        for rid in scheduler_output.finished_req_ids:
            self._forget(rid)
        if not self.opts.save:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            self._prompts[new.req_id] = list(new.prompt_token_ids or [])
            self._plan_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._prompts:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self._blocks[rid] = list(new_ids[0]) if new_ids else []
            elif new_ids:
                self._blocks[rid].extend(new_ids[0])
            self._plan_save(meta, rid, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        return meta

    def _plan_save(self, meta: VeriCacheConnectorMetadata, rid: str, computed: int) -> None:
        """Chunks of the prompt complete after this step and not yet saved (or stored by anyone)."""
        prompt, c = self._prompts[rid], self.opts.chunk_size
        done = self._saved_to.get(rid, 0)
        upto = min(computed, len(prompt)) // c * c
        if upto <= done:
            return
        keys = self.space.token_keys(prompt[:upto])
        try:
            chunks = [(keys[s // c], s) for s in range(done, upto, c) if not self.store.has_full(keys[s // c])]
        except Exception as e:  # a dead store: nothing to save now
            logger.warning("vericache connector: store check failed (%s: %s); not saving", type(e).__name__, e)
            chunks = []
        self._saved_to[rid] = upto
        if chunks:
            meta.saves.append(SaveSpec(rid, chunks, list(self._blocks[rid])))

    def _forget(self, rid: str) -> None:
        for d in (self._hits, self._pending, self._blocks, self._prompts, self._saved_to):
            d.pop(rid, None)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # saves copy the KV out during the step: blocks may be freed now

    # == worker side ================================================================================
    def register_kv_caches(self, kv_caches: dict[str, Tensor]) -> None:
        def layer_index(name: str) -> int:
            found = re.findall(r"\d+", name)
            return int(found[0]) if found else 0

        names = sorted(kv_caches, key=layer_index)
        self._layer_names = names
        self._layers = [kv_caches[n] for n in names]
        self._loader = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="vericache-load")
        self._saves = queue.Queue(SAVE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="vericache-save", daemon=True)
        self._writer.start()
        atexit.register(self.flush)  # queued saves are written before the worker exits
        drafts.register_source(drafts.ChunkSource(self.store, self.space, self.opts.chunk_size))

    def _layouts_now(self) -> list[pl.BlockLayout]:
        if self._layouts is None:
            ctx = self._vllm_config.compilation_config.static_forward_context
            layouts = []
            for name, kv in zip(self._layer_names, self._layers):
                isa = getattr(ctx[name], "isa", None)
                if isa is None:
                    raise RuntimeError("VeriCacheConnector needs vLLM's CPU attention backend (layer has no 'isa')")
                layouts.append(pl.layout_for(kv, isa))
            self._layouts = layouts
        return self._layouts

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, VeriCacheConnectorMetadata) or self._loader is None:
            return
        for spec in meta.loads:
            self._loader.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        """Compressed chunks to the drafter at once, then full chunks into the blocks as they come."""
        t0 = time.perf_counter()
        c, bs = self.opts.chunk_size, self.block_size
        first = spec.stop - len(spec.keys) * c
        written = spec.start  # positions [start, written) are in vLLM's blocks, verified
        job = None
        try:
            layouts = self._layouts_now()
            chunks = self._fetch(spec.keys)
            if self.draft_tokens and drafts.can_draft():  # no proposer: no compressed bytes moved
                with self._ckv_lock:  # one at a time: loads sharing a prefix then find its chunks hot
                    ckvs = self.store.get_compressed_prefix(self.space.token_keys(spec.prompt[:spec.stop]))
                if ckvs:
                    job = drafts.start(spec.prompt, ckvs, self.store.compressor, len(ckvs) * c, self.draft_tokens)
                    self.stats.compressed_chunks += len(ckvs) if job is not None else 0
            blocks = torch.tensor(spec.block_ids)
            for i in range(len(spec.keys)):
                full = chunks[i].result()
                lo, hi = first + i * c, first + (i + 1) * c
                if full is None or tuple(full.shape[:3]) != (2, len(self._layers), c):
                    break  # a miss or a corrupt chunk: vLLM recomputes from here
                self._write(full[:, :, max(0, spec.start - lo):], blocks, max(lo, spec.start), hi, layouts)
                written = hi
        except Exception as e:  # store down mid-load, bad layout: vLLM recomputes what is missing
            logger.warning("vericache connector: load of %s failed after %d of %d tokens (%s: %s); vLLM "
                           "recomputes the rest", spec.req_id, written - spec.start, spec.stop - spec.start,
                           type(e).__name__, e)
        failed = sorted({spec.block_ids[p // bs] for p in range(written // bs * bs, spec.stop, bs)})
        if job is not None:
            job.load_done()
        with self._lock:
            self.stats.loads += 1
            self.stats.load_s += time.perf_counter() - t0
            self.stats.loaded_chunks += -(-(written - spec.start) // c)
            if failed:
                self.stats.failed_chunks += -(-(spec.stop - written) // c)
                self.stats.failed_blocks += len(failed)
                self._errors.update(failed)
            self._finished.add(spec.req_id)

    def _fetch(self, keys: list[str]) -> list[Future]:
        """Full chunks of ``keys`` as futures, read once for all loads in flight: requests sharing a
        prefix that load at the same time (one step's new requests) share each chunk's read, so the
        prefix crosses the link once, not once per request. Chunks are forgotten once read (a later
        load reads them again); a read that fails gives ``None`` for it and every later key."""
        mine: list[tuple[str, Future]] = []
        with self._lock:
            futures = []
            for key in keys:
                fut = self._inflight.get(key)
                if fut is None:
                    fut = self._inflight[key] = Future()
                    mine.append((key, fut))
                futures.append(fut)
        if mine:
            threading.Thread(target=self._read_chunks, args=(mine,), name="vericache-read", daemon=True).start()
        return futures

    def _read_chunks(self, todo: list[tuple[str, Future]]) -> None:
        results: list[Tensor | None] = []
        try:
            handle = self.store.prefetch([k for k, _ in todo])
            for i, (key, fut) in enumerate(todo):
                full = handle.wait(i)
                self._resolve(key, fut, full)
                results.append(full)
        except Exception as e:  # the store failed mid-read: the rest are misses
            logger.warning("vericache connector: full-chunk read failed (%s: %s)", type(e).__name__, e)
        finally:
            for key, fut in todo[len(results):]:
                self._resolve(key, fut, None)

    def _resolve(self, key: str, fut: Future, value: Tensor | None) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]
        if not fut.done():
            fut.set_result(value)

    def _write(self, full: Tensor, blocks: Tensor, lo: int, hi: int, layouts: list[pl.BlockLayout]) -> None:
        """Write ``full`` (``KV_2LTD`` of positions ``[lo, hi)``) into each layer's paged cache."""
        slots = pl.slots_for(blocks, lo, hi, self.block_size)
        _, _, t, width = full.shape
        for li, (kv, layout) in enumerate(zip(self._layers, layouts)):
            heads = kv.shape[1]
            k, v = (full[p, li].view(t, heads, width // heads).transpose(0, 1) for p in (0, 1))
            pl.scatter(kv, layout, slots, k, v)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM runs a request only after get_finished reported it

    def save_kv_layer(self, layer_name: str, kv_layer: Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, after the forward

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, VeriCacheConnectorMetadata) or not meta.saves or self._saves is None:
            return
        layouts = self._layouts_now()
        c = self.opts.chunk_size
        for spec in meta.saves:
            blocks = torch.tensor(spec.block_ids)
            for key, lo in spec.chunks:
                slots = pl.slots_for(blocks, lo, lo + c, self.block_size)
                ks, vs = zip(*(pl.gather(kv, layout, slots) for kv, layout in zip(self._layers, layouts)))
                try:
                    self._saves.put_nowait((key, kv_to_2ltd(torch.stack(ks), torch.stack(vs)), lo))
                except queue.Full:
                    self.stats.save_dropped += 1

    def _write_loop(self) -> None:
        assert self._saves is not None
        while True:
            item = self._saves.get()
            if item is None:
                return
            key, full, lo = item
            try:
                self.store.put(key, full, start=lo)
                self.stats.saved_chunks += 1
            except Exception as e:  # TierError, a dead server: the chunk is a later miss
                self.stats.save_errors += 1
                logger.warning("vericache connector: save failed (%s: %s)", type(e).__name__, e)
            finally:
                self._saves.task_done()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until queued saves are written (tests, shutdown)."""
        if self._saves is None:
            return
        deadline = time.monotonic() + timeout
        while self._saves.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._finished = self._finished, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def shutdown(self) -> None:
        if self._saves is not None and self._writer is not None:
            self.flush()
            self._saves.put(None)
            self._writer.join(10)
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
