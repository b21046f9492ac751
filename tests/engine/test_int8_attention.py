"""The int8 attention kernel against plain attention over the dequantized codes, and int8 drafters on
packed draft caches: lossless, really packed, fewer bytes read per draft step."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import packed_and_dense_runs, random_prompts

from lmcache_vericache.engine import Sampling, Segment, VeriCacheEngine, int8_attention
from lmcache_vericache.engine.int8_attention import Int8Prefix
from lmcache_vericache.engine.runtime import attend

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not int8_attention.available(), reason="int8 attention kernel not buildable here")]


def _quantized(h, t, d, gen):
    x = torch.randn(h, t, d, generator=gen)
    s = x.abs().amax(-1) / 127
    return (x / s[..., None]).round().clamp(-127, 127).to(torch.int8), s


# The float path is exact up to float rounding; the integer paths round q (per row) and the weights
# (per row and 32 tokens with AVX512-VNNI, 16 with AVX2) to 8 bits (VNNI) or 7 bits (AVX2): a drafter's
# numerics, measured here at most ~3e-2 with VNNI (weights per 32 tokens) on outputs up to ~3.4 with
# these large random scores (q ~ 2 N(0, 1)).
PATHS = [pytest.param(False, (2e-5, 1e-4), id="float"),
         pytest.param(True, (8e-2, 2e-2), id="integer", marks=pytest.mark.skipif(
             not (int8_attention.available() and int8_attention.integer()), reason="no integer path on this CPU"))]


@pytest.mark.parametrize("integer,tol", PATHS)
@pytest.mark.parametrize("t,m,d", [(1, 1, 64), (17, 3, 64), (255, 6, 64), (256, 3, 64), (1000, 48, 64), (300, 3, 16),
                                   (40, 9, 128)])
def test_kernel_equals_attention_over_dequantized_codes(t, m, d, integer, tol):
    gen = torch.Generator().manual_seed(t + m)
    h = 3
    (kq, ks), (vq, vs) = _quantized(h, t, d, gen), _quantized(h, t, d, gen)
    q = torch.randn(h, m, d, generator=gen) * 2
    prefix = int8_attention.Int8Prefix.empty(1, h, d)
    prefix.append(0, kq[:, : t // 2], ks[:, : t // 2], vq[:, : t // 2], vs[:, : t // 2])  # two appends
    prefix.append(0, kq[:, t // 2:], ks[:, t // 2:, None], vq[:, t // 2:], vs[:, t // 2:, None])
    assert prefix.length(0) == t and prefix.kq[0].shape[1] == -(-t // 16)  # blocks of 16 tokens, padded
    [(out, lse)] = int8_attention.attention([(q, prefix, 0)], 0.125, integer=integer)
    k, v = kq.float() * ks[..., None], vq.float() * vs[..., None]
    scores = q @ k.transpose(1, 2) * 0.125
    torch.testing.assert_close(out, scores.softmax(-1) @ v, atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=tol[0], rtol=tol[1])


def test_the_blocked_layouts_round_trip():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (3, 37, 64), dtype=torch.int8, generator=gen)
    keys, values = int8_attention._block_keys(codes), int8_attention._block_values(codes)
    assert keys.shape == (3, 3, 16, 16, 4) and values.shape == (3, 12, 64, 4)
    assert keys[1, 1, 5, 7, 3].item() == codes[1, 16 + 7, 4 * 5 + 3].item()  # block, dim group, token, dim
    assert values[1, 8, 40, 2].item() == codes[1, 8 * 4 + 2, 40].item()  # token group, dim, token
    assert torch.equal(int8_attention._unblock_keys(keys, 37), codes)
    assert torch.equal(int8_attention._unblock_values(values, 37), codes)
    assert keys[:, 2, :, 5:].eq(0).all() and values[:, 9, :, 1:].eq(0).all()  # padding is zeros


def test_merged_attention_equals_attention_over_the_union():
    """Packed prefix + dense suffix with a causal block of n tokens, merged by log-sum-exp, equals
    attention over [dequantized prefix, suffix] in one piece."""
    gen = torch.Generator().manual_seed(0)
    hkv, g, d, t, past, n = 3, 3, 64, 300, 20, 5
    (kq, ks), (vq, vs) = _quantized(hkv, t, d, gen), _quantized(hkv, t, d, gen)
    prefix = int8_attention.Int8Prefix.empty(1, hkv, d)
    prefix.append(0, kq, ks, vq, vs)
    k, v = torch.randn(hkv, past + n, d, generator=gen), torch.randn(hkv, past + n, d, generator=gen)
    q = torch.randn(n, hkv * g, d, generator=gen)
    qrows = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
    [part] = int8_attention.attention([(qrows, prefix, 0)], 0.125, integer=False)  # the exact path: the merge is tested
    got = attend(q, k, v, n, 0.125, part)
    full_k = torch.cat([kq.float() * ks[..., None], k], 1)
    full_v = torch.cat([vq.float() * vs[..., None], v], 1)
    want = attend(q, full_k, full_v, n, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # a 1-token step (no causal block): the fused path with the prefix merged in
    [part1] = int8_attention.attention([(q[-1:].view(hkv, g, d), prefix, 0)], 0.125, integer=False)
    got1 = attend(q[-1:], k, v, 1, 0.125, part1)
    torch.testing.assert_close(got1, attend(q[-1:], full_k, full_v, 1, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("integer,tol", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,past,n,g", [(300, 20, 5, 3), (40, 1, 1, 3), (17, 3, 3, 3), (1000, 30, 1, 9),
                                        (64, 8, 4, 3), (0, 7, 1, 3), (0, 12, 4, 2)])
def test_kernel_with_the_exact_suffix_equals_attention_over_the_union(t, past, n, g, dtype, integer, tol):
    """A draft step's whole attention in one call: the int8 prefix (t tokens, none for t = 0) and the
    draft cache's exact entries (past + the block's own n, causal), against float64 attention over
    [dequantized prefix, exact entries]; 12 rows (n = 4, g = 3) take two passes of the kernel."""
    gen = torch.Generator().manual_seed(t + past + n)
    hkv, d = 3, 64
    prefix = int8_attention.Int8Prefix.empty(1, hkv, d)
    if t:
        (kq, ks), (vq, vs) = _quantized(hkv, t, d, gen), _quantized(hkv, t, d, gen)
        prefix.append(0, kq, ks, vq, vs)
        pk, pv = kq.double() * ks[..., None], vq.double() * vs[..., None]
    else:
        pk = pv = torch.zeros(hkv, 0, d, dtype=torch.float64)
    # the exact entries as the runtime passes them: a cache's layer, of which the first past + n count
    # (the 9 after them are noise the kernel must not read)
    kbuf, vbuf = (torch.randn(hkv, past + n + 9, d, generator=gen).to(dtype) for _ in range(2))
    k, v = kbuf[:, :past + n], vbuf[:, :past + n]
    q = torch.randn(n, hkv * g, d, generator=gen) * 2
    rows = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
    [(out, lse)] = int8_attention.attention([(rows, prefix, 0)], 0.125, integer=integer, suffixes=[(kbuf, vbuf, n, past + n)])
    # row j*n + i (member j, block token i) sees the prefix and the exact entries up to its own token
    full_k, full_v = torch.cat([pk, k.double()], 1), torch.cat([pv, v.double()], 1)
    seen = t + past + 1 + torch.arange(g * n) % n
    hidden = torch.arange(full_k.shape[1])[None, :] >= seen[:, None]
    scores = (rows.double() @ full_k.transpose(1, 2) * 0.125).masked_fill(hidden, float("-inf"))
    torch.testing.assert_close(out.double(), scores.softmax(-1) @ full_v, atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=tol[0], rtol=tol[1])


def test_kernel_refuses_a_suffix_it_cannot_read():
    hkv, d = 3, 64
    prefix = int8_attention.Int8Prefix.empty(1, hkv, d)
    q = torch.randn(hkv, 3 * 4, d)
    k = torch.randn(hkv, 3, d)
    with pytest.raises(ValueError, match="suffixes for"):
        int8_attention.attention([(q, prefix, 0)], 0.125, suffixes=[])
    with pytest.raises(RuntimeError, match="causal block"):  # 4 block tokens, 3 exact entries
        int8_attention.attention([(q, prefix, 0)], 0.125, suffixes=[(k, k, 4, 3)])
    with pytest.raises(RuntimeError, match="causal block"):  # 2 block tokens, 1 entry counted of 3
        int8_attention.attention([(q, prefix, 0)], 0.125, suffixes=[(k, k, 2, 1)])
    with pytest.raises(RuntimeError, match="suffix length"):  # more entries than the buffer holds
        int8_attention.attention([(q, prefix, 0)], 0.125, suffixes=[(k, k, 1, 4)])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        int8_attention.attention([(q, prefix, 0)], 0.125, suffixes=[(k.half(), k.half(), 1, 3)])
    with pytest.raises(RuntimeError, match="contiguous rows"):
        int8_attention.attention([(q, prefix, 0)], 0.125, suffixes=[(torch.randn(hkv, d, 3).transpose(1, 2), k, 1, 3)])


@pytest.mark.parametrize("method", [("int8", {}), ("compose", {"evict": "streamingllm", "quant": "int8",
                                                               "evict_params": {"keep_ratio": 0.5}})])
@pytest.mark.parametrize("full_kv", ["resident", "offload"])
def test_packed_int8_drafter_is_lossless_and_reads_fewer_bytes(tiny_model, method, full_kv):
    prompts = random_prompts(2, [300, 200], seed=2)
    eng = VeriCacheEngine(tiny_model, *method, chunk_size=64, draft_len=6, full_kv=full_kv)
    dense = VeriCacheEngine(tiny_model, *method, chunk_size=64, draft_len=6, full_kv=full_kv, int8_draft=False)
    assert eng.int8_draft and not dense.int8_draft
    (seen, acc), (dense_seen, acc_dense) = packed_and_dense_runs(eng, dense, prompts, 60)
    assert all(kind is Int8Prefix for kind, *_ in seen.values())
    assert all(kind is type(None) for kind, *_ in dense_seen.values())
    for i in seen:  # same prefix, 1 byte per element + a 4-byte scale per (head, token) instead of 4
        # bytes: (D + 4) / 4D of the dense prefix (0.31 for D = 16) plus block padding
        assert 0 < seen[i][2] < 0.4 * dense_seen[i][2]
        assert seen[i][1] < dense_seen[i][1]
    # drafts are (nearly) those of the dense int8 drafter: acceptance within a token a round
    assert abs(acc - acc_dense) < 1.0


def test_a_bf16_draft_step_over_int8_prefixes_is_batch_invariant(tiny_model, monkeypatch):
    """bf16: draft steps of three requests over their packed int8 prefixes in one forward give each
    request's logits and draft cache bit for bit as a forward of that request alone (the kernel's
    rows as float32 converted once per layer, its outputs rounded once after the concatenation, the
    new rows written by write_rows). The linear kernel is forced (row-independent on every CPU; AMX
    CPUs would otherwise take oneDNN, which is not)."""
    import copy

    monkeypatch.setenv("VERICACHE_LINEAR", "kernel")
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    eng = VeriCacheEngine(model, "int8", chunk_size=64, store="resident")
    reqs = eng.setup_requests(random_prompts(3, [200, 150, 300], seed=4), 8, Sampling(), 0, draft=True)
    assert all(isinstance(r.draft.packed, Int8Prefix) for r in reqs) and eng.rt.dtype == torch.bfloat16
    alone_caches = [r.draft.clone() for r in reqs]
    toks, pos = torch.tensor([r.tokens[-1] for r in reqs]), torch.tensor([r.pos for r in reqs])
    both, _ = eng.rt.forward(toks, pos, [Segment(r.draft, 1) for r in reqs])
    alone = torch.cat([eng.rt.forward(toks[i:i + 1], pos[i:i + 1], [Segment(c, 1)])[0]
                       for i, c in enumerate(alone_caches)])
    assert torch.equal(both, alone)
    for r, c in zip(reqs, alone_caches):
        assert r.draft.n == c.n and torch.equal(r.draft.k, c.k) and torch.equal(r.draft.v, c.v)


@pytest.mark.parametrize("method", [("int8", {}), ("turboquant", {"k_bits": 4, "v_bits": 3})])
def test_a_draft_step_reads_no_entry_past_its_caches_lengths(tiny_model, method):
    """A packed draft cache's layer reaches the code kernel whole, with its length (``slen``): the
    entries past each layer's length (rejected drafts, never-written room) are NaN here, and the
    draft step's logits and caches are bit for bit those over a copy without them."""
    eng = VeriCacheEngine(tiny_model, *method, chunk_size=64, store="resident")
    if not (eng.int8_draft or eng.codebook_draft):
        pytest.skip("this CPU has no kernel for these codes")
    reqs = eng.setup_requests(random_prompts(3, [200, 150, 300], seed=5), 8, Sampling(), 0, draft=True)
    clean = [r.draft.clone() for r in reqs]
    for r in reqs:
        c = r.draft
        assert c.packed is not None and c.k.shape[2] > max(c.length(li) for li in range(len(c.base)))
        for li in range(len(c.base)):  # from each layer's length on: where the step writes, and past it
            c.k[li, :, c.length(li):] = float("nan")
            c.v[li, :, c.length(li):] = float("nan")
    toks, pos = torch.tensor([r.tokens[-1] for r in reqs]), torch.tensor([r.pos for r in reqs])
    poisoned, _ = eng.rt.forward(toks, pos, [Segment(r.draft, 1) for r in reqs])
    want, _ = eng.rt.forward(toks, pos, [Segment(c, 1) for c in clean])
    assert not poisoned.isnan().any() and torch.equal(poisoned, want)
    for r, c in zip(reqs, clean):
        n = [c.length(li) for li in range(len(c.base))]
        for li, e in enumerate(n):
            assert torch.equal(r.draft.k[li, :, :e], c.k[li, :, :e]) and torch.equal(r.draft.v[li, :, :e], c.v[li, :, :e])


