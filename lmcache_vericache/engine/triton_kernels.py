"""Triton decode attention over stored low-bit chunks, dequantized in registers (imports triton:
load it through :mod:`.triton_attention`, which imports it on first use).

One program per (request, KV head, block of query rows) walks the request's chunk table in tiles of
``TILE`` tokens with an online softmax. Each tile's keys and values come from :func:`_dequant_tile`,
one function for every format of :mod:`..compressors.formats`, specialized per K/V side by
constexprs (bits, groups, zero, codebook, residual): the format's math has one shape."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dequant_tile(codes, scale, zero, lut, res, slot, h, t_in, t_mask, dims, DT: tl.constexpr,
                  H: tl.constexpr, T: tl.constexpr, D: tl.constexpr, NQ: tl.constexpr, BITS: tl.constexpr,
                  TG: tl.constexpr, CG: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_LUT: tl.constexpr,
                  HAS_RES: tl.constexpr):
    """``[TILE, D]`` values of tokens ``t_in`` (chunk-relative) of head ``h`` in chunk slots ``slot``,
    as ``zero + lut(code) * scale`` (or the dense residual past ``NQ``), rounded to ``DT``."""
    # One chunk slot holds the chunk's buffers of all H heads, as stored.
    CODE_BYTES: tl.constexpr = (H * NQ * D * BITS + 7) // 8
    SCALE_N: tl.constexpr = H * ((NQ + TG - 1) // TG) * (D // CG)
    slot = slot.to(tl.int64)[:, None]
    t2 = t_in[:, None]
    c2 = dims[None, :]
    quant = t_mask[:, None] & (t2 < NQ)
    e = (h * NQ + t2) * D + c2  # code index inside the chunk's [H, NQ, D] codes
    if BITS == 8:  # whole bytes: the pointer's type (int8 / uint8) gives the sign
        y = tl.load(codes + slot * CODE_BYTES + e, mask=quant, other=0).to(tl.float32)
    else:  # code i at bit i * BITS of the little-endian buffer (compressors/packing.py)
        bit = e * BITS
        byte = slot * CODE_BYTES + (bit >> 3)
        w = tl.load(codes + byte, mask=quant, other=0).to(tl.int32)
        if 8 % BITS != 0:  # 3-bit codes may straddle two bytes
            nxt = quant & ((bit >> 3) + 1 < CODE_BYTES)
            w = w | (tl.load(codes + byte + 1, mask=nxt, other=0).to(tl.int32) << 8)
        code = (w >> (bit & 7)) & ((1 << BITS) - 1)
        if HAS_LUT:
            y = tl.load(lut + code)
        else:
            y = code.to(tl.float32)
    si = slot * SCALE_N + (h * ((NQ + TG - 1) // TG) + t2 // TG) * (D // CG) + c2 // CG
    x = y * tl.load(scale + si, mask=quant, other=0.0).to(tl.float32)
    if HAS_ZERO:
        x = x + tl.load(zero + si, mask=quant, other=0.0).to(tl.float32)
    if HAS_RES:  # the chunk's dense tail [H, T - NQ, D]
        ri = slot * (H * (T - NQ) * D) + (h * (T - NQ) + t2 - NQ) * D + c2
        r = tl.load(res + ri, mask=t_mask[:, None] & (t2 >= NQ), other=0.0).to(tl.float32)
        x = tl.where(t2 < NQ, x, r)
    return x.to(DT)


@triton.jit
def decode_attention(q, out, lse, table, lengths, table_stride, M, sm_scale, split_tokens,
                     kc, ks, kz, klut, kr, vc, vs, vz, vlut, vr,
                     H: tl.constexpr, T: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                     K_NQ: tl.constexpr, K_BITS: tl.constexpr, K_TG: tl.constexpr, K_CG: tl.constexpr,
                     K_ZERO: tl.constexpr, K_LUT: tl.constexpr, K_RES: tl.constexpr,
                     V_NQ: tl.constexpr, V_BITS: tl.constexpr, V_TG: tl.constexpr, V_CG: tl.constexpr,
                     V_ZERO: tl.constexpr, V_LUT: tl.constexpr, V_RES: tl.constexpr, SPLITS: tl.constexpr):
    """q ``[B, H, M, D]`` (rows of one KV head: GQA members x block tokens) over each request's
    first ``lengths[b]`` tokens of the chunks ``table[b]``; out ``[B, H, M, D]`` fp32 and lse
    ``[B, H, M]`` (natural log; -inf and zeros for an empty prefix). With ``SPLITS`` > 1, split ``s``
    of the grid's third axis takes tokens ``[s * split_tokens, (s + 1) * split_tokens)`` and writes
    out ``[SPLITS, B, H, M, D]`` and lse ``[SPLITS, B, H, M]``, merged by the caller."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    DT = q.dtype.element_ty
    split = tl.program_id(2) % SPLITS
    rows = tl.program_id(2) // SPLITS * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    dims = tl.arange(0, D)
    base = ((b * H + h) * M + rows[:, None]).to(tl.int64) * D + dims[None, :]
    qt = tl.load(q + base, mask=rmask[:, None], other=0.0)
    n = tl.load(lengths + b)
    lo = split * split_tokens
    n = tl.minimum(n, lo + split_tokens)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, n, TILE):
        t = start + tl.arange(0, TILE)
        t_mask = t < n
        slot = tl.load(table + b.to(tl.int64) * table_stride + t // T, mask=t_mask, other=0)
        t_in = t % T
        k = _dequant_tile(kc, ks, kz, klut, kr, slot, h, t_in, t_mask, dims, DT, H, T, D, K_NQ, K_BITS,
                          K_TG, K_CG, K_ZERO, K_LUT, K_RES)
        v = _dequant_tile(vc, vs, vz, vlut, vr, slot, h, t_in, t_mask, dims, DT, H, T, D, V_NQ, V_BITS,
                          V_TG, V_CG, V_ZERO, V_LUT, V_RES)
        s = tl.dot(qt, tl.trans(k)) * sm_scale
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DT), v)
        m_i = m_new
    empty = l_i == 0.0
    part = (split * tl.num_programs(0) + b).to(tl.int64) * H + h  # (split, request, head)
    base = (part * M + rows[:, None]) * D + dims[None, :]
    tl.store(out + base, acc / tl.where(empty, 1.0, l_i)[:, None], mask=rmask[:, None])
    tl.store(lse + part * M + rows, tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i))), mask=rmask)
