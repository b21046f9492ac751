"""TurboQuant (MSE variant): random rotation, then an optimal scalar codebook per coordinate.

Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate" (2025,
arXiv 2504.19874). Each head vector ``x`` is split into its norm (stored in fp16) and direction
``x / |x|``; the direction is rotated by a random orthogonal matrix ``R`` (QR of a seeded Gaussian,
signs fixed so ``R`` is Haar-distributed). After the rotation every coordinate of a unit vector
in ``d`` dimensions is close to ``N(0, 1/d)`` and nearly independent of the others, so each is
quantized on its own with the Lloyd-Max codebook of ``N(0, 1)`` scaled by ``1/sqrt(d)``, at 2, 3
or 4 bits (codes packed). Decoding looks the codes up, rotates back with ``R^T`` and rescales.

Implemented: TurboQuant_mse (Algorithm 1) for keys and values, with separate bit widths allowed.
Not implemented: the inner-product variant TurboQuant_prod (a 1-bit QJL sketch of the residual) and
the paper's outlier-channel split for non-integer bit widths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from . import register
from .base import KVCompressor, KVQuantizer
from .packing import pack, packed_nbytes, unpack

BITS = (2, 3, 4)
MAX_DIM = 1024  # largest head_dim: the rotation is a dim x dim matrix (QR costs dim^3)


@cache
def lloyd_max(bits: int) -> torch.Tensor:
    """Lloyd-Max (MSE-optimal) centroids of ``N(0, 1)`` at ``bits`` bits, ascending (float64).

    Lloyd's iteration: boundaries are midpoints of neighbouring centroids, each centroid is the
    conditional mean ``(phi(a) - phi(b)) / (Phi(b) - Phi(a))`` of its cell ``(a, b)``.
    """
    n = 2**bits
    pdf = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * math.erfc(-t / math.sqrt(2))  # noqa: E731
    c = [-3 + 6 * (i + 0.5) / n for i in range(n)]
    for _ in range(10000):
        b = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [math.inf]
        new = [(pdf(b[i]) - pdf(b[i + 1])) / (cdf(b[i + 1]) - cdf(b[i])) for i in range(n)]
        if max(abs(x - y) for x, y in zip(new, c)) < 1e-13:
            c = new
            break
        c = new
    return torch.tensor(c, dtype=torch.float64)


@lru_cache(maxsize=32)  # bounded: dim and seed come from chunk headers
def rotation(dim: int, seed: int) -> torch.Tensor:
    """Seeded Haar-random orthogonal ``[dim, dim]`` matrix (float32), ``1 <= dim <= MAX_DIM``."""
    if not 1 <= dim <= MAX_DIM:
        raise ValueError(f"TurboQuant needs 1 <= head_dim <= {MAX_DIM}, got {dim}")
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float().contiguous()


@lru_cache(maxsize=64)
def _codebook(bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids for ``N(0, 1/dim)`` (float32) and the encoding table: the code of every fp16 value,
    indexed by its 16-bit pattern read as unsigned."""
    c = lloyd_max(bits) / math.sqrt(dim)
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    table = torch.bucketize(patterns.double().nan_to_num(0.0), (c[1:] + c[:-1]) / 2)
    return c.float(), table.to(torch.uint8)


def _encode(x: torch.Tensor, bits: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    x = x.float()
    norm = x.norm(dim=-1, keepdim=True)
    # Rotation preserves the norm, so rotate first and normalize the result.
    y = (x @ rotation(d, seed).T).div_(norm.clamp_min(1e-30))
    # Nearest centroid by table lookup on the fp16 bit pattern (bucketize is much slower on CPU).
    # Rounding to fp16 can only flip a coordinate within half an fp16 ulp of a decision boundary,
    # where both centroids are equally near.
    idx = y.to(torch.float16).view(torch.uint16).reshape(-1).int()
    codes = _codebook(bits, d)[1].index_select(0, idx)
    return pack(codes, bits), norm.to(torch.float16)


def _decode(q: torch.Tensor, norm: torch.Tensor, bits: int, seed: int, shape, dtype) -> torch.Tensor:
    d = shape[-1]
    codes = unpack(q, bits, shape[0] * shape[1] * d).int()
    y = _codebook(bits, d)[0].index_select(0, codes).view(shape)
    return (y @ rotation(d, seed)).mul_(norm.float()).to(dtype)


@register
@dataclass
class TurboQuant(KVCompressor, KVQuantizer):
    name = "turboquant"
    bits: int = 4
    k_bits: int | None = None  # keys' bit width; defaults to ``bits``
    v_bits: int | None = None  # values' bit width; defaults to ``bits``
    seed: int = 0  # of the rotation; encoder and decoder must agree

    examples = ({"bits": 2}, {"bits": 3}, {"bits": 4}, {"k_bits": 4, "v_bits": 2})
    # Codes need no range check: unpacked codes are masked to their bit width, so they index
    # inside the 2^bits-entry codebook.
    finite_buffers = ("knorm", "vnorm")

    def validate(self) -> None:
        for name in ("bits", "k_bits", "v_bits"):
            value = getattr(self, name)
            if value is not None and not (type(value) is int and value in BITS):
                raise ValueError(f"{name} must be one of {BITS}, got {value!r}")
        if self.bits is None:
            raise ValueError("bits must be one of (2, 3, 4), got None")
        # values use seed + 1, and a torch seed is at most 2^64 - 1
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**64 - 1:
            raise ValueError(f"seed must be an int in [0, 2^64 - 1), got {self.seed!r}")

    @property
    def kv_bits(self) -> tuple[int, int]:
        return self.k_bits or self.bits, self.v_bits or self.bits

    def layout(self, shape, dtype):
        # Computed, not encoded: encoding builds the dim x dim rotation (a QR), which validating an
        # untrusted header should not cost. test_fuzz checks it against encode.
        h, n, d = shape
        if not 1 <= d <= MAX_DIM:
            raise ValueError(f"TurboQuant needs 1 <= head_dim <= {MAX_DIM}, got {d}")
        out = {}
        for p, bits in zip("kv", self.kv_bits):
            out[f"{p}q"] = (torch.uint8, (packed_nbytes(h * n * d, bits),))
            out[f"{p}norm"] = (torch.float16, (h, n, 1))
        return out

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        kb, vb = self.kv_bits
        kq, kn = _encode(keys, kb, self.seed)
        vq, vn = _encode(values, vb, self.seed + 1)  # independent rotations for K and V
        return {"kq": kq, "knorm": kn, "vq": vq, "vnorm": vn}

    def decode(self, buffers, shape, dtype):
        kb, vb = self.kv_bits
        k = _decode(buffers["kq"], buffers["knorm"], kb, self.seed, shape, dtype)
        v = _decode(buffers["vq"], buffers["vnorm"], vb, self.seed + 1, shape, dtype)
        return k, v
