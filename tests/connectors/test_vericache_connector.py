"""VeriCacheConnector's scheduler side and configuration, on vLLM's own config, request and block
classes and a real store (disk; a real Redis server for the dead-store case). The load and save
paths inside a running vLLM are tested end to end in tests/e2e/test_vericache_connector_vllm.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from lmcache_vericache.backends.keys import KeySpace, model_fingerprint  # noqa: E402
from lmcache_vericache.connectors.vericache_connector import (  # noqa: E402
    VeriCacheConnector,
    VeriCacheConnectorMetadata,
    parse_extra_config,
)

CHUNK = 256


def vllm_config(extra: dict, model: str | None = None, block_size: int = 128):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    from lmcache_vericache.models import ensure_smollm2

    mc = ModelConfig(model=model or str(ensure_smollm2()), dtype="float32", max_model_len=4096)
    kv = KVTransferConfig(kv_connector="VeriCacheConnector", kv_role="kv_both", kv_connector_extra_config=extra,
                          kv_connector_module_path="lmcache_vericache.connectors.vericache_connector")
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=block_size), kv_transfer_config=kv)


def scheduler(extra: dict) -> VeriCacheConnector:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return VeriCacheConnector(vllm_config({"chunk_size": CHUNK, **extra}), KVConnectorRole.SCHEDULER, None)


def request(rid: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=8), None)


def blocks(ids: list[int]):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def test_key_space_is_the_engines_for_the_same_weights(smollm2, tmp_path):
    c = scheduler({"capacity": "disk", "disk_path": str(tmp_path / "kv")})
    model, _ = smollm2
    # The engine's space for SmolLM2 fp32 (model identity = digest of its weights, read here from
    # the HF model, there from the safetensors folder vLLM serves).
    assert c.space == KeySpace(model=model_fingerprint(model), dtype="float32", chunk_size=CHUNK, compressor="int8")


def test_lookup_counts_leading_stored_chunks_and_plans_the_load(tmp_path):
    c = scheduler({"capacity": "disk", "disk_path": str(tmp_path / "kv")})
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 49152, (1000,), generator=g).tolist()
    keys = c.space.token_keys(prompt)
    assert len(keys) == 3
    for i in (0, 1, 2):
        c.store.put(keys[i], torch.randn(2, 30, CHUNK, 192, generator=g), start=i * CHUNK)
    req = request("r1", prompt)
    assert c.get_num_new_matched_tokens(req, 0) == (768, True)
    assert c.get_num_new_matched_tokens(req, 768) == (0, False)  # vLLM's own cache has it all
    # vLLM already holds the first block (128 tokens): only the rest is loaded, into blocks 10..15.
    assert c.get_num_new_matched_tokens(req, 128) == (640, True)
    c.update_state_after_alloc(req, blocks(list(range(10, 18))), 640)
    meta = c.build_connector_meta(_empty_scheduler_output())
    assert isinstance(meta, VeriCacheConnectorMetadata) and len(meta.loads) == 1
    load = meta.loads[0]
    assert (load.start, load.stop, load.keys) == (128, 768, keys) and load.block_ids[:6] == list(range(10, 16))
    assert c.build_connector_meta(_empty_scheduler_output()).loads == []  # handed over once
    # vLLM asks again after a load that failed at its first chunk: no second hit (the store listed
    # a chunk it could not serve), so the request is recomputed instead of retried forever.
    c.update_connector_output(_load_report("r1", invalid=set(range(10, 16))))
    assert c.get_num_new_matched_tokens(req, 128) == (0, False)

    # A gap stops the prefix; the last prompt token is never counted (vLLM computes it).
    other = request("r2", prompt[:768])
    assert c.get_num_new_matched_tokens(other, 0) == (512, True)
    assert c.get_num_new_matched_tokens(request("r3", [7] + prompt[1:]), 0) == (0, False)


def test_engines_in_one_process_have_their_own_context_and_store():
    """The scheduler and worker sides of one engine (one VllmConfig) share its context and store
    (a memory store then serves within the engine); a second engine in the same process shares
    neither, and the proposer of an engine finds that engine's context."""
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache_vericache.connectors.worker_context import WorkerContext

    extra = {"chunk_size": CHUNK, "capacity": "memory"}
    cfg_a, cfg_b = vllm_config(extra), vllm_config(extra)
    sched_a = VeriCacheConnector(cfg_a, KVConnectorRole.SCHEDULER, None)
    worker_a = VeriCacheConnector(cfg_a, KVConnectorRole.WORKER, None)
    worker_b = VeriCacheConnector(cfg_b, KVConnectorRole.WORKER, None)
    assert sched_a.context is worker_a.context is WorkerContext.of(cfg_a)
    assert worker_b.context is not worker_a.context and worker_b.context.drafter is not worker_a.context.drafter
    assert sched_a.store is worker_a.store and worker_b.store is not worker_a.store
    prompt = list(range(300))
    key = worker_a.space.token_keys(prompt)[0]
    worker_a.store.put(key, torch.zeros(2, 30, CHUNK, 192))  # saved by engine A's worker
    assert sched_a.get_num_new_matched_tokens(request("a", prompt), 0) == (256, True)
    assert not worker_b.store.has_full(key)
    assert set(worker_a.context.connectors) == {"scheduler", "worker"}
    # Process-local: a copied config (vLLM ships configs to worker processes) starts a fresh context.
    assert WorkerContext.of(copy.deepcopy(cfg_a)) is not worker_a.context


