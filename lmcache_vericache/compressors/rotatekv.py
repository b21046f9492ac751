"""RotateKV-style: Walsh-Hadamard rotation of each head vector, then low-bit per-token quantization.

After Su et al., "RotateKV: Accurate and Robust 2-Bit KV Cache Quantization for LLMs via
Outlier-Aware Adaptive Rotations" (2025, arXiv 2501.16383). A normalized Hadamard matrix ``H``
(orthogonal and symmetric, so ``H^-1 = H``) spreads the few outlier channels of a head vector over
all channels, which makes a per-token (min, scale) quantization of ``x @ H`` with groups of
``group_size`` channels far more accurate at 2 bits; decoding dequantizes and multiplies by ``H``
again. For a ``head_dim`` that is not a power of two, ``H`` is block-diagonal with the largest
power-of-two block dividing ``head_dim`` (still orthogonal).

Implemented: the Hadamard rotation of keys and values and the 2/4-bit per-token group
quantization of the rotated vectors. Not implemented, because the storage layer cannot see what
they need: the calibrated outlier-aware channel reordering before the rotation, pre-RoPE
grouped-head rotation (stored keys already carry RoPE) and attention-sink-aware quantization (the
quantizer sees no absolute positions; the engine keeps the newest tokens at full precision).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from . import register
from .base import KVCompressor, KVQuantizer
from .packing import decode_per_token, encode_per_token
from .params import check_choice

MAX_DIM = 1024  # largest head_dim: the rotation is a dim x dim matrix


@lru_cache(maxsize=16)  # bounded: dim comes from chunk headers
def hadamard(dim: int) -> torch.Tensor:
    """Normalized (orthogonal, symmetric) Walsh-Hadamard matrix ``[dim, dim]``, block-diagonal with
    the largest power-of-two block that divides ``dim``; ``dim <= MAX_DIM``."""
    if dim > MAX_DIM:
        raise ValueError(f"RotateKV needs head_dim <= {MAX_DIM}, got {dim}")
    block = dim & -dim  # largest power of two dividing dim
    if block < 2:
        raise ValueError(f"RotateKV needs an even head_dim for a Hadamard rotation, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:  # Sylvester construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / h.shape[0] ** 0.5
    return torch.block_diag(*[h] * (dim // block)).float().contiguous()


@register
@dataclass
class RotateKV(KVCompressor, KVQuantizer):
    name = "rotatekv"
    bits: int = 2
    group_size: int = 32  # channels per (min, scale) group

    examples = ({"bits": 2}, {"bits": 4})
    finite_buffers = ("kmin", "kscale", "vmin", "vscale")

    def validate(self) -> None:
        check_choice("bits", self.bits, (2, 4))
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        h = hadamard(keys.shape[-1])
        out = encode_per_token(keys.float() @ h, self.bits, self.group_size, "k")
        return out | encode_per_token(values.float() @ h, self.bits, self.group_size, "v")

    def decode(self, buffers, shape, dtype):
        h = hadamard(shape[-1])
        k = decode_per_token(buffers, "k", self.bits, self.group_size, shape, torch.float32)
        v = decode_per_token(buffers, "v", self.bits, self.group_size, shape, torch.float32)
        return (k @ h).to(dtype), (v @ h).to(dtype)
