"""Low-bit codes: bit packing and the shared asymmetric min/scale group quantizer.

``pack`` stores ``n`` codes of ``bits`` bits in exactly ``ceil(n * bits / 8)`` bytes. Codes are
packed in blocks of ``k = 8 / gcd(8, bits)`` codes (``k * bits / 8`` whole bytes: 4 two-bit codes per
byte, 8 three-bit codes per 3 bytes, 2 four-bit codes per byte), code ``i`` of a block at bit
``i * bits`` of a little-endian word (the byte order of every platform torch runs on, and of the
codec). Whole-tensor shifts only; the only Python loop is over the ``k`` slots of a block.

``quantize``/``dequantize`` are the asymmetric (min, scale) quantizer shared by INT4, KIVI and
RotateKV: each group (one axis of a grouped view of the tensor) gets an fp16 minimum and an fp16
scale ``(max - min) / (2^bits - 1)``; codes are ``round((x - min) / scale)``.
"""

from __future__ import annotations

from functools import cache
from math import gcd

import torch

Tensor = torch.Tensor


@cache
def _layout(bits: int) -> tuple[int, int, torch.dtype, int, Tensor]:
    """Codes per block, bytes per block, word dtype, bytes per word, code shifts."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    k = 8 // gcd(8, bits)
    nb = k * bits // 8
    word, wb = (torch.uint8, 1) if nb == 1 else (torch.int32, 4) if nb <= 4 else (torch.int64, 8)
    return k, nb, word, wb, torch.arange(k, dtype=word) * bits


def packed_nbytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes in ``[0, 2^bits)`` (any shape, read flat) into a 1-D uint8 tensor."""
    k, nb, word, wb, shifts = _layout(bits)
    flat = codes.reshape(-1)
    n = flat.numel()
    pad = -n % k
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    v = flat.view(-1, k)
    if nb == 1:  # OR of strided slices: faster than a reduction over a tiny axis
        out = v[:, 0].clone()
        for i in range(1, k):
            out |= v[:, i] << (bits * i)
    else:  # bits of different codes do not overlap, so a sum is an OR; keep the word's low bytes
        w = (v.to(word) << shifts).sum(-1, dtype=word)
        out = w.view(torch.uint8).view(-1, wb)[:, :nb].reshape(-1)
    return out[: packed_nbytes(n, bits)].contiguous()


def unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes as a 1-D uint8 tensor."""
    k, nb, word, wb, shifts = _layout(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != packed_nbytes(n, bits):
        raise ValueError(
            f"packed codes must be 1-D uint8 of {packed_nbytes(n, bits)} bytes for {n} {bits}-bit codes, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    pad = -packed.numel() % nb
    if pad:
        packed = torch.cat([packed, packed.new_zeros(pad)])
    if nb == 1:
        w = packed.unsqueeze(-1)
    else:  # each block's bytes become the low bytes of a zeroed word
        buf = packed.new_zeros(packed.numel() // nb, wb)
        buf[:, :nb] = packed.view(-1, nb)
        w = buf.view(word)
    codes = ((w >> shifts) & (2**bits - 1)).to(torch.uint8).view(-1)
    return codes[:n]


def quantize(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric quantization of ``x`` with one group per slice along ``dim``.

    Returns packed codes (uint8, ``x`` read flat), and the fp16 ``min`` and ``scale`` of each group
    (``x``'s shape with ``dim`` reduced to 1). Codes are computed against the fp16-rounded min/scale
    that decoding will use, so rounding the statistics adds no error beyond one step.
    """
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)  # faster than aminmax on CPU
    qmax = 2**bits - 1
    mn = lo.to(torch.float16)
    scale = ((hi - lo) / qmax).to(torch.float16)
    scale = scale.masked_fill(scale == 0, 1.0)  # constant group: every code 0, value = min
    codes = (x - mn.float()).mul_(1.0 / scale.float()).round_().clamp_(0, qmax).to(torch.uint8)
    return pack(codes, bits), mn, scale


def dequantize(
    packed: Tensor, mn: Tensor, scale: Tensor, bits: int, shape: tuple[int, ...], dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """Inverse of :func:`quantize`: ``shape`` is the grouped shape ``x`` had. With ``out`` (a view of
    that shape and ``dtype``), writes there, which spares callers a concatenation."""
    n = 1
    for s in shape:
        n *= s
    codes = unpack(packed, bits, n).view(shape)
    if out is not None:
        return torch.addcmul(mn.float(), codes.float(), scale.float(), out=out)
    return torch.addcmul(mn.float(), codes.float(), scale.float()).to(dtype)


def channel_group(head_dim: int, group_size: int) -> int:
    """Group length along ``head_dim``: ``group_size``, or the whole vector when it is shorter."""
    g = min(group_size, head_dim)
    if head_dim % g:
        raise ValueError(f"head_dim {head_dim} is not a multiple of group_size {group_size}")
    return g


def encode_per_token(x: Tensor, bits: int, group_size: int, prefix: str) -> dict[str, Tensor]:
    """Per-token quantization of ``x`` ``[H, n, D]``, groups of ``group_size`` channels."""
    h, n, d = x.shape
    g = channel_group(d, group_size)
    q, mn, scale = quantize(x.reshape(h, n, d // g, g), bits, dim=-1)
    return {f"{prefix}q": q, f"{prefix}min": mn, f"{prefix}scale": scale}


def decode_per_token(
    buffers: dict[str, Tensor], prefix: str, bits: int, group_size: int, shape: tuple[int, int, int],
    dtype: torch.dtype, out: Tensor | None = None,
) -> Tensor:
    """Inverse of :func:`encode_per_token`, optionally into ``out`` (``[H, n, D]``, may be a view)."""
    h, n, d = shape
    g = channel_group(d, group_size)
    b, grouped = buffers, (h, n, d // g, g)
    q, mn, scale = b[f"{prefix}q"], b[f"{prefix}min"], b[f"{prefix}scale"]
    if out is not None:
        dequantize(q, mn, scale, bits, grouped, dtype, out=out.view(grouped))
        return out
    return dequantize(q, mn, scale, bits, grouped, dtype).view(shape)