def test_dead_store_is_zero_hits_never_an_error(redis_server_factory):
    server = redis_server_factory()
    c = scheduler({"capacity": "redis", "redis_url": server.url, "redis_timeout_s": 1.0})
    prompt = list(range(600))
    c.store.put(c.space.token_keys(prompt)[0], torch.zeros(2, 30, CHUNK, 192))
    assert c.get_num_new_matched_tokens(request("a", prompt), 0) == (256, True)
    assert c.get_num_new_matched_tokens(request("m", [9] * 600), 0) == (0, False)  # a miss, not an error
    assert c.stats.lookup_errors == 0
    server.kill()
    # The tier logs the refused connection and answers "not stored"; nothing reaches vLLM, and the
    # connector counts a failed lookup (a dead store is not an empty one).
    assert c.get_num_new_matched_tokens(request("b", prompt), 0) == (0, False)
    assert c.stats.lookup_errors == 1 and c.store.stats.tier_errors >= 1


def test_folder_fingerprint_ignores_consolidated_copies_and_stored_buffers(tmp_path):
    from safetensors.torch import save_file

    from lmcache_vericache.backends.keys import folder_fingerprint
    from lmcache_vericache.models import ensure_smollm2

    src = ensure_smollm2()
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).symlink_to(src / f)
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, tmp_path / "consolidated.safetensors")
    save_file({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)}, tmp_path / "extra.safetensors")
    assert folder_fingerprint(tmp_path, "float32") == folder_fingerprint(src, "float32")


def test_bad_configuration_fails_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key 'chunksize'.*chunk_size.*\(connector\).*disk_path.*\(store\)"):
        parse_extra_config({"chunksize": 256})
    with pytest.raises(ValueError, match="kv_connector_extra_config: draft_tokens must be int"):
        parse_extra_config({"draft_tokens": "many"})
    with pytest.raises(ValueError, match="kv_connector_extra_config: capacity must be one of"):
        parse_extra_config({"capacity": "tape"})
    # Built from vLLM's own config as its connector factory does at engine start-up: vLLM stops there.
    with pytest.raises(ValueError, match="kv_connector_extra_config: unknown key 'bogus_key'"):
        scheduler({"capacity": "disk", "disk_path": str(tmp_path / "kv"), "bogus_key": 1})
    with pytest.raises(ValueError, match="chunk_size 200 must be a multiple of vLLM's block size 128"):
        scheduler({"capacity": "disk", "disk_path": str(tmp_path / "kv"), "chunk_size": 200})


def _empty_scheduler_output():
    return _scheduler_output()


