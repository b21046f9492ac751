"""Triton decode attention over stored low-bit chunks, dequantized in registers (imports triton:
load it through :mod:`.triton_attention`, which imports it on first use).

One program per (request, KV head, block of query rows, split) walks the request's chunks in tiles
of ``TILE`` tokens that never cross a chunk (a chunk of ``T`` tokens is ``ceil(T / TILE)`` tiles, the
last one masked past ``T``) with an online softmax in base 2. So a tile's chunk slot is one scalar,
its codes are one contiguous ``[TILE, D * BITS / 8]`` block of bytes (each byte loaded once and
unpacked in registers), and its scales a ``[TILE, D / CG]`` (or ``[TILE / TG, D]``) block broadcast
over their groups; all offsets inside a chunk are int32 from one int64 base per buffer. Each tile's
keys and values come from :func:`_dequant_tile`, one function for every format of
:mod:`..compressors.formats`, specialized per K/V side by constexprs (bits, groups, zero, codebook,
residual): the format's math has one shape."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unpack(cbase, rows, quant, D: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr, BYTEWISE: tl.constexpr):
    """``[TILE, D]`` int32 codes of ``BITS`` (2, 3, 4) bits: rows start at byte offsets ``rows``
    ``[TILE, 1]`` from ``cbase``; code ``i`` of a row at bit ``i * BITS`` (compressors/packing.py).
    ``tl.join(a, b)`` + reshape interleaves ``a, b``: the recursion even/odd codes gives code order.
    ``BYTEWISE`` reads each code's byte(s) instead: Triton 3.6 compiled the join + reshape of
    16-row tiles (4 rows per warp) to wrong codes on an H200, and was right at 8+ rows per warp."""
    if BYTEWISE:
        bit = tl.arange(0, D)[None, :] * BITS
        w = tl.load(cbase + rows + (bit >> 3), mask=quant, other=0).to(tl.int32)
        if 8 % BITS != 0:  # a 3-bit code may straddle two bytes of its row (only when it starts past bit 5)
            nxt = quant & ((bit & 7) > 8 - BITS)
            w = w | (tl.load(cbase + rows + (bit >> 3) + 1, mask=nxt, other=0).to(tl.int32) << 8)
        code = (w >> (bit & 7)) & ((1 << BITS) - 1)
    elif BITS == 4:
        w = tl.load(cbase + rows + tl.arange(0, D // 2)[None, :], mask=quant, other=0).to(tl.int32)
        code = tl.join(w & 15, w >> 4)
    elif BITS == 2:
        w = tl.load(cbase + rows + tl.arange(0, D // 4)[None, :], mask=quant, other=0).to(tl.int32)
        code = tl.join(tl.join(w & 3, (w >> 4) & 3), tl.join((w >> 2) & 3, w >> 6))
    else:  # 3 bits: 8 codes in each 3-byte block, read as one 24-bit word
        p = cbase + rows + tl.arange(0, D // 8)[None, :] * 3
        w = (tl.load(p, mask=quant, other=0).to(tl.int32) | (tl.load(p + 1, mask=quant, other=0).to(tl.int32) << 8)
             | (tl.load(p + 2, mask=quant, other=0).to(tl.int32) << 16))
        code = tl.join(tl.join(tl.join(w & 7, (w >> 12) & 7), tl.join((w >> 6) & 7, (w >> 18) & 7)),
                       tl.join(tl.join((w >> 3) & 7, (w >> 15) & 7), tl.join((w >> 9) & 7, w >> 21)))
    if not BYTEWISE:
        code = tl.reshape(code, (TILE, D))
    return code


@triton.jit
def _dequant_tile(codes, scale, zero, lut, res, slot, h, t0, t_in, t_mask, dims, DT: tl.constexpr,
                  H: tl.constexpr, T: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, NQ: tl.constexpr,
                  BITS: tl.constexpr, TG: tl.constexpr, CG: tl.constexpr, HAS_ZERO: tl.constexpr,
                  HAS_LUT: tl.constexpr, HAS_RES: tl.constexpr, BYTEWISE: tl.constexpr):
    """``[TILE, D]`` values of tokens ``t_in = t0 + arange(TILE)`` (chunk-relative) of head ``h`` in
    chunk slot ``slot`` (int64 scalar), as ``zero + lut(code) * scale`` (or the dense residual past
    ``NQ``), rounded to ``DT``."""
    # One chunk slot holds the chunk's buffers of all H heads, as stored; a token's codes are
    # D * BITS / 8 whole bytes (D is a power of 2 >= 16).
    ROW_BYTES: tl.constexpr = D * BITS // 8
    ROWS: tl.constexpr = (NQ + TG - 1) // TG
    G: tl.constexpr = D // CG
    quant = t_mask & (t_in < NQ)
    q2 = quant[:, None]
    cbase = codes + slot * (H * NQ * ROW_BYTES) + h * (NQ * ROW_BYTES)
    if BITS == 8:  # whole bytes: the pointer's type (int8 / uint8) gives the sign
        y = tl.load(cbase + t_in[:, None] * ROW_BYTES + dims[None, :], mask=q2, other=0).to(tl.float32)
    else:
        code = _unpack(cbase, t_in[:, None] * ROW_BYTES, q2, D, TILE, BITS, BYTEWISE)
        if HAS_LUT:
            y = tl.load(lut + code)
        else:
            y = code.to(tl.float32)
    # scale / zero of (head, token group, channel group): one load per group, broadcast.
    sbase = slot * (H * ROWS * G) + h * (ROWS * G)
    if G == 1:  # one per token (group): a [TILE] vector
        si = t_in // TG
        s = tl.load(scale + sbase + si, mask=quant, other=0.0).to(tl.float32)[:, None]
        if HAS_ZERO:
            z = tl.load(zero + sbase + si, mask=quant, other=0.0).to(tl.float32)[:, None]
    elif TG == 1:  # per token, G channel groups: [TILE, G] -> [TILE, G, CG]
        si = t_in[:, None] * G + tl.arange(0, G)[None, :]
        s = tl.load(scale + sbase + si, mask=q2, other=0.0).to(tl.float32)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (TILE, G, CG)), (TILE, D))
        if HAS_ZERO:
            z = tl.load(zero + sbase + si, mask=q2, other=0.0).to(tl.float32)
            z = tl.reshape(tl.broadcast_to(z[:, :, None], (TILE, G, CG)), (TILE, D))
    elif CG == 1 and TG & (TG - 1) == 0 and TILE % TG == 0:  # per channel, TG tokens: [TILE / TG, D]
        r = t0 // TG + tl.arange(0, TILE // TG)
        si = r[:, None] * D + dims[None, :]
        rm = (r < ROWS)[:, None]
        s = tl.load(scale + sbase + si, mask=rm, other=0.0).to(tl.float32)
        s = tl.reshape(tl.broadcast_to(s[:, None, :], (TILE // TG, TG, D)), (TILE, D))
        if HAS_ZERO:
            z = tl.load(zero + sbase + si, mask=rm, other=0.0).to(tl.float32)
            z = tl.reshape(tl.broadcast_to(z[:, None, :], (TILE // TG, TG, D)), (TILE, D))
    else:  # any other grouping: one gather per element
        si = (t_in[:, None] // TG) * G + dims[None, :] // CG
        s = tl.load(scale + sbase + si, mask=q2, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(zero + sbase + si, mask=q2, other=0.0).to(tl.float32)
    x = y * s
    if HAS_ZERO:
        x = x + z
    if HAS_RES:  # the chunk's dense tail [H, T - NQ, D]
        rbase = res + slot * (H * (T - NQ) * D) + h * ((T - NQ) * D)
        r = tl.load(rbase + (t_in - NQ)[:, None] * D + dims[None, :], mask=(t_mask & (t_in >= NQ))[:, None],
                    other=0.0).to(tl.float32)
        x = tl.where(q2, x, r)
    return x.to(DT)


@triton.jit
def decode_attention(q, out, lse, table, lengths, table_stride, M, sm_scale, split_tiles,
                     kc, ks, kz, klut, kr, vc, vs, vz, vlut, vr,
                     H: tl.constexpr, T: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                     K_NQ: tl.constexpr, K_BITS: tl.constexpr, K_TG: tl.constexpr, K_CG: tl.constexpr,
                     K_ZERO: tl.constexpr, K_LUT: tl.constexpr, K_RES: tl.constexpr,
                     V_NQ: tl.constexpr, V_BITS: tl.constexpr, V_TG: tl.constexpr, V_CG: tl.constexpr,
                     V_ZERO: tl.constexpr, V_LUT: tl.constexpr, V_RES: tl.constexpr, SPLITS: tl.constexpr,
                     BYTEWISE: tl.constexpr):
    """q ``[B, H, M, D]`` (rows of one KV head: GQA members x block tokens) over each request's
    first ``lengths[b]`` tokens of the chunks ``table[b]``; out ``[B, H, M, D]`` fp32 and lse
    ``[B, H, M]`` (natural log; -inf and zeros for an empty prefix). With ``SPLITS`` > 1, split ``s``
    of the grid's third axis takes the request's tiles ``[s * split_tiles, (s + 1) * split_tiles)``
    (tile ``i``: chunk ``i // ceil(T / TILE)``) and writes out ``[SPLITS, B, H, M, D]`` and lse
    ``[SPLITS, B, H, M]``, merged by the caller. ``BYTEWISE``: unpack sub-byte codes byte by
    byte (see :func:`_unpack`; set for tiles under 32 rows or 8 rows per warp)."""
    TPC: tl.constexpr = (T + TILE - 1) // TILE  # tiles per chunk
    b = tl.program_id(0)
    h = tl.program_id(1)
    DT = q.dtype.element_ty
    split = tl.program_id(2) % SPLITS
    rows = tl.program_id(2) // SPLITS * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    dims = tl.arange(0, D)
    base = ((b * H + h) * M + rows[:, None]).to(tl.int64) * D + dims[None, :]
    qt = tl.load(q + base, mask=rmask[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # scores in base 2: exp2 is the hardware's exp
    n = tl.load(lengths + b)
    tiles = (n // T) * TPC + (n % T + TILE - 1) // TILE  # each has at least one token < n
    lo = split * split_tiles
    hi = tl.minimum(tiles, lo + split_tiles)
    chunks = table + b.to(tl.int64) * table_stride
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for i in range(lo, hi):
        c = i // TPC
        t0 = (i % TPC) * TILE
        slot = tl.load(chunks + c).to(tl.int64)
        t_in = t0 + tl.arange(0, TILE)
        t_mask = (t_in < T) & (c * T + t_in < n)
        k = _dequant_tile(kc, ks, kz, klut, kr, slot, h, t0, t_in, t_mask, dims, DT, H, T, D, TILE, K_NQ, K_BITS,
                          K_TG, K_CG, K_ZERO, K_LUT, K_RES, BYTEWISE)
        v = _dequant_tile(vc, vs, vz, vlut, vr, slot, h, t0, t_in, t_mask, dims, DT, H, T, D, TILE, V_NQ, V_BITS,
                          V_TG, V_CG, V_ZERO, V_LUT, V_RES, BYTEWISE)
        s = tl.dot(qt, tl.trans(k)) * qk_scale
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DT), v)
        m_i = m_new
    empty = l_i == 0.0
    part = (split * tl.num_programs(0) + b).to(tl.int64) * H + h  # (split, request, head)
    base = (part * M + rows[:, None]) * D + dims[None, :]
    tl.store(out + base, acc / tl.where(empty, 1.0, l_i)[:, None], mask=rmask[:, None])
    lse_i = (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453
    tl.store(lse + part * M + rows, tl.where(empty, float("-inf"), lse_i), mask=rmask)
