"""vLLM-on-CPU's fused MP objects made token-major: planes written by vLLM's own cache-write op and
gathered by LMCache's own MP transfer (the path a real server's objects take), then untiled by
:mod:`lmcache_vericache.backends.fused_planes` and stored by the L2 adapter with a
compressed copy, and tiled back bit for bit on load."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

import vllm._custom_ops as ops  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.multiprocess.transfer_context.base import gather_paged_kv_to_cpu  # noqa: E402
from test_lmcache_l2 import bits, build_adapter, memory_obj, wait_for  # noqa: E402

from lmcache_vericache.backends import fused_planes as fp  # noqa: E402
from lmcache_vericache.backends.keys import prefix_hashes  # noqa: E402
from lmcache_vericache.connectors.lmcache_source import lmcache_source, open_store, planes_layout  # noqa: E402
from lmcache_vericache.testing.servers import shipped_spec  # noqa: E402

LAYERS, BLOCKS, HEADS, BS, D = 2, 5, 3, 128, 64
CHUNK = 2 * BS
# The tiles written and untiled here are "vec" on every x86 host, not the host's own choice: on an
# AMX host vLLM picks "amx" for bf16, whose tiles only its probe knows (stored as they come, below).
ISA = "vec"


def vllm_cpu_plane(dtype: torch.dtype, seed: int = 0, isa: str = ISA) -> tuple[torch.Tensor, torch.Tensor]:
    """``(object, token-major K/V)``: a chunk of random K/V written into vLLM-CPU caches with vLLM's
    op (blocks out of order, tiled for ``isa``), gathered as LMCache's MP transfer hands it to an adapter."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(LAYERS, CHUNK, HEADS, D, generator=g).to(dtype) for _ in range(2))
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, HEADS, BS, 2 * D, dtype=dtype)
              for i in range(LAYERS)}
    blocks = [3, 1]
    slots = torch.tensor([blocks[t // BS] * BS + t % BS for t in range(CHUNK)])
    for i, cache in enumerate(caches.values()):
        kc, vc = cache.view(BLOCKS, HEADS, 2 * BS, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k[i].contiguous(), v[i].contiguous(), kc, vc, slots, isa)
    (plane,) = gather_paged_kv_to_cpu(caches, blocks, len(blocks))
    return plane, torch.stack([k.reshape(LAYERS, CHUNK, -1), v.reshape(LAYERS, CHUNK, -1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gathered_plane_untiles_to_its_tokens_and_tiles_back_bit_for_bit(dtype):
    plane, kv = vllm_cpu_plane(dtype)
    assert plane.shape == (LAYERS, CHUNK, 2 * HEADS * D)
    tiles = fp.block_layout(fp.isa_of(ISA, dtype, BS, D), BS, D)
    chunk = fp.token_major(plane, tiles, HEADS)
    assert torch.equal(chunk, kv)
    back = torch.zeros_like(plane)
    fp.tile_into(chunk, tiles, HEADS, back)
    assert torch.equal(back.view(torch.uint8), plane.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_adapter_stores_planes_token_major_and_the_proposer_source_reads_their_compressed_copy(tmp_path, dtype):
    plane, kv = vllm_cpu_plane(dtype, seed=1)
    tokens = list(range(100, 100 + CHUNK))
    (chain,) = prefix_hashes(tokens, CHUNK)  # the server's blake3 prefix chain
    # the kv_rank LMCache's MP server gives the one worker of TP = 1 (never 0)
    key = ObjectKey(chunk_hash=chain, model_name="/models/smollm2",
                    kv_rank=ObjectKey.ComputeKVRank(1, 0, 1, 0))
    assert key.kv_rank == fp.kv_rank(1, 0)
    spec = shipped_spec(disk_path=str(tmp_path / "kv"), num_kv_heads=HEADS, vllm_cpu_tiling=ISA)
    adapter = build_adapter(spec)
    try:
        store_id = adapter.submit_store_task([key], [memory_obj(plane.clone())])
        assert wait_for(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)[store_id].is_successful()
        dst = memory_obj(torch.zeros_like(plane))
        load_id = adapter.submit_load_task([key], [dst])
        assert bits(wait_for(adapter.get_load_event_fd(), lambda: adapter.query_load_result(load_id)), 1) == [1]
        assert torch.equal(dst.tensor.view(torch.uint8), plane.view(torch.uint8))  # tiled back exactly
    finally:
        adapter.close()

    # A vLLM beside the server, with the adapter's params: the same key from its tokens, a compressed copy.
    cfg, store = open_store(spec["adapter_params"], HEADS)
    cpu = torch.device("cpu")
    source = lmcache_source(cfg, store, CHUNK, "/models/smollm2", dtype, planes_layout(cpu, ISA, BS))
    (skey,) = source.space.token_keys(tokens)
    assert torch.equal(source.store.get_full(skey), kv)  # stored token-major
    ckv = source.store.get_compressed(skey)
    assert ckv is not None
    for layer, got in enumerate(source.store.compressor.decompress(ckv)):  # these tokens, not tiled bytes
        for part, t in enumerate((got.keys, got.values)):
            want = kv[part, layer].view(CHUNK, HEADS, D).transpose(0, 1).float()
            assert (t.float() - want).abs().max() < 0.05 * want.abs().max()
    # Another ISA's tiles, another block size, a GPU's split planes: other keys, never served.
    for layout in (planes_layout(cpu, "amx", BS), planes_layout(cpu, ISA, 64), planes_layout(torch.device("meta"), None, BS)):
        other = lmcache_source(cfg, store, CHUNK, "/models/smollm2", dtype, layout)
        assert other.space.token_keys(tokens) != [skey] and not store.contains(other.space.token_keys(tokens)[0])
    store.close()


@pytest.mark.parametrize("dtype, isa, tiling", [
    (torch.float32, ISA, "none"),
    pytest.param(torch.bfloat16, "amx", "auto", marks=pytest.mark.skipif(
        not torch.cpu._is_amx_tile_supported(), reason="vLLM picks amx tiles only on an AMX host")),
], ids=["tiling_none", "amx_auto"])
def test_planes_of_unknown_tiles_are_kept_as_they_come_without_a_compressed_copy(tmp_path, dtype, isa, tiling):
    # tiling "none", or vLLM's amx tiles (an AMX host's bf16 under "auto"): full-only, bit for bit
    plane, _ = vllm_cpu_plane(dtype, seed=2, isa=isa)
    (chain,) = prefix_hashes(list(range(CHUNK)), CHUNK)
    key = ObjectKey(chunk_hash=chain, model_name="m", kv_rank=0)
    adapter = build_adapter(shipped_spec(disk_path=str(tmp_path / "kv"), num_kv_heads=HEADS, vllm_cpu_tiling=tiling))
    try:
        store_id = adapter.submit_store_task([key], [memory_obj(plane.clone())])
        assert wait_for(adapter.get_store_event_fd(), adapter.pop_completed_store_tasks)[store_id].is_successful()
        assert adapter.store.stats.puts == 1 and adapter.store.get_compressed(adapter.key(key, plane.shape, plane.dtype)) is None
        dst = memory_obj(torch.zeros_like(plane))
        load_id = adapter.submit_load_task([key], [dst])
        assert bits(wait_for(adapter.get_load_event_fd(), lambda: adapter.query_load_result(load_id)), 1) == [1]
        assert torch.equal(dst.tensor.view(torch.uint8), plane.view(torch.uint8))
    finally:
        adapter.close()


@pytest.mark.parametrize("params, named", [({"vllm_cpu_tiling": "avx"}, "vllm_cpu_tiling"),
                                           ({"vllm_cpu_block_size": 0}, "vllm_cpu_block_size")])
def test_bad_tiling_params_raise_naming_the_key(tmp_path, params, named):
    with pytest.raises(ValueError, match=named):
        build_adapter(shipped_spec(disk_path=str(tmp_path / "kv"), num_kv_heads=HEADS, **params))
    with pytest.raises(ValueError, match=named):  # the proposer's lmcache_store too
        open_store(shipped_spec(disk_path=str(tmp_path / "kv"), **params)["adapter_params"], HEADS)


@pytest.mark.parametrize("params, named", [({"capacity": "memory"}, "lmcache_store.capacity"),
                                           ({"vllm_cpu_tiling": "none"}, "lmcache_store.vllm_cpu_tiling"),
                                           ({"num_kv_heads": 8}, "lmcache_store.num_kv_heads")])
def test_a_proposer_store_that_cannot_be_the_servers_is_refused_at_start_up(tmp_path, params, named):
    with pytest.raises(ValueError, match=named):
        open_store(shipped_spec(disk_path=str(tmp_path / "kv"), **params)["adapter_params"], HEADS)