def _scheduler_output(new=(), cached=(), resumed=()):
    """vLLM's SchedulerOutput for one step: ``new`` requests (Request, block ids, tokens scheduled),
    ``cached`` running ones (Request, new block ids or None, tokens scheduled), ``resumed`` ids
    among them; each Request's ``num_computed_tokens`` is its count before the step, as vLLM sends."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    cached_data = CachedRequestData.make_empty()
    for req, new_blocks, _ in cached:
        cached_data.req_ids.append(req.request_id)
        cached_data.new_block_ids.append((new_blocks,) if new_blocks is not None else None)
        cached_data.num_computed_tokens.append(req.num_computed_tokens)
        cached_data.num_output_tokens.append(req.num_output_tokens)
    cached_data.resumed_req_ids = set(resumed)
    scheduled = {r.request_id: n for r, _, n in (*new, *cached)}
    return SchedulerOutput(scheduled_new_reqs=[NewRequestData.from_request(r, (b,)) for r, b, _ in new],
                           scheduled_cached_reqs=cached_data, num_scheduled_tokens=scheduled,
                           total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
                           scheduled_encoder_inputs={}, num_common_prefix_blocks=[], finished_req_ids=set(),
                           free_encoder_mm_hashes=[])


def _load_report(rid: str, invalid: set[int] = frozenset()):
    """The workers' output of the step in which ``rid``'s load ended (vLLM's KVConnectorOutput)."""
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(finished_recving={rid}, invalid_block_ids=set(invalid))


def _stored_prefix(c, n_tokens: int, n_stored: int, seed: int = 0) -> tuple[list[int], list[str]]:
    """A random prompt of ``n_tokens`` whose first ``n_stored`` chunks the store holds; its keys."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 49152, (n_tokens,), generator=g).tolist()
    keys = c.space.token_keys(prompt)
    for i in range(n_stored):
        c.store.put(keys[i], torch.randn(2, 30, CHUNK, 192, generator=g), start=i * CHUNK)
    return prompt, keys


def _load(c, req, block_ids: list[int], local: int = 0) -> int:
    """vLLM's scheduler admitting ``req`` with ``local`` tokens of its own cache: lookup, block
    allocation, the step's metadata; returns the tokens handed to the worker to load."""
    n, is_async = c.get_num_new_matched_tokens(req, local)
    if not n:
        return 0
    assert is_async
    c.update_state_after_alloc(req, blocks(block_ids), n)
    req.num_computed_tokens = local + n  # vLLM counts the load as computed while it runs
    loads = c.build_connector_meta(_empty_scheduler_output()).loads
    assert [spec.req_id for spec in loads] == [req.request_id]
    return loads[0].stop - loads[0].start


def test_a_partly_served_prompt_saves_its_new_chunks(tmp_path):
    """The store holds chunks 0-1 of a 5-chunk prompt: they load, and the chunks vLLM computes past
    them (2-4) are saved, in the steps that complete them (chunked prefill), none twice."""
    c = scheduler({"capacity": "disk", "disk_path": str(tmp_path / "kv")})
    prompt, keys = _stored_prefix(c, 5 * CHUNK, 2)
    req, ids = request("r", prompt), list(range(20, 30))
    assert _load(c, req, ids) == 2 * CHUNK
    c.update_connector_output(_load_report("r"))
    # vLLM schedules the loaded request as new: 384 tokens, then the rest of the prompt.
    meta = c.build_connector_meta(_scheduler_output(new=[(req, ids, 384)]))
    assert [(s.req_id, s.chunks, s.block_ids) for s in meta.saves] == [("r", [(keys[2], 512)], ids)]
    req.num_computed_tokens += 384
    meta = c.build_connector_meta(_scheduler_output(cached=[(req, None, 5 * CHUNK - 896)]))
    assert [(s.chunks, s.block_ids) for s in meta.saves] == [([(keys[3], 768), (keys[4], 1024)], ids)]
    req.num_computed_tokens = 5 * CHUNK
    assert c.build_connector_meta(_scheduler_output(cached=[(req, None, 1)])).saves == []


def test_a_preempted_request_loads_again_and_a_failed_load_is_not_retried(tmp_path):
    """vLLM's preemption frees a request's blocks and sets its computed tokens to 0; on resume it
    asks the connector again. A load that succeeded loads again; one that failed at a chunk is
    retried below that chunk only."""
    from vllm.v1.request import RequestStatus

    c = scheduler({"capacity": "disk", "disk_path": str(tmp_path / "kv")})
    prompt, keys = _stored_prefix(c, 4 * CHUNK, 3)
    ok, ids = request("ok", prompt), list(range(8))
    assert _load(c, ok, ids) == 3 * CHUNK
    c.update_connector_output(_load_report("ok"))
    c.build_connector_meta(_scheduler_output(new=[(ok, ids, CHUNK)]))
    # Scheduler._preempt_request, then the next schedule() looks the request up again.
    ok.status, ok.num_computed_tokens = RequestStatus.PREEMPTED, 0
    again = list(range(40, 48))
    assert _load(c, ok, again) == 3 * CHUNK
    c.update_connector_output(_load_report("ok"))
    ok.status = RequestStatus.PREEMPTED  # resumed: sent as a cached request with all its blocks
    meta = c.build_connector_meta(_scheduler_output(cached=[(ok, again, CHUNK)], resumed={"ok"}))
    assert [(s.chunks, s.block_ids) for s in meta.saves] == [([(keys[3], 3 * CHUNK)], again)]

    # A load that failed at chunk 1 (its blocks 2.. reported): vLLM recomputes from token 256, and
    # a later lookup (after a preemption) loads chunk 0 only.
    bad, ids = request("bad", prompt), list(range(60, 68))
    assert _load(c, bad, ids) == 3 * CHUNK
    c.update_connector_output(_load_report("bad", invalid={62, 63, 64, 65, 66, 67}))
    bad.num_computed_tokens = 0
    assert c.get_num_new_matched_tokens(bad, 0) == (CHUNK, True)
    # Another request's failure in the same output does not touch this one's cap.
    c.update_connector_output(_load_report("other", invalid={62}))
    assert c.get_num_new_matched_tokens(request("fresh", prompt), 0) == (3 * CHUNK, True)
    # Finishing the request forgets its cap (vLLM never reuses an id while it is live).
    c.request_finished(bad, [])
    assert c.get_num_new_matched_tokens(bad, 0) == (3 * CHUNK, True)


def test_the_package_logs_through_vllms_handler_inside_vllm():
    # The store's and tiers' loggers are host-independent (lmcache_vericache.*): inside vLLM their
    # errors (a tier's failed reads) must show in vLLM's log format, not as bare stderr lines.
    import re
    import subprocess
    import sys

    code = ("import logging; import lmcache_vericache.connectors.vericache_connector; "
            "from vllm.config import LoggingConfig; from vllm.logger import configure_logging; "
            "configure_logging(LoggingConfig()); "  # as vLLM's engine core does at start-up
            "logging.getLogger('lmcache_vericache.backends.tiers.redis').error('redis tier x: GET failed')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [ln for ln in (out.stdout + out.stderr).splitlines() if "GET failed" in ln]
    # vLLM's format: level, time, [file:line], message (not the bare message of Python's last resort)
    assert len(line) == 1 and re.search(r"ERROR \S+ \S+ \[<string>:1\] redis tier x", line[0]), out.stdout + out.stderr


def test_hooks_of_newer_vllms(tmp_path, monkeypatch):
    """The optional hooks vLLM 0.34 added (0.32 never calls them): a waiting request may load
    asynchronously only if the store holds its first chunk; sleep is safe once queued saves are
    written (unregister_kv_caches waits for them); a preempted request needs no KV hand-off."""
    import threading

    from lmcache_vericache.connectors.paged_transfer import ConnectorStats, SaveSpec, build_transfer

    c = scheduler({"capacity": "disk", "disk_path": str(tmp_path / "kv")})
    prompt, keys = _stored_prefix(c, 3 * CHUNK, 1)
    assert c.may_load_async(request("a", prompt))
    assert not c.may_load_async(request("b", [1] + prompt[1:]))  # first chunk not stored
    assert not c.may_load_async(request("c", prompt[:CHUNK]))  # no chunk before the last token
    c._load_cap["d"] = 0  # its load failed at the first chunk: later lookups do not hit
    assert not c.may_load_async(request("d", prompt))
    assert VeriCacheConnector.supports_sleep_mode(c._kv_transfer_config) and not c.requires_kv_delivery
    c.unregister_kv_caches()  # no transfer on the scheduler side: nothing to drain
    c.restore_kv_caches()

    # Worker side: a save queued behind a slow store is written before unregister_kv_caches returns.
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(4, 3, 128, 128) for i in range(30)}
    release = threading.Event()
    put = c.store.put
    monkeypatch.setattr(c.store, "put", lambda *a, **k: (release.wait(5), put(*a, **k))[1])
    c.transfer = build_transfer(caches, lambda names: ["vec"] * len(names), c.store, c.space, num_kv_heads=3,
                                chunk_size=CHUNK, block_size=128, draft_tokens=0, load_timeout_s=5.0,
                                pinned_pool_bytes=1 << 20, stats=ConnectorStats())
    c.transfer.save([SaveSpec("a", [(keys[1], CHUNK)], [0, 1, 2, 3])])
    assert not c.store.has_full(keys[1])
    threading.Timer(0.3, release.set).start()
    c.unregister_kv_caches()
    assert c.store.has_full(keys[1])
    c.transfer.close()
