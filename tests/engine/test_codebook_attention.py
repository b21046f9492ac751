"""The codebook (TurboQuant) drafter's kernel against attention over the dequantized codes, its tile
layout, and TurboQuant drafters on packed draft caches: lossless, really packed, fewer bytes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from engine_helpers import packed_and_dense_runs, random_prompts

from lmcache_vericache import compressors
from lmcache_vericache.compressors import formats
from lmcache_vericache.engine import VeriCacheEngine, codebook_attention, int8_attention, kernels
from lmcache_vericache.engine.cache import kv_to_2ltd
from lmcache_vericache.engine.codebook_attention import Codebook, CodebookPrefix

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not int8_attention.available(), reason="int8 attention kernel not buildable here")]

BITS = [(4, 3), (4, 4), (3, 3), (2, 4), (3, 2)]  # (keys, values)


def _chunks(kbits, vbits, h, d, sizes, seed=0, layers=1):
    """TurboQuant chunks of ``sizes`` tokens (random K/V), consecutive, and their compressor."""
    comp = compressors.get("turboquant", k_bits=kbits, v_bits=vbits)
    gen = torch.Generator().manual_seed(seed)
    out, start = [], 0
    for n in sizes:
        k, v = (torch.randn(layers, h, n, d, generator=gen) for _ in range(2))
        out.append(comp.compress(kv_to_2ltd(k, v), h, start=start))
        start += n
    return comp, out


def _dense(comp, ckvs, layer, codebook=None):
    """Keys and values of ``layer`` over all chunks, dequantized in float32 from the format's
    description; with ``codebook``: through its int8-rounded entries (what the kernel reads)."""
    parts = []
    for ckv in ckvs:
        fmt = formats.describe(comp, ckv.num_kv_heads, ckv.num_tokens, ckv.head_dim, torch.float32)
        if codebook is not None:
            rounded = lambda s, lut, scale: dataclasses.replace(  # noqa: E731
                s, codebook=lut[:2 ** s.bits].float() / scale)
            fmt = dataclasses.replace(fmt, k=rounded(fmt.k, codebook.klut, codebook.kscale),
                                      v=rounded(fmt.v, codebook.vlut, codebook.vscale))
        parts.append(formats.dequantize(fmt, ckv.layer_buffers(layer)))
    return torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1)


def _prefix(comp, ckvs, layers=1):
    codebook = Codebook.of(formats.of_chunk(comp, ckvs[0]))
    prefix = CodebookPrefix(codebook, layers, ckvs[0].num_kv_heads)
    prefix.append(ckvs)
    return prefix


def _reference(q, k, v, scale):
    scores = q.double() @ k.double().transpose(1, 2) * scale
    return (scores.softmax(-1) @ v.double()).float(), scores.logsumexp(-1).float()


@pytest.mark.parametrize("kbits,vbits", BITS)
@pytest.mark.parametrize("sizes,m,d", [((40, 24, 72), 5, 64), ((16,), 1, 64), ((7,), 3, 16), ((100, 33), 11, 32),
                                       ((48,), 9, 128)])
def test_the_float_path_reads_the_tiles_exactly(kbits, vbits, sizes, m, d):
    """Float path against float64 attention over the codes dequantized through the int8-rounded
    codebook: exact up to float rounding, so every code is where the kernel reads it (partly filled
    blocks, several chunks, heads, row passes beyond 8)."""
    comp, ckvs = _chunks(kbits, vbits, 3, d, sizes, seed=sum(sizes) + m)
    prefix = _prefix(comp, ckvs)
    assert prefix.length(0) == sum(sizes) and prefix.kt[0].shape == (3, -(-sum(sizes) // 16), d // 16, 32 * kbits)
    k, v = _dense(comp, ckvs, 0, prefix.codebook)
    q = torch.randn(3, m, d, generator=torch.Generator().manual_seed(m))
    [(out, lse)] = codebook_attention.attention([(q, prefix, 0)], 1 / math.sqrt(d), integer=False)
    want, want_lse = _reference(q, k, v, 1 / math.sqrt(d))
    torch.testing.assert_close(out, want, atol=3e-6, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("integer", [False, pytest.param(True, marks=pytest.mark.skipif(
    not int8_attention.integer(), reason="no integer path on this CPU"))])
@pytest.mark.parametrize("kbits,vbits", BITS)
def test_the_kernel_is_close_to_attention_over_the_dequantized_chunks(kbits, vbits, integer):
    """Against the compressor's own dequantization (the drafter a dense draft cache is): the int8
    codebook moves an entry by <= 0.4% of the largest, the integer path also rounds q and the
    weights to 8 bits. Measured here at most ~3e-2 on outputs of magnitude ~1."""
    comp, ckvs = _chunks(kbits, vbits, 3, 64, (256, 256, 100), seed=kbits * 10 + vbits)
    prefix = _prefix(comp, ckvs)
    k, v = _dense(comp, ckvs, 0)
    q = torch.randn(3, 3, 64, generator=torch.Generator().manual_seed(1)) * 2
    [(out, lse)] = codebook_attention.attention([(q, prefix, 0)], 0.125, integer=integer)
    want, want_lse = _reference(q, k, v, 0.125)
    torch.testing.assert_close(out, want, atol=4e-2, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=3e-2, rtol=0)  # lse ~ 9


def test_the_exact_suffix_is_merged_causally():
    """A verify-shaped call: 2 block tokens x 3 GQA rows over prefix codes + an exact bf16 suffix
    whose last 2 entries are the block's own (row i sees the suffix up to its token)."""
    comp, ckvs = _chunks(4, 3, 3, 64, (64, 30), seed=5)
    prefix = _prefix(comp, ckvs)
    k, v = _dense(comp, ckvs, 0, prefix.codebook)
    gen = torch.Generator().manual_seed(2)
    sk, sv = (torch.randn(3, 5, 64, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(3, 6, 64, generator=gen)  # row r: block token r % 2
    [(out, lse)] = codebook_attention.attention([(q, prefix, 0)], 0.125, integer=False, suffixes=[(sk, sv, 2, 5)])
    for r in range(6):
        seen = 5 - 2 + 1 + r % 2
        kk, vv = torch.cat([k, sk[:, :seen].float()], 1), torch.cat([v, sv[:, :seen].float()], 1)
        want, want_lse = _reference(q[:, r:r + 1], kk, vv, 0.125)
        torch.testing.assert_close(out[:, r:r + 1], want, atol=3e-6, rtol=1e-5)
        torch.testing.assert_close(lse[:, r:r + 1], want_lse, atol=3e-6, rtol=1e-5)


@pytest.mark.skipif(not int8_attention.vnni(), reason="no AVX512-VNNI path on this CPU")
@pytest.mark.parametrize("kbits,vbits", BITS + [(2, 2)])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_the_vector_decode_equals_int8_codes_bit_for_bit(kbits, vbits, d):
    """The VNNI path decodes tiles in registers (shift, mask, vpshufb). With identity rotations it
    must give exactly what the int8 source gives over the decoded entries as int8 codes."""
    from lmcache_vericache.compressors.packing import pack

    gen = torch.Generator().manual_seed(d + kbits)
    h, t = 3, 100
    cb = dataclasses.replace(Codebook.of(formats.describe(compressors.get("turboquant", k_bits=kbits, v_bits=vbits),
                                                          h, t, d, torch.float32)),
                             krot=torch.eye(d), vrot=torch.eye(d))
    mod = kernels.build("int8_attention")
    tiles, codes = [], []
    for bits, values, lut in ((kbits, False, cb.klut), (vbits, True, cb.vlut)):
        c = torch.randint(0, 2 ** bits, (h, t, d), generator=gen, dtype=torch.uint8)
        tiles.append(mod.codebook_tiles([pack(c, bits)], [t], [0], h, d, bits, values))
        codes.append(lut[c.long()])
    ks, vs = torch.rand(h, t, generator=gen) / 50, torch.rand(h, t, generator=gen) / 50
    prefix = CodebookPrefix(cb, 1, h, [tiles[0]], [ks], [tiles[1]], [vs], [[]])
    packed = int8_attention.Int8Prefix.empty(1, h, d)
    packed.append(0, codes[0], ks, codes[1], vs)
    q = torch.randn(h, 5, d, generator=gen) * 2
    [(out, lse)] = codebook_attention.attention([(q, prefix, 0)], 0.125, integer=True)
    [(want, want_lse)] = int8_attention.attention([(q, packed, 0)], 0.125, integer=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("cuts", [(), (1,), (1, 2), (2,)])
def test_appending_chunk_by_chunk_equals_laying_out_at_once(cuts):
    """Chunks of 40 / 24 / 72 tokens leave partly filled blocks between appends; the tiles (and
    scales) after appending in pieces are those of one append."""
    comp, ckvs = _chunks(4, 3, 2, 64, (40, 24, 72), seed=3, layers=2)
    once = _prefix(comp, ckvs, layers=2)
    pieces = CodebookPrefix(once.codebook, 2, 2)
    for a, b in zip((0, *cuts), (*cuts, 3)):
        pieces.append(ckvs[a:b])
    for part in ("kt", "ks", "vt", "vs"):
        for li in range(2):
            assert torch.equal(getattr(once, part)[li], getattr(pieces, part)[li]), part
    clone = pieces.clone()
    clone.append(ckvs[:1])  # a clone grows on its own
    assert clone.length(0) == 136 + 40 and pieces.length(0) == 136


def test_the_float_path_gives_the_same_result_at_every_vector_width():
    """The other vector width's build (-DVERICACHE_VEC_WIDTH, scalar decoding) reads the same codes."""
    native = kernels.build("int8_attention")
    other = kernels.build("int8_attention", vec_width=8 if native.vec_width == 16 else 16)
    comp, ckvs = _chunks(4, 3, 3, 64, (300,), seed=4)
    p = _prefix(comp, ckvs)
    cb = p.codebook
    for m in (1, 3, 11):
        q = torch.randn(3, m, 64, generator=torch.Generator().manual_seed(m))
        args = ([q], p.kt, p.ks, p.vt, p.vs, cb.kbits, cb.vbits, cb.klut, cb.vlut, cb.krot, cb.vrot, 0.125, False)
        (want,), (want_lse,) = native.codebook_attention(*args)
        (got,), (got_lse,) = other.codebook_attention(*args)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got_lse, want_lse, atol=2e-5, rtol=1e-5)


def test_bad_input_is_refused():
    comp, ckvs = _chunks(4, 3, 2, 64, (32,), seed=6)
    p = _prefix(comp, ckvs)
    with pytest.raises(ValueError, match="no codebook format"):
        Codebook.of(formats.describe(compressors.get("int4"), 2, 32, 64, torch.float32))
    with pytest.raises(ValueError, match="head sizes"):
        Codebook.of(formats.describe(comp, 2, 32, 48, torch.float32))
    short = dataclasses.replace(ckvs[0], buffers={**ckvs[0].buffers, "L0.kq": ckvs[0].buffers["L0.kq"][:-1]})
    before = p.clone()
    with pytest.raises(ValueError, match="layer 0: kq is not 2048 bytes of 4-bit codes"):  # a truncated chunk: refused, nothing changed
        p.append([short])
    assert all(torch.equal(a, b) for a, b in zip(p.kt + p.ks + p.vt + p.vs, before.kt + before.ks + before.vt + before.vs))
    mod = kernels.build("int8_attention")
    with pytest.raises(RuntimeError, match="packed 4-bit codes"):  # the kernel's own check, no product that wraps
        mod.codebook_tiles([torch.empty(0, dtype=torch.uint8)], [2 ** 58], [0], 2, 64, 4, False)
    q = torch.randn(2, 3, 64)
    with pytest.raises(RuntimeError, match="job count mismatch"):
        mod.codebook_attention([q, q], p.kt, [], p.vt, p.vs, 4, 3, p.codebook.klut, p.codebook.vlut,
                               p.codebook.krot, p.codebook.vrot, 0.125)
    with pytest.raises(RuntimeError, match="tiles"):
        kernels.build("int8_attention").codebook_attention([q], [p.kt[0][:, :1]], p.ks, p.vt, p.vs, 4, 3, p.codebook.klut,
                                                        p.codebook.vlut, p.codebook.krot, p.codebook.vrot, 0.125)
    other = Codebook.of(formats.of_chunk(comp, ckvs[0]))
    with pytest.raises(ValueError, match="one codebook"):
        codebook_attention.attention([(q, p, 0), (q, CodebookPrefix(other, 1, 2), 0)], 0.125)


@pytest.mark.parametrize("full_kv", ["resident", "offload"])
def test_packed_codebook_drafter_is_lossless_and_reads_fewer_bytes(tiny_model, full_kv):
    prompts = random_prompts(2, [300, 200], seed=2)
    method = ("turboquant", {"k_bits": 4, "v_bits": 3})
    eng = VeriCacheEngine(tiny_model, *method, chunk_size=40, draft_len=6, full_kv=full_kv, codebook_draft=True)
    dense = VeriCacheEngine(tiny_model, *method, chunk_size=40, draft_len=6, full_kv=full_kv, codebook_draft=False)
    assert eng.codebook_draft and not dense.codebook_draft and not eng.int8_draft
    (seen, acc), (dense_seen, acc_dense) = packed_and_dense_runs(eng, dense, prompts, 60)
    assert all(kind is CodebookPrefix for kind, *_ in seen.values())
    assert all(kind is type(None) for kind, *_ in dense_seen.values())
    for i in seen:  # 3.5 bits + a 4-byte scale per (head, token) and side against 4 bytes per element
        assert 0 < seen[i][2] < 0.35 * dense_seen[i][2]
        assert seen[i][1] < dense_seen[i][1]
    assert abs(acc - acc_dense) < 1.0


def test_codebook_draft_option(tiny_model):
    with pytest.raises(ValueError, match="codebook_draft: a KVFetch drafter"):
        VeriCacheEngine(tiny_model, "poissoncomp", codebook_draft=True, verkv={"kvfetch_draft": True})
    with pytest.raises(ValueError, match="codebook_draft: int8 has no codebook format"):
        VeriCacheEngine(tiny_model, "int8", codebook_draft=True)
    with pytest.raises(ValueError, match="True, False or None"):
        VeriCacheEngine(tiny_model, "turboquant", codebook_draft="yes")
    with pytest.raises(ValueError, match="codebook_draft and triton_draft"):
        VeriCacheEngine(tiny_model, "turboquant", codebook_draft=True, triton_draft=True)
    auto = VeriCacheEngine(tiny_model, "turboquant", {"k_bits": 4, "v_bits": 3})
    assert auto.codebook_draft == int8_attention.vnni()  # auto: where the kernel decodes in vectors
    assert not VeriCacheEngine(tiny_model, "int4").codebook_draft
