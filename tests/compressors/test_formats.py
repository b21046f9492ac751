"""``compressors/formats.py``: a dequantizer built from the format description alone equals each
method's own ``decompress`` bit for bit, and the description counts the stored bytes."""

from __future__ import annotations

import pytest
import torch

from lmcache_vericache import compressors
from lmcache_vericache.compressors import formats

DESCRIBED = [(m, p) for m in ("int8", "int4", "kivi", "turboquant") for p in compressors.examples(m)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("method,params", DESCRIBED, ids=[f"{m}-{p}" for m, p in DESCRIBED])
def test_reference_dequantizer_equals_decompress(method, params, dtype):
    torch.manual_seed(0)
    comp = compressors.get(method, **params)
    for heads, tokens, head_dim in ((3, 40, 64), (2, 100, 128)):
        ckv = comp.compress(torch.randn(2, 2, tokens, heads * head_dim).to(dtype), heads)
        fmt = formats.of_chunk(comp, ckv)
        for layer, want in enumerate(comp.decompress(ckv)):
            k, v = formats.dequantize(fmt, fmt.buffers(ckv, layer))
            assert torch.equal(k, want.keys) and torch.equal(v, want.values)
        assert fmt.bytes_per_head() * heads * ckv.num_layers == ckv.nbytes


def test_kivi_describes_its_residual_tails():
    comp = compressors.get("kivi", bits=2, group_size=16, residual=8)
    fmt = formats.describe(comp, heads=2, tokens=44, head_dim=64, dtype=torch.bfloat16)
    # values: all but the last 8 tokens; keys: the whole 16-token groups of those 36
    assert (fmt.k.n_q, fmt.k.residual, fmt.v.n_q, fmt.v.residual) == (32, "kr", 36, "vr")
    assert (fmt.k.token_group, fmt.k.channel_group, fmt.v.token_group, fmt.v.channel_group) == (16, 1, 1, 16)


def test_methods_without_a_kernel_format_are_refused():
    with pytest.raises(ValueError, match="no kernel format"):
        formats.describe(compressors.get("snapkv"), 2, 40, 64, torch.float32)
    comp = compressors.get("int8")
    ckv = compressors.get("int4").compress(torch.randn(2, 1, 16, 64), 1)
    with pytest.raises(ValueError, match="method 'int4'"):
        formats.of_chunk(comp, ckv)
