"""Triton decode attention over stored low-bit chunks, dequantized in registers (imports triton:
load it through :mod:`.triton_attention`, which imports it on first use).

One program per (request, KV head, block of query rows, split) walks its split's share of the
request's own chunks in tiles of ``TILE`` tokens that never cross a chunk (a chunk of ``T`` tokens
is ``ceil(T / TILE)`` tiles, the last one masked past ``T``) with an online softmax in base 2. So a
tile's chunk slot is one scalar, its codes are one contiguous ``[TILE, D * BITS / 8]`` block of
bytes (each byte loaded once and unpacked in registers), and its scales a ``[TILE, D / CG]`` (or
``[TILE / TG, D]``) block broadcast over their groups; all offsets inside a chunk are int32 from one
int64 base per buffer. Each tile's keys and values come from :func:`_dequant_tile`, one function for
every format of :mod:`..compressors.formats`, specialized per K/V side by constexprs (bits, groups,
zero, codebook, residual): the format's math has one shape.

The kernel is bound by the bytes it reads, so it spends no work per element that a format lets it
skip: a side with one scale (and zero) per token and head and no residual (``*_FOLD``: int8,
TurboQuant's norms, int4 whose group is the whole head) is never dequantized. Its codes (integers
of at most 8 bits, exact in fp16 and bf16; or codebook entries) go to the dot products as they are,
and the scale moves to the ``[BLOCK_M, TILE]`` side: scores times the key's scale (plus its zero
times ``sum(q)``), probabilities times the value's scale (plus ``sum_t p_t * zero_t`` on every dim).
Per-channel groups (int4's smaller groups, KIVI) and residual tails take :func:`_dequant_tile`.
:func:`merge_splits` merges the splits' partials (and optionally the caller's exact suffix) in one
launch."""

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
def _values(codes, lut, slot, h, t_in, q2, dims, H: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
            NQ: tl.constexpr, BITS: tl.constexpr, HAS_LUT: tl.constexpr, BYTEWISE: tl.constexpr):
    """``[TILE, D]`` fp32 ``lut(code)`` of tokens ``t_in`` ``[TILE]`` (rows masked by ``q2``
    ``[TILE, 1]``: 0) of head ``h`` in chunk slot ``slot``: the code itself (an integer of at most
    8 bits, exact in fp16 and bf16) or its codebook entry."""
    # One chunk slot holds the chunk's buffers of all H heads, as stored; a token's codes are
    # D * BITS / 8 whole bytes (D is a power of 2 >= 16).
    ROW_BYTES: tl.constexpr = D * BITS // 8
    cbase = codes + slot * (H * NQ * ROW_BYTES) + h * (NQ * ROW_BYTES)
    if BITS == 8:  # whole bytes: the pointer's type (int8 / uint8) gives the sign
        y = tl.load(cbase + t_in[:, None] * ROW_BYTES + dims[None, :], mask=q2, other=0).to(tl.float32)
    else:
        code = _unpack(cbase, t_in[:, None] * ROW_BYTES, q2, D, TILE, BITS, BYTEWISE)
        if HAS_LUT:
            y = tl.load(lut + code)
        else:
            y = code.to(tl.float32)
    return y


