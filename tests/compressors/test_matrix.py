"""The shared matrix: every registered method, at every parameter set in its ``examples``, gets
the same checks of shapes, dtypes, positions, byte counts and codec round trip."""

from __future__ import annotations

import pytest
import torch

from lmcache_vericache import compressors as C

CASES = [
    pytest.param(name, params, id=f"{name}-{'-'.join(f'{k}={v}' for k, v in params.items()) or 'default'}")
    for name in C.available()
    for params in C.examples(name)
]
LAYERS, TOKENS, HEADS, HEAD_DIM = 3, 256, 3, 64


def chunk(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, LAYERS, TOKENS, HEADS * HEAD_DIM, generator=g)
    return kv.to(dtype)


def queries() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(LAYERS, HEADS * 3, 8, HEAD_DIM, generator=g)


def compress(name: str, params: dict, kv: torch.Tensor, start: int = 512):
    c = C.get(name, **params)
    return c, c.compress(kv, HEADS, start=start, queries=queries())


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shapes_dtypes_positions(name, params, dtype):
    kv = chunk(dtype)
    c, ckv = compress(name, params, kv)
    assert ckv.method == name and ckv.shape == tuple(kv.shape) and ckv.dtype == dtype
    layers = c.decompress(ckv)
    assert len(layers) == LAYERS
    is_eviction = c.evictor() is not None
    for lk in layers:
        h, n, d = lk.keys.shape
        assert (h, d) == (HEADS, HEAD_DIM) and lk.values.shape == lk.keys.shape
        assert lk.keys.dtype == dtype and lk.values.dtype == dtype
        assert lk.positions.shape == (HEADS, n) and lk.positions.dtype == torch.int64
        assert 0 < n <= TOKENS
        assert (lk.positions >= 512).all() and (lk.positions < 512 + TOKENS).all()
        assert (lk.positions.diff(dim=-1) > 0).all(), "positions must be strictly ascending"
        if not is_eviction:
            assert n == TOKENS  # quantizers keep every token
    if is_eviction:
        assert sum(lk.keys.shape[1] for lk in layers) < LAYERS * TOKENS


@pytest.mark.parametrize("name,params", CASES)
def test_kept_tokens_come_from_their_positions(name, params):
    """Eviction gathers the right rows: the reconstruction at a kept position approximates the
    original token there (exactly, without a quantizer)."""
    kv = chunk()
    c, ckv = compress(name, params, kv, start=0)
    exact = c.quantizer() is None
    for layer, lk in enumerate(c.decompress(ckv)):
        full_k = kv[0, layer].view(TOKENS, HEADS, HEAD_DIM).transpose(0, 1)
        full_v = kv[1, layer].view(TOKENS, HEADS, HEAD_DIM).transpose(0, 1)
        idx = lk.positions.unsqueeze(-1).expand(-1, -1, HEAD_DIM)
        ref_k, ref_v = full_k.gather(1, idx), full_v.gather(1, idx)
        if exact:
            assert torch.equal(lk.keys, ref_k) and torch.equal(lk.values, ref_v)
        else:
            for got, ref in ((lk.keys, ref_k), (lk.values, ref_v)):
                rel = (got - ref).norm() / ref.norm()
                assert rel < 0.6, f"relative error {rel:.3f} too large for {name}"


@pytest.mark.parametrize("name,params", CASES)
def test_byte_counts_are_real(name, params):
    kv = chunk()
    c, ckv = compress(name, params, kv)
    assert ckv.nbytes == sum(b.numel() * b.element_size() for b in ckv.buffers.values())
    assert ckv.full_nbytes == kv.numel() * kv.element_size()
    blob = C.to_bytes(ckv)
    assert ckv.nbytes <= len(blob) < ckv.nbytes + 64 * 1024  # payload + small header
    if name != "none":
        assert ckv.ratio > 1.2, f"{name} stores {ckv.nbytes} of {ckv.full_nbytes} bytes"


@pytest.mark.parametrize("name,params", CASES)
def test_codec_round_trip(name, params):
    kv = chunk(torch.bfloat16)
    c, ckv = compress(name, params, kv)
    back = C.from_bytes(C.to_bytes(ckv))
    assert (back.method, back.params, back.shape, back.dtype, back.start) == (
        ckv.method, ckv.params, ckv.shape, ckv.dtype, ckv.start)
    assert back.buffers.keys() == ckv.buffers.keys()
    for k in ckv.buffers:
        assert torch.equal(back.buffers[k], ckv.buffers[k]), k
    a, b = c.decompress(ckv), C.decompress(back)
    for la, lb in zip(a, b):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
        assert torch.equal(la.positions, lb.positions)


@pytest.mark.parametrize("name,params", CASES)
def test_deterministic(name, params):
    kv = chunk()
    _, a = compress(name, params, kv)
    _, b = compress(name, params, kv)
    assert C.to_bytes(a) == C.to_bytes(b)
