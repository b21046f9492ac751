"""The connector's counters in vLLM's own stats pipeline: its log line and ``vllm serve``'s ``/metrics``.

vLLM asks every connector for the stats of the last interval (``get_kv_connector_stats``: the
worker side after each step, the scheduler side after each update), sums what the workers and the
scheduler return (:meth:`VeriCacheConnectorStats.aggregate`), logs the reduced values with its
throughput line and feeds them to the connector's Prometheus metrics
(:class:`VeriCacheConnectorPromMetrics`), registered beside vLLM's own as ``vllm:vericache_*``.

Every value is a counter delta since the connector's last report, so intervals and workers add up.
Which side counts what (a store shared by both sides in one process is counted once, by the worker):

| counter | side | meaning |
|---|---|---|
| ``lookups``, ``lookup_errors``, ``hit_tokens`` | scheduler | prompts looked up, failed lookups, tokens offered |
| ``loads``, ``loaded_chunks``, ``failed_chunks``, ``failed_blocks``, ``load_seconds`` | worker | loads and their outcome |
| ``store_bytes_read`` | worker | bytes the store read from its capacity tier |
| ``saved_chunks``, ``save_dropped``, ``save_errors`` | worker | saves |
| ``compressed_hits`` / ``_misses``, ``full_hits`` / ``_misses`` | worker | store tiers |
| ``rejected_corrupt``, ``rejected_invalid``, ``rejected_unauthenticated`` | worker | chunks refused |
| ``draft_tokens_during_load``, ``draft_jobs_taken`` | worker | load-window drafting |

The proposer's acceptance is not here: vLLM's own ``vllm:spec_decode_*`` metrics count it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

PREFIX = "vllm:vericache_"

#: counter name -> Prometheus documentation (the table above)
COUNTERS: Mapping[str, str] = MappingProxyType({
    "lookups": "Prompts the VeriCache connector looked up in its store.",
    "lookup_errors": "Lookups the store failed (served as 0 hits).",
    "hit_tokens": "Prompt tokens the connector offered vLLM from its store.",
    "loads": "Requests whose prefix the connector loaded (or tried to).",
    "loaded_chunks": "Full chunks loaded into vLLM's KV cache.",
    "failed_chunks": "Chunks that missed or failed verification at load: recomputed by vLLM.",
    "failed_blocks": "KV blocks reported to vLLM as failed loads (recomputed).",
    "load_seconds": "Summed wall time of the connector's loads.",
    "store_bytes_read": "Bytes the store read from its capacity tier (full and compressed chunks).",
    "saved_chunks": "Chunks the connector stored.",
    "save_dropped": "Saves dropped because the save queue was full.",
    "save_errors": "Saves the store failed.",
    "compressed_hits": "Compressed-chunk reads served (hot or capacity tier).",
    "compressed_misses": "Compressed-chunk reads that missed.",
    "full_hits": "Full-chunk reads served.",
    "full_misses": "Full-chunk reads that missed (absent, corrupt or failed).",
    "rejected_corrupt": "Chunks that failed their digest (deleted).",
    "rejected_invalid": "Chunks that parsed but do not fit this store or fail validation.",
    "rejected_unauthenticated": "Chunks whose MAC did not verify.",
    "draft_tokens_during_load": "Tokens drafted over compressed chunks while the full prefix loaded.",
    "draft_jobs_taken": "Load-window drafts the proposer used (first draft = sampled token).",
})

# the counter -> where it comes from: (source, field) of the connector's own stats objects
_SOURCES: Mapping[str, tuple[str, str]] = MappingProxyType({
    "lookups": ("connector", "lookups"), "lookup_errors": ("connector", "lookup_errors"),
    "hit_tokens": ("connector", "hit_tokens"), "loads": ("connector", "loads"),
    "loaded_chunks": ("connector", "loaded_chunks"), "failed_chunks": ("connector", "failed_chunks"),
    "failed_blocks": ("connector", "failed_blocks"), "load_seconds": ("connector", "load_s"),
    "store_bytes_read": ("store", "bytes_read"), "saved_chunks": ("connector", "saved_chunks"),
    "save_dropped": ("connector", "save_dropped"), "save_errors": ("connector", "save_errors"),
    "compressed_hits": ("store", "compressed_hits"), "compressed_misses": ("store", "compressed_misses"),
    "full_hits": ("store", "full_hits"), "full_misses": ("store", "full_misses"),
    "rejected_corrupt": ("store", "corrupt"), "rejected_invalid": ("store", "invalid"),
    "rejected_unauthenticated": ("store", "unauthenticated"),
    "draft_tokens_during_load": ("drafts", "during_load"), "draft_jobs_taken": ("drafts", "taken"),
})


def snapshot(connector: Any, *, store: bool, drafts: Mapping[str, Any] | None) -> dict[str, float]:
    """The connector's counters now (totals), named as :data:`COUNTERS`. ``store``: include the
    store's (the side that reports them); ``drafts``: the load drafter's stats, or ``None``."""
    sources = {"connector": dataclasses.asdict(connector.stats),
               "store": dataclasses.asdict(connector.store.stats) if store else {},
               "drafts": dict(drafts or {})}
    return {name: float(sources[src][field]) for name, (src, field) in _SOURCES.items() if field in sources[src]}


class IntervalCounter:
    """Turns totals into deltas since the previous :meth:`delta` call (one per connector side)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def delta(self, totals: Mapping[str, float]) -> dict[str, float]:
        out = {k: v - self._last.get(k, 0.0) for k, v in totals.items()}
        self._last = dict(totals)
        return {k: v for k, v in out.items() if v}


@dataclass
class VeriCacheConnectorStats(KVConnectorStats):
    """``data``: counter deltas of one interval, by name; aggregation sums them (workers, scheduler)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> VeriCacheConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 3) if isinstance(v, float) and not v.is_integer() else int(v)
                for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class VeriCacheConnectorPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` entry (``vllm:vericache_<name>_total``), per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=PREFIX + name, documentation=doc, labelnames=labelnames)
            self.counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