@triton.jit
def _token_stat(stat, slot, h, t_in, quant, H: tl.constexpr, NQ: tl.constexpr, TG: tl.constexpr):
    """``[TILE]`` fp32 scale (or zero) of tokens ``t_in`` where there is one per token (group) and
    head (``channel_group == D``); 0 where ``quant`` is false."""
    ROWS: tl.constexpr = (NQ + TG - 1) // TG
    return tl.load(stat + slot * (H * ROWS) + h * ROWS + t_in // TG, mask=quant, other=0.0).to(tl.float32)


@triton.jit
def _dequant_tile(codes, scale, zero, lut, res, slot, h, t0, t_in, t_mask, dims, DT: tl.constexpr,
                  H: tl.constexpr, T: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, NQ: tl.constexpr,
                  BITS: tl.constexpr, TG: tl.constexpr, CG: tl.constexpr, HAS_ZERO: tl.constexpr,
                  HAS_LUT: tl.constexpr, HAS_RES: tl.constexpr, BYTEWISE: tl.constexpr):
    """``[TILE, D]`` values of tokens ``t_in = t0 + arange(TILE)`` (chunk-relative) of head ``h`` in
    chunk slot ``slot`` (int64 scalar), as ``zero + lut(code) * scale`` (or the dense residual past
    ``NQ``), rounded to ``DT``: the general path (the kernel folds a per-token scale out instead)."""
    ROWS: tl.constexpr = (NQ + TG - 1) // TG
    G: tl.constexpr = D // CG
    quant = t_mask & (t_in < NQ)
    q2 = quant[:, None]
    y = _values(codes, lut, slot, h, t_in, q2, dims, H, D, TILE, NQ, BITS, HAS_LUT, BYTEWISE)
    # scale / zero of (head, token group, channel group): one load per group, broadcast.
    sbase = slot * (H * ROWS * G) + h * (ROWS * G)
    if G == 1:  # one per token (group): a [TILE] vector
        s = _token_stat(scale, slot, h, t_in, quant, H, NQ, TG)[:, None]
        if HAS_ZERO:
            z = _token_stat(zero, slot, h, t_in, quant, H, NQ, TG)[:, None]
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
def decode_attention(q, out, lse, table, lengths, table_stride, M, sm_scale,
                     kc, ks, kz, klut, kr, vc, vs, vz, vlut, vr,
                     H: tl.constexpr, T: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                     K_NQ: tl.constexpr, K_BITS: tl.constexpr, K_TG: tl.constexpr, K_CG: tl.constexpr,
                     K_ZERO: tl.constexpr, K_LUT: tl.constexpr, K_RES: tl.constexpr, K_FOLD: tl.constexpr,
                     V_NQ: tl.constexpr, V_BITS: tl.constexpr, V_TG: tl.constexpr, V_CG: tl.constexpr,
                     V_ZERO: tl.constexpr, V_LUT: tl.constexpr, V_RES: tl.constexpr, V_FOLD: tl.constexpr,
                     SPLITS: tl.constexpr, BYTEWISE: tl.constexpr):
    """q ``[B, H, M, D]`` (rows of one KV head: GQA members x block tokens) over each request's
    first ``lengths[b]`` tokens of the chunks ``table[b]``; out ``[B, H, M, D]`` fp32 and lse
    ``[B, H, M]`` (natural log; -inf and zeros for an empty prefix). With ``SPLITS`` > 1, split ``s``
    of the grid's third axis takes tiles ``[s * n, (s + 1) * n)`` of the request's own ``tiles``,
    ``n = ceil(tiles / SPLITS)`` (tile ``i``: chunk ``i // ceil(T / TILE)``), so a short request's
    splits share its few tiles rather than idling, and writes out ``[SPLITS, B, H, M, D]`` and lse
    ``[SPLITS, B, H, M]``, merged by :func:`merge_splits`. ``K_FOLD``/``V_FOLD``: the side has one
    scale (and zero) per token and no residual, folded out of the tile (scores from the raw codes
    times the key's scale; probabilities times the value's scale); the other sides go through
    :func:`_dequant_tile`. ``BYTEWISE``: unpack sub-byte codes byte by byte (see :func:`_unpack`;
    set for tiles under 32 rows or 8 rows per warp)."""
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
    if K_ZERO:  # a folded key zero adds zero * sum(q) to the score
        qsum = tl.sum(qt.to(tl.float32), 1)
    qk_scale = sm_scale * 1.4426950408889634  # scores in base 2: exp2 is the hardware's exp
    n = tl.load(lengths + b)
    tiles = (n // T) * TPC + (n % T + TILE - 1) // TILE  # each has at least one token < n
    split_tiles = (tiles + SPLITS - 1) // SPLITS
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
        if K_FOLD:  # [BLOCK_M, TILE] scores times the per-key scale, not [TILE, D] keys
            kq = t_mask & (t_in < K_NQ)
            y = _values(kc, klut, slot, h, t_in, kq[:, None], dims, H, D, TILE, K_NQ, K_BITS, K_LUT, BYTEWISE)
            s = tl.dot(qt, tl.trans(y.to(DT))) * _token_stat(ks, slot, h, t_in, kq, H, K_NQ, K_TG)[None, :]
            if K_ZERO:
                s += qsum[:, None] * _token_stat(kz, slot, h, t_in, kq, H, K_NQ, K_TG)[None, :]
        else:
            k = _dequant_tile(kc, ks, kz, klut, kr, slot, h, t0, t_in, t_mask, dims, DT, H, T, D, TILE, K_NQ, K_BITS,
                              K_TG, K_CG, K_ZERO, K_LUT, K_RES, BYTEWISE)
            s = tl.dot(qt, tl.trans(k))
        s = tl.where(t_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_FOLD:  # p times the per-value scale, over the tile's largest (p * scale stays in [0, 1]: fp16's range)
            vq = t_mask & (t_in < V_NQ)
            y = _values(vc, vlut, slot, h, t_in, vq[:, None], dims, H, D, TILE, V_NQ, V_BITS, V_LUT, BYTEWISE)
            sv = _token_stat(vs, slot, h, t_in, vq, H, V_NQ, V_TG)
            top = tl.maximum(tl.max(tl.abs(sv), 0), 1e-30)
            pv = tl.dot((p * (sv / top)[None, :]).to(DT), y.to(DT)) * top
            if V_ZERO:  # sum_t p_t * zero_t, on every dim
                pv += tl.sum(p * _token_stat(vz, slot, h, t_in, vq, H, V_NQ, V_TG)[None, :], 1)[:, None]
        else:
            v = _dequant_tile(vc, vs, vz, vlut, vr, slot, h, t0, t_in, t_mask, dims, DT, H, T, D, TILE, V_NQ, V_BITS,
                              V_TG, V_CG, V_ZERO, V_LUT, V_RES, BYTEWISE)
            pv = tl.dot(p.to(DT), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    empty = l_i == 0.0
    part = (split * tl.num_programs(0) + b).to(tl.int64) * H + h  # (split, request, head)
    base = (part * M + rows[:, None]) * D + dims[None, :]
    tl.store(out + base, acc / tl.where(empty, 1.0, l_i)[:, None], mask=rmask[:, None])
    lse_i = (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453
    tl.store(lse + part * M + rows, tl.where(empty, float("-inf"), lse_i), mask=rmask)


@triton.jit
def merge_splits(out, lse, out2, lse2, res, res_lse, R, D: tl.constexpr, SPLITS: tl.constexpr,
                 SUFFIX: tl.constexpr, BLOCK_R: tl.constexpr):
    """Merge by log-sum-exp the ``SPLITS`` partials ``out [SPLITS, R, D]`` / ``lse [SPLITS, R]`` of
    :func:`decode_attention` (``R`` = requests x heads x rows) and, with ``SUFFIX``, a part over
    other keys (``out2 [R, D]`` any float dtype, ``lse2 [R]`` fp32: the exact suffix) into ``res
    [R, D]`` fp32 and ``res_lse [R]``. A part with lse -inf weighs 0 (its out must be finite); rows
    where every part is empty get zeros and -inf. One program per ``BLOCK_R`` rows; every partial
    is read once (two passes over the lse, which are ``1 / D`` of the bytes)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < R
    dims = tl.arange(0, D)[None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(lse + s * R + r, mask=rm, other=float("-inf")))
    if SUFFIX:
        m = tl.maximum(m, tl.load(lse2 + r, mask=rm, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)  # all empty: every weight exp(-inf) = 0
    w = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for s in tl.static_range(SPLITS):
        e = tl.exp(tl.load(lse + s * R + r, mask=rm, other=float("-inf")) - m)
        w += e
        acc += e[:, None] * tl.load(out + (s * R + r).to(tl.int64)[:, None] * D + dims, mask=rm[:, None], other=0.0)
    if SUFFIX:
        e = tl.exp(tl.load(lse2 + r, mask=rm, other=float("-inf")) - m)
        w += e
        acc += e[:, None] * tl.load(out2 + r.to(tl.int64)[:, None] * D + dims, mask=rm[:, None], other=0.0).to(tl.float32)
    empty = w == 0.0
    tl.store(res + r.to(tl.int64)[:, None] * D + dims, acc / tl.where(empty, 1.0, w)[:, None], mask=rm[:, None])
    tl.store(res_lse + r, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, w))), mask=rm)
