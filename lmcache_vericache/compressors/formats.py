"""What an attention kernel reads of a quantized chunk: one description per stored format.

Every quantizer here stores one layer's keys (and values) as codes of a ``[H, n, D]`` tensor read
flat, so element ``(h, t, c)`` is code ``(h * n_q + t) * D + c`` at bit ``index * bits`` of the
little-endian code buffer (:mod:`.packing`), and dequantizes it as

    x = zero + lut(code) * scale        (lut: the code itself, or a codebook entry)
    with a rotation: x = (lut(code) @ R) * scale

with ``scale``/``zero`` per (head, group of ``token_group`` tokens, group of ``channel_group``
channels), read at ``h * rows * (D / channel_group) + (t // token_group) * (D / channel_group) +
c // channel_group`` where ``rows = ceil(n_q / token_group)``. Tokens ``n_q..n`` of a chunk are a
dense residual ``[H, n - n_q, D]`` in the chunk's dtype (KIVI's full-precision tail).

+-------------+------+------------------+-------------+---------------+--------------------------+
| format      | bits | codes            | scale       | zero          | other                    |
+=============+======+==================+=============+===============+==========================+
| int8        | 8    | int8, signed     | fp16 (1, D) | -             | absmax/127 per token     |
| int4        | 4    | uint8, 2 / byte  | fp16 (1, g) | fp16 (1, g)   | g = group_size channels  |
| kivi K      | 2, 4 | uint8            | fp16 (G, 1) | fp16 (G, 1)   | per channel, G tokens    |
| kivi V      | 2, 4 | uint8            | fp16 (1, g) | fp16 (1, g)   | + dense residual tails   |
| turboquant  | 2-4  | uint8            | fp16 norm   | -             | fp32 codebook, rotation  |
+-------------+------+------------------+-------------+---------------+--------------------------+

(``(token_group, channel_group)`` in the scale column.) A kernel reads these buffers as stored;
:func:`dequantize` is the torch reference, equal to the compressor's own ``decode`` bit for bit.
Since TurboQuant's scale is one norm per vector, a kernel may work in the rotated domain: scores
``(q @ R_k^T) . (lut * norm)`` and output ``(sum p * lut * norm) @ R_v``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import CompressedKV, KVCompressor
from .int4 import Int4
from .int8 import Int8
from .kivi import KIVI
from .packing import channel_group, packed_nbytes, unpack
from .turboquant import TurboQuant, _codebook, rotation

Tensor = torch.Tensor


@dataclass(frozen=True)
class Side:
    """How one of K or V is stored in a chunk of ``n`` tokens (see the module docstring).

    ``prefix``: its buffers' name prefix (``k``/``v``); ``codes``/``scale``/``zero``/``residual``:
    buffer names (``None``: absent); ``codebook``: fp32 ``[2^bits]`` or ``None``; ``rotation``: fp32
    ``[D, D]`` or ``None``."""

    bits: int
    n_q: int  # quantized tokens; the rest is the dense residual
    token_group: int
    channel_group: int
    codes: str
    scale: str
    zero: str | None = None
    residual: str | None = None
    codebook: Tensor | None = None
    rotation: Tensor | None = None

    @property
    def signed(self) -> bool:
        return self.bits == 8  # int8 codes are the only signed ones

    def code_bytes(self, heads: int, head_dim: int) -> int:
        return packed_nbytes(heads * self.n_q * head_dim, self.bits)

    def scale_rows(self) -> int:
        return -(-self.n_q // self.token_group)


@dataclass(frozen=True)
class KVFormat:
    """One layer of one chunk: ``heads`` x ``tokens`` x ``head_dim`` in ``dtype``, K and V sides."""

    method: str
    heads: int
    tokens: int
    head_dim: int
    dtype: torch.dtype
    k: Side
    v: Side

    def buffers(self, ckv: CompressedKV, layer: int) -> dict[str, Tensor]:
        """The buffers of ``layer`` a kernel reads (as stored, no copy), by name."""
        parts = ckv.layer_buffers(layer)
        names = [n for s in (self.k, self.v) for n in (s.codes, s.scale, s.zero, s.residual) if n is not None]
        missing = [n for n in names if n not in parts]
        if missing:
            raise ValueError(f"layer {layer} of a {ckv.method!r} chunk has no buffer(s) {missing}")
        return {n: parts[n] for n in names}

    def bytes_per_head(self) -> int:
        """Bytes one KV head of this layer-chunk occupies (codes, scales, zeros, residual; K and V)."""
        total = 0
        for s in (self.k, self.v):
            stat = s.scale_rows() * (self.head_dim // s.channel_group) * 2
            total += s.code_bytes(1, self.head_dim) + stat * (1 + (s.zero is not None))
            if s.residual is not None:
                total += (self.tokens - s.n_q) * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        return total


def describe(compressor: KVCompressor, heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> KVFormat:
    """The format of ``compressor``'s chunks of ``tokens`` tokens; ``ValueError`` for a method whose
    chunks no kernel reads (evictions keep per-layer positions; fp8, rotatekv, compose are not
    described)."""
    c, d = compressor, head_dim
    if isinstance(c, Int8):
        sides = [Side(8, tokens, 1, d, f"{p}q", f"{p}s") for p in "kv"]
    elif isinstance(c, Int4):
        g = channel_group(d, c.group_size)
        sides = [Side(4, tokens, 1, g, f"{p}q", f"{p}scale", f"{p}min") for p in "kv"]
    elif isinstance(c, KIVI):
        n_k, n_v = c.split(tokens)
        sides = [Side(c.bits, n_k, c.group_size, 1, "kq", "kscale", "kmin", "kr" if n_k < tokens else None),
                 Side(c.bits, n_v, 1, channel_group(d, c.group_size), "vq", "vscale", "vmin",
                      "vr" if n_v < tokens else None)]
    elif isinstance(c, TurboQuant):
        sides = [Side(bits, tokens, 1, d, f"{p}q", f"{p}norm", codebook=_codebook(bits, d)[0],
                      rotation=rotation(d, c.seed + i)) for i, (p, bits) in enumerate(zip("kv", c.kv_bits))]
    else:
        raise ValueError(f"compressor {c.name!r} has no kernel format; described: int8, int4, kivi, turboquant")
    return KVFormat(c.name, heads, tokens, d, dtype, *sides)


def of_chunk(compressor: KVCompressor, ckv: CompressedKV) -> KVFormat:
    """:func:`describe` for the chunks ``ckv`` is one of."""
    if ckv.method != compressor.name:
        raise ValueError(f"chunk of method {ckv.method!r} given with compressor {compressor.name!r}")
    return describe(compressor, ckv.num_kv_heads, ckv.num_tokens, ckv.head_dim, ckv.dtype)


def dequantize(fmt: KVFormat, buffers: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Reference dequantizer from the description alone: one layer's keys and values
    ``[H, n, D]`` in ``fmt.dtype``, as the compressor's ``decode`` computes them."""
    return tuple(_side(fmt, s, buffers) for s in (fmt.k, fmt.v))  # type: ignore[return-value]


