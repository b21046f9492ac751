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
  blocks through the cache's layout strategy (:mod:`.kv_layout`: the probed tile order on vLLM's CPU
  backend, vLLM's logical ``[B, H, N, 2D]`` view on a GPU) and device IO (:mod:`.device_io`: on a
  GPU a pinned host pool, a load and a save stream and an event per copy). A chunk that misses or fails its digest is
  reported through ``get_block_ids_with_load_errors``: vLLM recomputes from there (needs
  ``kv_load_failure_policy: recompute``; vLLM's default fails the request). ``wait_for_save`` copies
  each chunk to save out of the paged cache token-major (``KV_2LTD``) right after the forward and a
  writer thread ``put``\\ s it (full + compressed copy), off the forward's critical path.
* The worker side's data movement (loads, shared reads, saves, their threads and failure rules)
  is :class:`~lmcache_vericache.connectors.paged_transfer.PagedTransfer`; the hooks here are thin.
* **KV layout on a GPU.** The connector does not ask vLLM for a layout
  (``get_required_kvcache_layout`` returns ``None``): the logical view indexes every
  ``KVCacheLayout`` correctly, and a requirement would override the attention backend's preferred
  order (and conflict with another connector's in a multi-connector setup) for no gain here.
* **Tensor and pipeline parallelism.** Each rank stores and loads only its own slice, chunks
  ``[2, layers of its stage, T, its KV heads * D]``, in a key space of its own (``KeySpace.shard``:
  TP size and rank, local KV heads, PP size and stage, layer range; empty at TP = PP = 1, so those
  spaces' ids and stored chunks are unchanged); a rank is never handed another rank's chunk. The
  scheduler has no rank: it knows the world sizes and counts a chunk a hit only where *every* rank's
  space has it (a prefix some rank cannot load is not offered), and plans a save unless every rank
  has the chunk (a lookup costs one ``has_full`` per rank and chunk). Ranks run in processes of
  their own, apart from the scheduler: they share chunks through a shared capacity tier (disk,
  redis, ...); ``capacity: memory`` never hits there. Load-window drafting (``draft_tokens`` > 0)
  is refused with TP or PP > 1: drafts from a side thread would need rank-synchronous collectives.
* One store per engine, held by its :class:`~.worker_context.WorkerContext` (the scheduler and
  worker sides share it where vLLM runs them in one process), so ``capacity: memory`` works within
  one vLLM instance; share across instances with disk, redis, redis_cluster, lm or nixl. Where the
  scheduler runs in another process, its memory store never sees the worker's chunks: it plans
  saves of chunks the worker holds, which the worker skips before gathering them.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
from collections.abc import Mapping
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
from ..options import parse_options
from .paged_transfer import ConnectorStats, LoadSpec, PagedTransfer, SaveSpec, build_transfer
from .vllm_stats import IntervalCounter, VeriCacheConnectorPromMetrics, VeriCacheConnectorStats, snapshot
from .vllm_version import check_connector
from .worker_context import ChunkSource, WorkerContext

logger = logging.getLogger("vllm." + __name__)  # shown by vLLM's log handler
Tensor = torch.Tensor
WHERE = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorOptions:
    """The connector's own keys of ``kv_connector_extra_config`` (the rest is the store config)."""

    chunk_size: int = 256  # tokens per stored chunk; a multiple of vLLM's block size
    save: bool = True  # store complete prompt chunks vLLM computes
    load: bool = True  # serve stored prefixes to vLLM
    # Drafts made over the compressed prefix while the full one loads (needs the proposer). Off by
    # default: on a CPU host the load itself needs the cores (receiving, verifying and writing the
    # chunks) and drafting beside it cost more than it saved (benchmarks/remote_prefix.py, docs/benchmarks.md).
    draft_tokens: int = 0
    load_timeout_s: float = 120.0  # a full chunk not read within this is a failed load (a hung store)
    # Page-locked host memory for chunks crossing to and from a GPU (slabs of one chunk; a load waits
    # for a free slab, a save without one is dropped). Unused on vLLM's CPU backend.
    pinned_pool_bytes: int = 1 << 30

    def validate(self) -> None:
        for name, low in (("chunk_size", 1), ("draft_tokens", 0), ("load_timeout_s", 1e-3),
                          ("pinned_pool_bytes", 1 << 20)):
            if getattr(self, name) < low:
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


# -- scheduler -> worker metadata (LoadSpec / SaveSpec: paged_transfer) -----------------------------
@dataclass
class VeriCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def connector_stats(_model: Any = None) -> dict[str, Any]:
    """``LLM.apply_model`` helper: counters of the worker's engine's connectors (after their queued
    saves are written), their store's, and the load drafter's. The worker's connector is vLLM's
    ``get_kv_transfer_group()``; the scheduler's is in its context where both run in one process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    if not isinstance(worker, VeriCacheConnector):
        return {}
    out: dict[str, Any] = {}
    for role, c in worker.context.connectors.items():
        c.flush()
        out[role] = {**dataclasses.asdict(c.stats), "store": dataclasses.asdict(c.store.stats)}
    out["drafts"] = worker.context.drafter.stats()
    return out


class VeriCacheConnector(KVConnectorBase_V1):
    """vLLM KV connector over a :class:`DualTierStore` (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_connector()
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.opts, config = parse_extra_config(extra)
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        self.tp, self.pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        if self.opts.draft_tokens and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"{WHERE}: draft_tokens > 0 (load-window drafting) needs tensor_parallel_size = "
                             f"pipeline_parallel_size = 1 (got {self.tp} / {self.pp}): drafts from a side thread "
                             "would need rank-synchronous collectives")
        if getattr(mc, "use_mla", False):
            raise ValueError("VeriCacheConnector does not support MLA models (their paged KV has no K/V heads)")
        self.block_size = int(vllm_config.cache_config.block_size)
        if self.opts.chunk_size % self.block_size:
            raise ValueError(f"{WHERE}: chunk_size {self.opts.chunk_size} must be a multiple of vLLM's "
                             f"block size {self.block_size}")
        if vllm_config.cache_config.cache_dtype not in ("auto", str(mc.dtype).removeprefix("torch.")):
            raise ValueError(f"{WHERE}: kv cache dtype {vllm_config.cache_config.cache_dtype!r} is not supported "
                             "(the store keeps the model dtype)")
        self.config = config.with_heads(mc.get_num_kv_heads(pc), where=WHERE)  # this rank's KV heads
        # Every rank's space (index tp_rank + tp * pp_rank); the scheduler's keys are rank 0's.
        self.spaces = self._rank_spaces(mc, pc)
        rank = int(getattr(pc, "rank", 0)) if role == KVConnectorRole.WORKER else 0
        self.space = self.spaces[rank % self.tp + self.tp * (rank // self.tp % self.pp)]
        self.context = WorkerContext.of(vllm_config)
        self.store = self.context.store_for(self.config)
        self.stats = ConnectorStats()
        self.context.connectors["scheduler" if role == KVConnectorRole.SCHEDULER else "worker"] = self
        self._interval = IntervalCounter()  # deltas for vLLM's stats pipeline (get_kv_connector_stats)
        # scheduler state, per request id
        self._hits: dict[str, int] = {}  # hit end found by the last lookup
        self._pending: dict[str, LoadSpec] = {}
        self._blocks: dict[str, list[int]] = {}
        self._prompts: dict[str, list[int]] = {}
        self._saved_to: dict[str, int] = {}  # prompt tokens before this are saved or known stored
        self._loads: dict[str, LoadSpec] = {}  # handed to the worker, until it reports them finished
        # Where a request's failed load stopped (a chunk start): its later lookups (vLLM asks again
        # after a failed load, and after a preemption) hit below it only, so a chunk the store lists
        # but cannot serve is recomputed, not retried forever. A load that succeeded sets none: a
        # preempted request loads its prefix again when it resumes.
        self._load_cap: dict[str, int] = {}
        self.transfer: PagedTransfer | None = None  # worker side, from register_kv_caches

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # any layout: the logical view indexes them all (module docstring)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: nothing is handed off when a request ends (saves copy the KV out during
        its step), so a preempted request need not be recomputed for a pending hand-off."""
        return False

    # Hooks vLLM 0.34 added (KVConnectorBase_V1, optional; earlier vLLMs never call them).
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Sleep mode keeps the KV cache's tensors (their memory is unmapped and mapped again): the
        connector registers nothing with a transport, so it follows the remap."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before sleep: queued saves are written (their host copies were taken during their step), so
        nothing reads the cache while it is unmapped. Idempotent."""
        if self.transfer is not None:
            self.transfer.flush()

    def restore_kv_caches(self) -> None:
        """After wake-up: the same tensors again, nothing to register. Idempotent."""

    def may_load_async(self, request: Any) -> bool:
        """Whether a lookup may report an asynchronous load for ``request`` (vLLM 0.34 asks when it
        enters the waiting queue, lets such loads start while the batch is full, and asks it to be
        cheap): the store holds the prompt's first chunk. A store that fails is no."""
        prompt = request.prompt_token_ids or []
        if not self.opts.load or len(prompt) <= self.opts.chunk_size:
            return False
        if self._load_cap.get(request.request_id, len(prompt)) < self.opts.chunk_size:
            return False  # its load failed at the first chunk: the lookup will not hit again
        try:
            return self._has_everywhere(self.space.token_keys(list(prompt[:self.opts.chunk_size]))[0])
        except Exception:  # a dead store is a miss
            return False

    def _rank_spaces(self, mc: Any, pc: Any) -> list[KeySpace]:
        """The key space of each (TP rank, PP stage): its shard names its KV heads and layers."""
        from vllm.distributed.utils import get_pp_indices

        model = self._model_identity(mc)
        heads, total = mc.get_num_kv_heads(pc), mc.get_total_num_hidden_layers()
        spaces = []
        for stage in range(self.pp):
            lo, hi = get_pp_indices(total, stage, self.pp)
            for r in range(self.tp):
                shard = "" if self.tp == self.pp == 1 else f"tp{self.tp}.{r}.h{heads}/pp{self.pp}.{stage}.l{lo}-{hi}"
                spaces.append(self.config.key_space(model=model, dtype=mc.dtype, chunk_size=self.opts.chunk_size,
                                                    shard=shard))
        return spaces

    def _has_everywhere(self, key: str) -> bool:
        """Every rank's space has the chunk ``key`` (a key of :attr:`space`) names."""
        return all(self.store.has_full(sp.rekey(key)) for sp in self.spaces)

    def _model_identity(self, mc: Any) -> str:
        model = self.config.model_id
        if model is None:
            folder = Path(str(mc.model))
            if not folder.is_dir():
                raise ValueError(f"{WHERE}: model {mc.model!r} is not a local folder: set model_id to name its "
                                 "exact weights (keys must bind them)")
            model = folder_fingerprint(folder, mc.dtype)
        return model

    # == scheduler side =============================================================================
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.opts.load:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        # The last prompt token is always computed by vLLM (it samples the first output from it).
        keys = self.space.token_keys(prompt[:len(prompt) - 1])
        keys = keys[:self._load_cap.get(request.request_id, len(prompt)) // self.opts.chunk_size]
        if not keys:
            return 0, False
        self.stats.lookups += 1
        n, errors = 0, self.store.capacity.io_errors
        try:
            for key in keys:
                if not self._has_everywhere(key):
                    break
                n += 1
        except Exception as e:  # a dead store is a miss, never an error
            logger.warning("vericache connector: lookup failed (%s: %s); serving without the store",
                           type(e).__name__, e)
            n, errors = 0, -1
        # A tier reports a failed check as False (and logs it): its error count tells it from a
        # miss (with a worker sharing the store, one of the load's errors may be counted here).
        self.stats.lookup_errors += self.store.capacity.io_errors != errors
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
        self._pending[rid] = self._loads[rid] = LoadSpec(rid, keys, list(blocks.get_block_ids()[0]), start, stop, prompt)
        self.stats.hit_tokens += num_external_tokens
        # Saves start at vLLM's own prefix: chunks that load are skipped (the store has them), chunks
        # that fail to load are recomputed by vLLM and stored again.
        self._saved_to[rid] = start

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
            chunks = [(keys[s // c], s) for s in range(done, upto, c) if not self._has_everywhere(keys[s // c])]
        except Exception as e:  # a dead store: nothing to save now
            logger.warning("vericache connector: store check failed (%s: %s); not saving", type(e).__name__, e)
            chunks = []
        self._saved_to[rid] = upto
        if chunks:
            meta.saves.append(SaveSpec(rid, chunks, list(self._blocks[rid])))

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' load reports (vLLM's ``KVConnectorOutput``): a finished load that left
        blocks unwritten (``invalid_block_ids``, or the request in ``failed_recving``) caps its
        request's later lookups at the chunk where it stopped."""
        bad = connector_output.invalid_block_ids or set()
        failed = connector_output.failed_recving or set()
        bs, c = self.block_size, self.opts.chunk_size
        for rid in connector_output.finished_recving or ():
            spec = self._loads.pop(rid, None)
            if spec is None:
                continue  # finished (aborted) meanwhile
            lost = [max(i * bs, spec.start) for i, b in enumerate(spec.block_ids)
                    if b in bad and i * bs < spec.stop and (i + 1) * bs > spec.start]  # blocks this load wrote
            if rid in failed:
                lost.append(spec.start)
            if lost:
                self._load_cap[rid] = min(lost) // c * c

    def _forget(self, rid: str) -> None:
        for d in (self._hits, self._pending, self._blocks, self._prompts, self._saved_to, self._loads, self._load_cap):
            d.pop(rid, None)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # saves copy the KV out during the step: blocks may be freed now

    # == worker side: thin hooks over PagedTransfer =================================================
    def register_kv_caches(self, kv_caches: dict[str, Tensor]) -> None:
        ctx = self._vllm_config.compilation_config.static_forward_context
        self.transfer = build_transfer(
            kv_caches, lambda names: [getattr(ctx[n], "isa", None) for n in names], self.store, self.space,
            num_kv_heads=self.config.num_kv_heads, chunk_size=self.opts.chunk_size, block_size=self.block_size,
            draft_tokens=self.opts.draft_tokens, load_timeout_s=self.opts.load_timeout_s,
            pinned_pool_bytes=self.opts.pinned_pool_bytes, stats=self.stats, drafter=self.context.drafter)
        atexit.register(self.transfer.flush)  # queued saves are written before the worker exits
        self.context.source = ChunkSource(self.store, self.space, self.opts.chunk_size)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, VeriCacheConnectorMetadata) and self.transfer is not None:
            for spec in meta.loads:
                self.transfer.load(spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM runs a request only after get_finished reported it

    def save_kv_layer(self, layer_name: str, kv_layer: Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, after the forward

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, VeriCacheConnectorMetadata) and meta.saves and self.transfer is not None:
            self.transfer.save(meta.saves)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until queued saves are written (tests, shutdown)."""
        if self.transfer is not None:
            self.transfer.flush(timeout)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.context.drafter.forget(finished_req_ids)  # drafts of requests that ended (aborted) are never taken
        return None, (self.transfer.take_finished() or None) if self.transfer is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.transfer.take_errors() if self.transfer is not None else set()

    def shutdown(self) -> None:
        if self.transfer is not None:
            self.transfer.close()

    # == vLLM's stats pipeline: its log line and /metrics (connectors/vllm_stats.py) ====================
    def get_kv_connector_stats(self) -> VeriCacheConnectorStats | None:
        worker = self._role != KVConnectorRole.SCHEDULER
        totals = snapshot(self, store=worker, drafts=self.context.drafter.stats() if worker else None)
        delta = self._interval.delta(totals)
        return VeriCacheConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> VeriCacheConnectorStats:
        return VeriCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> VeriCacheConnectorPromMetrics:
        return VeriCacheConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
