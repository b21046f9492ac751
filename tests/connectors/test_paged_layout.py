"""Paged layout round trip against vLLM's own CPU cache-write op (no engine needed)."""

import pytest
import torch

from lmcache_vericache.connectors import paged_layout as pl

ops = pytest.importorskip("vllm._custom_ops")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _write_op_runs(isa: str) -> bool:
    """Whether vLLM's cache-write op takes ``isa`` on this host: on AVX-512 hosts it runs every ISA
    whatever the host supports; on an AVX2-only host the CPU build refuses ``amx`` ("Unsupported
    CPU attention configuration"), and vLLM never selects it there."""
    try:
        pl.probe_layout(isa, torch.bfloat16, 128, 64)
        return True
    except RuntimeError as e:
        if "Unsupported CPU attention configuration" not in str(e):
            raise
        return False


AMX = _write_op_runs("amx")
ISAS = ["vec", "vec16", pytest.param("amx", marks=pytest.mark.skipif(not AMX, reason="vLLM's build refuses amx here"))]


def _vllm_write(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, isa: str) -> None:
    """vLLM's path: the backend views the cache as K/V halves and calls its cache-write op."""
    nb, h, b, _ = cache.shape
    kc, vc = cache.view(nb, h, 2 * b, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), kc, vc, slots, isa)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_size", [64, 80])
def test_round_trip_matches_vllm_op(isa, dtype, head_size):
    g = torch.Generator().manual_seed(0)
    nb, h, b, t = 5, 3, 128, 300
    k = torch.randn(h, t, head_size, generator=g).to(dtype)
    v = torch.randn(h, t, head_size, generator=g).to(dtype)
    block_ids = torch.randperm(nb, generator=g)[:3]  # a request's blocks, not in order
    slots = pl.slots_for(block_ids, 0, t, b)
    ref = torch.zeros(nb, h, b, 2 * head_size, dtype=dtype)
    _vllm_write(ref, slots, k, v, isa)
    layout = pl.layout_for(ref, isa)
    # vLLM wrote it; our gather reads it back exactly.
    k2, v2 = pl.gather(ref, layout, slots)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    # Our inverse writes exactly the bytes vLLM's op wrote.
    ours = torch.zeros_like(ref)
    pl.scatter(ours, layout, slots, k, v)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    # A sub-range (mid-block start) reads back too.
    k3, v3 = pl.gather(ref, layout, pl.slots_for(block_ids, 100, 260, b))
    assert torch.equal(k3, k[:, 100:260]) and torch.equal(v3, v[:, 100:260])


def test_vec_layout_closed_form():
    """The probe finds the vec kernels' tile layout (docs/host-notes.md#vllm-cpu-block-layout):
    K transposed, then V."""
    for dtype in DTYPES:
        assert torch.equal(pl.probe_layout("vec", dtype, 128, 64).src, pl.vec_layout(128, 64).src)
    if AMX:
        assert not torch.equal(pl.probe_layout("amx", torch.bfloat16, 128, 64).src, pl.vec_layout(128, 64).src)


def test_quantized_cache_rejected():
    with pytest.raises(NotImplementedError, match="float8"):
        pl.layout_for(torch.zeros(1, 1, 128, 128, dtype=torch.float8_e4m3fn), "vec")