def _side(fmt: KVFormat, s: Side, b: dict[str, Tensor]) -> Tensor:
    h, n, d = fmt.heads, fmt.tokens, fmt.head_dim
    out = torch.empty(h, n, d, dtype=fmt.dtype)
    if s.n_q:
        codes = b[s.codes]
        if s.bits == 8:
            y = codes.view(torch.int8 if s.signed else torch.uint8).reshape(h, s.n_q, d).float()
        else:
            y = unpack(codes, s.bits, h * s.n_q * d).view(h, s.n_q, d)
            y = s.codebook.index_select(0, y.reshape(-1).int()).view(h, s.n_q, d) if s.codebook is not None else y.float()
        if s.rotation is not None:
            y = y @ s.rotation
        # Grouped views as the compressors take them, so the float ops (and their rounding) match.
        tg, cg = s.token_group, s.channel_group
        grouped = (h, s.n_q // tg, tg, d // cg, cg)
        stat = (h, s.n_q // tg, 1, d // cg, 1)
        scale = b[s.scale].float().view(stat)
        x = (torch.addcmul(b[s.zero].float().view(stat), y.view(grouped), scale) if s.zero is not None
             else y.view(grouped) * scale)
        out[:, :s.n_q] = x.view(h, s.n_q, d)
    if s.n_q < n:
        out[:, s.n_q:] = b[s.residual]
    return out
