"""The connector's counters through vLLM's own connector-stats interface: interval deltas per side,
summed across sides as vLLM's scheduler sums them, and Prometheus counters as vLLM registers them."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from test_vericache_connector import CHUNK, blocks, request, vllm_config  # noqa: E402

from lmcache_vericache.connectors.vericache_connector import VeriCacheConnector  # noqa: E402
from lmcache_vericache.connectors.vllm_stats import COUNTERS, VeriCacheConnectorStats  # noqa: E402


@pytest.fixture
def sides():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = vllm_config({"chunk_size": CHUNK, "capacity": "memory"})
    return (VeriCacheConnector(cfg, KVConnectorRole.SCHEDULER, None),
            VeriCacheConnector(cfg, KVConnectorRole.WORKER, None))


def test_each_side_reports_its_interval_and_vllm_sums_them(sides):
    sched, worker = sides
    assert sched.get_kv_connector_stats() is None and worker.get_kv_connector_stats() is None  # nothing yet
    prompt = list(range(600))
    keys = sched.space.token_keys(prompt)
    for i, key in enumerate(keys):
        worker.store.put(key, torch.randn(2, 30, CHUNK, 192), start=i * CHUNK)
    req = request("a", prompt)
    assert sched.get_num_new_matched_tokens(req, 0) == (512, True)
    sched.update_state_after_alloc(req, blocks(list(range(8))), 512)  # vLLM takes the hit
    assert worker.store.get_full(keys[0]) is not None and worker.store.get_full("nope") is None
    s, w = sched.get_kv_connector_stats(), worker.get_kv_connector_stats()
    assert s.data == {"lookups": 1, "hit_tokens": 512}  # the shared store is the worker's to count
    assert w.data["full_hits"] == 1 and w.data["full_misses"] == 1 and "lookups" not in w.data
    # vLLM's scheduler: worker stats (rebuilt from their dict, as they cross processes) + its own
    total = VeriCacheConnector.build_kv_connector_stats(w.to_dict()).aggregate(s)
    assert total.reduce()["hit_tokens"] == 512 and total.reduce()["full_hits"] == 1
    assert sched.get_kv_connector_stats() is None  # an interval reports only what changed since the last
    sched.get_num_new_matched_tokens(request("b", prompt), 0)
    assert sched.get_kv_connector_stats().data == {"lookups": 1}  # looked up, not (yet) allocated
    assert VeriCacheConnectorStats().is_empty()


def test_prometheus_counters_as_vllm_registers_them(sides):
    from vllm.config import VllmConfig

    reg = CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (Gauge, Counter, Histogram)}
    prom = VeriCacheConnector.build_prom_metrics(VllmConfig(), types, ["model_name", "engine"],
                                                 {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"loaded_chunks": 3, "hit_tokens": 768, "load_seconds": 0.5}, engine_idx=1)
    prom.observe({"loaded_chunks": 2}, engine_idx=1)
    value = functools.partial(reg.get_sample_value, labels={"model_name": "m", "engine": "1"})
    assert value("vllm:vericache_loaded_chunks_total") == 5
    assert value("vllm:vericache_hit_tokens_total") == 768 and value("vllm:vericache_load_seconds_total") == 0.5
    assert reg.get_sample_value("vllm:vericache_loaded_chunks_total", {"model_name": "m", "engine": "0"}) == 0
    assert {m.name for m in reg.collect()} == {"vllm:vericache_" + n for n in COUNTERS}