def test_int8_draft_option(tiny_model):
    with pytest.raises(ValueError, match="stores int8 codes"):
        VeriCacheEngine(tiny_model, "streamingllm", int8_draft=True)
    with pytest.raises(ValueError, match="True, False or None"):
        VeriCacheEngine(tiny_model, "int8", int8_draft="yes")
    assert not VeriCacheEngine(tiny_model, "kivi").int8_draft  # 2-bit codes: dequantized copy


def test_the_float_path_gives_the_same_result_at_every_vector_width():
    """The float path's vector width follows the CPU (16 floats with AVX-512, 8 with AVX2); the
    other width's code is built here too (-DVERICACHE_VEC_WIDTH) and must agree, so a machine of one
    kind checks the code the other kind runs. Rows 1-8 (one pass each) and 11 (two passes)."""
    from lmcache_vericache.engine import kernels

    native = kernels.build("int8_attention")
    other = kernels.build("int8_attention", vec_width=8 if native.vec_width == 16 else 16)
    assert other is not None and other.vec_width != native.vec_width
    gen = torch.Generator().manual_seed(3)
    h = 3
    for t, d in ((1000, 64), (37, 128), (300, 16)):
        (kq, ks), (vq, vs) = _quantized(h, t, d, gen), _quantized(h, t, d, gen)
        prefix = int8_attention.Int8Prefix.empty(1, h, d)
        prefix.append(0, kq, ks, vq, vs)
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 11):
            q = torch.randn(h, m, d, generator=gen) * 2
            sk, sv = torch.randn(h, 9, d, generator=gen).bfloat16(), torch.randn(h, 9, d, generator=gen).bfloat16()
            args = ([q], prefix.kq, prefix.ks, prefix.vq, prefix.vs, 0.125, False, [sk], [sv], [1 if m % 3 else 3])
            (want,), (want_lse,) = native.int8_attention(*args)
            (got,), (got_lse,) = other.int8_attention(*args)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(got_lse, want_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [0, 5, 16, 37, 300])
def test_a_prefix_laid_out_at_once_equals_one_appended_in_pieces(t):
    """The first append of a layer takes its own path (no copies through empty parts); its blocks
    must be those of appending the same codes in pieces with partly filled blocks in between."""
    gen = torch.Generator().manual_seed(t)
    (kq, ks), (vq, vs) = _quantized(2, t, 64, gen), _quantized(2, t, 64, gen)
    once, pieces = int8_attention.Int8Prefix.empty(1, 2, 64), int8_attention.Int8Prefix.empty(1, 2, 64)
    once.append(0, kq, ks, vq, vs)
    for a, b in ((0, t // 3), (t // 3, t // 2), (t // 2, t)):
        pieces.append(0, kq[:, a:b], ks[:, a:b], vq[:, a:b], vs[:, a:b])
    for part in ("kq", "ks", "vq", "vs"):
        assert torch.equal(getattr(once, part)[0], getattr(pieces, part)[0]), part
