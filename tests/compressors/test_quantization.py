"""Each quantizer does what its paper says, on inputs where the answer is known.

(Shapes, dtypes, byte counts and codec round trips of every method are in ``test_matrix.py``;
quality on the real model's KV is in ``test_quality.py``.)
"""

from __future__ import annotations

import math

import pytest
import torch

from lmcache_vericache import compressors as C
from lmcache_vericache.compressors.packing import decode_per_token, encode_per_token
from lmcache_vericache.compressors.rotatekv import hadamard
from lmcache_vericache.compressors.turboquant import _codebook, lloyd_max, rotation

H, D = 2, 64


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def roundtrip(name: str, keys: torch.Tensor, values: torch.Tensor, dtype=torch.float32, **params):
    q = C.get(name, **params)
    return q.decode(q.encode(keys.to(dtype), values.to(dtype)), tuple(keys.shape), dtype)


def as_chunk(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[H, n, D]`` keys/values -> a one-layer ``[2, 1, n, H*D]`` chunk."""
    h, n, d = keys.shape
    return torch.stack([x.transpose(0, 1).reshape(n, h * d) for x in (keys, values)]).unsqueeze(1)


# -- KIVI ------------------------------------------------------------------------------------------

def channel_outliers(n: int) -> torch.Tensor:
    """Constant along tokens; channels spanning six orders of magnitude, both signs."""
    mag = torch.logspace(-3, 3, D) * torch.tensor([1.0, -1.0]).repeat(D // 2)
    return mag.expand(H, n, D).contiguous()


def token_outliers(n: int) -> torch.Tensor:
    """Constant along channels; tokens spanning six orders of magnitude."""
    return torch.logspace(-3, 3, n).view(1, n, 1).expand(H, n, D).contiguous()


def test_kivi_quantizes_keys_per_channel_and_values_per_token():
    n = 64
    kivi = dict(bits=2, group_size=32, residual=0)
    k, v = roundtrip("kivi", channel_outliers(n), token_outliers(n), **kivi)
    assert rel(k, channel_outliers(n)) < 1e-3  # one (min, scale) per channel: exact
    assert rel(v, token_outliers(n)) < 1e-3  # one (min, scale) per token: exact
    # Swapped, each grouping mixes the outliers and fails: the grouping axes are really different.
    k, v = roundtrip("kivi", token_outliers(n), channel_outliers(n), **kivi)
    assert rel(k, token_outliers(n)) > 0.05 and rel(v, channel_outliers(n)) > 0.05


def test_kivi_residual_window_is_bit_exact_and_partial_key_groups_join_it():
    n, residual, group = 100, 20, 32
    keys, values = torch.randn(2, H, n, D, generator=gen()).to(torch.bfloat16)
    kivi = C.get("kivi", bits=2, group_size=group, residual=residual)
    n_k, n_v = kivi.split(n)
    assert (n_k, n_v) == (64, 80)  # keys: whole groups of 32 out of the first 80 tokens
    ckv = kivi.compress(as_chunk(keys, values), H)
    assert ckv.buffers["L0.kr"].shape == (H, n - n_k, D) and ckv.buffers["L0.vr"].shape == (H, n - n_v, D)
    layer = kivi.decompress(ckv)[0]
    assert torch.equal(layer.keys[:, n_k:], keys[:, n_k:]) and torch.equal(layer.values[:, n_v:], values[:, n_v:])
    assert not torch.equal(layer.keys[:, :n_k], keys[:, :n_k])  # the rest really is quantized
    assert not torch.equal(layer.values[:, :n_v], values[:, :n_v])


def test_kivi_chunk_shorter_than_the_residual_is_kept_whole():
    keys, values = torch.randn(2, H, 10, D, generator=gen())
    k, v = roundtrip("kivi", keys, values, residual=32)
    assert torch.equal(k, keys) and torch.equal(v, values)


def test_kivi_stores_the_bytes_its_layout_implies():
    n, bits, g = 96, 2, 32
    keys, values = torch.randn(2, H, n, D, generator=gen())
    enc = C.get("kivi", bits=bits, group_size=g, residual=32).encode(keys, values)
    n_k = n_v = 64
    expect = (
        H * n_k * D * bits // 8 + 2 * 2 * H * (n_k // g) * D  # key codes + fp16 min/scale per channel group
        + H * n_v * D * bits // 8 + 2 * 2 * H * n_v * (D // g)  # value codes + fp16 min/scale per token group
        + 2 * H * (n - 64) * D * 4  # fp32 residual keys and values
    )
    assert sum(b.numel() * b.element_size() for b in enc.values()) == expect


# -- INT4 / FP8 / INT8 -----------------------------------------------------------------------------

def test_int4_groups_along_head_dim():
    # Constant within each group of 16 channels, wildly different between groups: exact.
    x = torch.randn(H, 16, D // 16, 1, generator=gen()).mul(100).expand(-1, -1, -1, 16).reshape(H, 16, D)
    k, _ = roundtrip("int4", x, x, group_size=16)
    assert rel(k, x) < 1e-3
    k, _ = roundtrip("int4", x, x, group_size=64)  # one group spans four levels: no longer exact
    assert rel(k, x) > 1e-2


def test_int4_packs_two_codes_per_byte():
    keys, values = torch.randn(2, H, 16, D, generator=gen())
    enc = C.get("int4").encode(keys, values)
    assert enc["kq"].numel() == H * 16 * D // 2 and enc["kmin"].numel() == H * 16 * D // 32


@pytest.mark.parametrize("fmt,mantissa", [("e4m3", 3), ("e5m2", 2)])
def test_fp8_relative_error_matches_its_mantissa_and_never_overflows(fmt, mantissa):
    x = torch.randn(H, 32, D, generator=gen()) * torch.logspace(-2, 4, 32).view(1, 32, 1)
    k, _ = roundtrip("fp8", x, x, format=fmt)
    assert torch.isfinite(k).all()
    big = x.abs() >= x.abs().amax(-1, keepdim=True) / 16  # well inside the normal range
    err = ((k - x).abs() / x.abs())[big]
    assert err.max() <= 2.0 ** -(mantissa + 1) * 1.01  # round to nearest: half an ulp
    z, _ = roundtrip("fp8", torch.zeros(H, 4, D), torch.zeros(H, 4, D), format=fmt)
    assert torch.equal(z, torch.zeros(H, 4, D))


# -- TurboQuant ------------------------------------------------------------------------------------

def test_turboquant_rotation_is_orthogonal_and_seeded():
    r = rotation(D, 0)
    assert torch.allclose(r @ r.T, torch.eye(D), atol=1e-5)
    assert torch.equal(r, rotation(D, 0)) and not torch.allclose(r, rotation(D, 1))


def test_lloyd_max_centroids_match_the_known_gaussian_values():
    assert torch.allclose(lloyd_max(2), torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104], dtype=torch.float64), atol=1e-4)
    assert torch.allclose(lloyd_max(1), torch.tensor([-1.0, 1.0], dtype=torch.float64) * math.sqrt(2 / math.pi))
    assert torch.allclose(lloyd_max(3)[4:], torch.tensor([0.2451, 0.7560, 1.3439, 2.1520], dtype=torch.float64), atol=1e-4)
    for bits in (2, 3, 4):
        c = lloyd_max(bits)
        assert c.numel() == 2**bits and (c.diff() > 0).all()
        assert torch.allclose(c, -c.flip(0), atol=1e-12)  # symmetric


def test_turboquant_table_picks_the_nearest_centroid():
    y = (torch.randn(20000, generator=gen()) / math.sqrt(D)).half().float()
    for bits in (2, 3, 4):
        centroids, table = _codebook(bits, D)
        codes = table[y.half().view(torch.uint16).int()]
        dist = (y.unsqueeze(1) - centroids).abs()
        chosen = dist.gather(1, codes.long().unsqueeze(1)).squeeze(1)
        assert torch.allclose(chosen, dist.min(1).values, atol=1e-6)


@pytest.mark.parametrize("bits,paper_mse", [(2, 0.117), (3, 0.03), (4, 0.009)])
def test_turboquant_mse_on_unit_vectors_matches_the_paper(bits, paper_mse):
    x = torch.randn(H, 2048, 128, generator=gen())
    x = x / x.norm(dim=-1, keepdim=True)
    k, _ = roundtrip("turboquant", x, x, bits=bits)
    mse = (k - x).pow(2).sum(-1).mean().item()  # E ||x - x_hat||^2 for ||x|| = 1
    assert mse == pytest.approx(paper_mse, rel=0.15)


def test_turboquant_keeps_the_norm_and_separate_key_value_bits():
    keys, values = torch.randn(2, H, 64, D, generator=gen())
    k1, v1 = roundtrip("turboquant", keys, values, bits=2)
    k2, _ = roundtrip("turboquant", keys * 1000, values, bits=2)
    assert torch.allclose(k2, k1 * 1000, rtol=2e-3, atol=1e-3)  # scale-equivariant: norm kept apart
    k, v = roundtrip("turboquant", keys, values, k_bits=4, v_bits=2)
    assert rel(k, keys) < rel(k1, keys) and rel(v, values) == pytest.approx(rel(v1, values), rel=0.05)
    enc = C.get("turboquant", k_bits=4, v_bits=2).encode(keys, values)
    assert enc["kq"].numel() == H * 64 * D // 2 and enc["vq"].numel() == H * 64 * D // 4


# -- RotateKV --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [2, 8, 64, 96])
def test_hadamard_is_orthogonal_and_symmetric(dim):
    h = hadamard(dim)
    assert torch.allclose(h @ h.T, torch.eye(dim), atol=1e-6) and torch.equal(h, h.T)
    block = dim & -dim
    assert torch.allclose(h.abs()[h != 0], torch.tensor(block**-0.5))


def test_hadamard_needs_an_even_head_dim():
    with pytest.raises(ValueError, match="even head_dim"):
        hadamard(63)


def test_rotatekv_beats_unrotated_quantization_on_outlier_channels():
    """The point of the rotation: a few huge channels no longer set every group's range."""
    x = torch.randn(H, 256, D, generator=gen())
    x[..., [3, 40]] *= 10
    k, _ = roundtrip("rotatekv", x, x, bits=2)
    plain = decode_per_token(encode_per_token(x, 2, 32, "k"), "k", 2, 32, tuple(x.shape), torch.float32)
    assert rel(k, x) < 0.7 * rel(plain, x)


# -- bits ladders, on random data ------------------------------------------------------------------

LADDERS = {
    "kivi": [("kivi", {"bits": b, "residual": 0}) for b in (2, 4)],
    "turboquant": [("turboquant", {"bits": b}) for b in (2, 3, 4)],
    "rotatekv": [("rotatekv", {"bits": b}) for b in (2, 4)],
    "int": [("int4", {}), ("int8", {})],
    "fp8": [("fp8", {"format": "e5m2"}), ("fp8", {"format": "e4m3"})],
}


@pytest.mark.parametrize("family", list(LADDERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_falls_as_bits_rise(family, dtype):
    keys, values = torch.randn(2, H, 128, D, generator=gen())
    errs = []
    for name, params in LADDERS[family]:
        k, v = roundtrip(name, keys, values, dtype=dtype, **params)
        assert k.dtype == v.dtype == dtype
        errs.append((rel(k, keys), rel(v, values)))
    for lo, hi in zip(errs, errs[1:]):
        assert hi[0] < 0.7 * lo[0] and hi[1] < 0.7 * lo[1], errs


# -- composition -----------------------------------------------------------------------------------

def test_compose_keeps_the_evictors_positions_and_quantizes_the_kept_tokens():
    kv = torch.randn(2, 2, 128, H * D, generator=gen())
    evict = C.get("streamingllm", keep_ratio=0.25, n_sink=4)
    quant = C.get("int4")
    comp = C.get("compose", evict="streamingllm", quant="int4", evict_params={"keep_ratio": 0.25, "n_sink": 4})
    assert comp.evictor() == evict and comp.quantizer() == quant
    ckv = comp.compress(kv, H, start=0)
    ref = evict.compress(kv, H, start=0)
    for lc, le in zip(comp.decompress(ckv), evict.decompress(ref)):
        assert torch.equal(lc.positions, le.positions)
        k, v = quant.decode(quant.encode(le.keys, le.values), tuple(le.keys.shape), kv.dtype)
        assert torch.equal(lc.keys, k) and torch.equal(lc.values, v)
    assert ckv.nbytes < min(ref.nbytes, quant.compress(kv, H).nbytes)
    back = C.decompress(C.from_bytes(C.to_bytes(ckv)))  # rebuilt from its stored parameters
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(back, comp.decompress(ckv)))


# -- bad parameters --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name,params,match",
    [
        ("kivi", {"bits": 3}, "bits"),
        ("kivi", {"group_size": 0}, "group_size"),
        ("kivi", {"residual": -1}, "residual"),
        ("int4", {"group_size": 0}, "group_size"),
        ("fp8", {"format": "e3m4"}, "format"),
        ("turboquant", {"bits": 5}, "bits"),
        ("turboquant", {"k_bits": 1}, "k_bits"),
        ("turboquant", {"v_bits": 8}, "v_bits"),
        ("turboquant", {"seed": -1}, "seed"),
        ("rotatekv", {"bits": 3}, "bits"),
        ("rotatekv", {"group_size": -2}, "group_size"),
        ("compose", {"evict": "kivi"}, "evict must name an eviction method"),
        ("compose", {"quant": "streamingllm"}, "quant must name a quantization method"),
        ("compose", {"quant": "compose"}, "quant must name a quantization method"),
        ("compose", {"evict": "nope"}, "unknown compressor 'nope'"),
        ("compose", {"evict_params": {"keep_ratio": 2.0}}, "keep_ratio"),
        ("compose", {"quant_params": {"bits": 3}}, "bits"),
        ("compose", {"quant_params": [1]}, "quant_params must be a dict"),
    ],
)
def test_bad_parameters_are_clear_errors(name, params, match):
    with pytest.raises(ValueError, match=match):
        C.get(name, **params)


@pytest.mark.parametrize("name", ["int4", "kivi", "rotatekv"])
def test_head_dim_not_a_multiple_of_the_group_is_a_clear_error(name):
    kv = torch.randn(2, 1, 8, 2 * 48)
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple of group_size 32"):
        C.get(name).compress(kv, 2)
