"""The engine's own forward must compute what the HF model computes (fp32, tight tolerance), with
caches written in place, explicit positions, block (verify) and single-token (decode) attention,
for every HF family the adapter takes (Llama, Qwen2 with qkv bias, Qwen3 with q/k norm)."""

from __future__ import annotations

import shutil

import pytest
import torch

from lmcache_vericache.engine import HfModel, KVCache, Runtime, Segment, kernels, runtime
from lmcache_vericache.engine.runtime import _flash_lse, attend


def _pieces(rt: Runtime, ids: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    cache = rt.new_cache(len(ids) + 4)
    out, s = [], 0
    for e in cuts + [len(ids)]:
        logits, _ = rt.forward(ids[s:e], torch.arange(s, e), [Segment(cache, e - s)])
        out.append(logits)
        s = e
    assert cache.n == len(ids)
    return torch.cat(out)


def test_matches_hf_tiny(tiny_model):
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    ref = tiny_model(ids[None]).logits[0]
    # prefill pieces, single-token decode steps and a verify-sized block
    got = _pieces(Runtime(tiny_model), ids, [128, 129, 130, 163, 256, 257])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def _tiny(family: str, **extra):
    import transformers

    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return getattr(transformers, f"{family}ForCausalLM")(cfg).float().eval()


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3", "Mistral"])
def test_matches_hf_other_families(family):
    model = _tiny(family)
    ids = torch.randint(0, 256, (160,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    got = _pieces(Runtime(HfModel(model)), ids, [100, 101, 130])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_sliding_window_rejected():
    with pytest.raises(ValueError, match="sliding-window"):
        Runtime(_tiny("Mistral", sliding_window=64))


def test_matches_hf_smollm2(smollm2):
    model, tok = smollm2
    from lmcache_vericache.data import prompt_ids, stdlib_source

    ids = prompt_ids(tok, stdlib_source("json/decoder.py"), 320)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    got = _pieces(Runtime(model), ids, [256, 257, 258, 291])
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.99


def test_batched_segments_equal_separate(tiny_model):
    """A flat batch mixing a decode step of one request and a block of another equals running each alone."""
    rt = Runtime(tiny_model)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 256, (50,), generator=g), torch.randint(0, 256, (70,), generator=g)
    caches = [rt.new_cache(80) for _ in range(4)]
    for c, ids in zip(caches, [a[:49], b[:60], a[:49], b[:60]]):
        rt.forward(ids, torch.arange(len(ids)), [Segment(c, len(ids))])
    alone_a, _ = rt.forward(a[49:], torch.tensor([49]), [Segment(caches[0], 1)])
    alone_b, _ = rt.forward(b[60:], torch.arange(60, 70), [Segment(caches[1], 10)])
    both, _ = rt.forward(torch.cat([a[49:], b[60:]]), torch.cat([torch.tensor([49]), torch.arange(60, 70)]),
                         [Segment(caches[2], 1), Segment(caches[3], 10)])
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[2].k[:, :, :50], caches[0].k[:, :, :50], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the PyTorch path is taken")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_writes_each_segments_new_rows_where_indexed_copies_do(dtype):
    """write_rows (one call per layer for every segment) puts each segment's new K/V exactly where
    the per-segment indexed copies put them: draft caches with per-layer prefix lengths, blocks of
    several tokens, segments of one request's rows in any order."""
    mod = kernels.build("dense_attention")
    layers, heads, d, cap = 3, 2, 16, 40
    g = torch.Generator().manual_seed(5)
    caches = [KVCache.empty(layers, heads, d, cap, dtype) for _ in range(3)]
    for c, base, n in zip(caches, ([0, 0, 0], [7, 3, 11], [2, 2, 2]), (4, 9, 0)):
        c.base, c.n = base, n
    segs = [Segment(c, n) for c, n in zip(caches, (1, 5, 3))]
    starts = [0, 1, 6]
    k = torch.randn(9, heads, d, generator=g).to(dtype)
    v = torch.randn(9, heads, d, generator=g).to(dtype)
    expect = [c.clone() for c in caches]
    for li in range(layers):
        ats = [c.length(li) for c in caches]
        runtime._write_rows([Segment(c, s.n) for c, s in zip(expect, segs)], li, k, v, ats, starts, None)
        runtime._write_rows(segs, li, k, v, ats, starts, mod)
    for c, e in zip(caches, expect):
        assert torch.equal(c.k, e.k) and torch.equal(c.v, e.v)
    assert caches[1].k[2, 1, 11 + 9 + 4].equal(k[1 + 4, 1])  # layer 2: base 11, n 9, the segment's 5th row
    with pytest.raises(RuntimeError, match="out of range"):
        mod.write_rows([caches[0].k], [caches[0].v], 0, k, v, [cap - 1], [0], [2])  # past the capacity
    with pytest.raises(RuntimeError, match="out of range"):
        mod.write_rows([caches[0].k], [caches[0].v], 0, k, v, [0], [8], [2])  # past the rows
    with pytest.raises(RuntimeError, match="capacity, D"):
        mod.write_rows([caches[0].k], [caches[0].v], layers, k, v, [0], [0], [1])  # no such layer
    assert runtime._row_writer([Segment(KVCache(caches[0].k.transpose(2, 3), caches[0].v, [0] * layers), 1)]) is None
    with pytest.raises(RuntimeError, match="rows' dtype"):
        mod.write_rows([caches[0].k.float() if dtype != torch.float32 else caches[0].k.bfloat16()],
                       [caches[0].v], 0, k, v, [0], [0], [1])


def _masked_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    """The textbook definition, in float64: query heads share KV heads in GQA groups; block token i
    sees every entry up to its own."""
    q, k, v = q.double(), k.double(), v.double()
    g, total = q.shape[1] // k.shape[0], k.shape[1]
    kr, vr = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = torch.einsum("nhd,hsd->hns", q, kr) * scale
    mask = torch.arange(total)[None, :] > (total - n + torch.arange(n))[:, None]
    return torch.einsum("hns,hsd->nhd", s.masked_fill(mask, float("-inf")).softmax(-1), vr).reshape(n, -1)


# A decode step (n = 1) and verify blocks (head size 64: the dense C++ kernel for the entries before
# the token or block, 3-120 rows per KV head; 16: flash), in fp32 and bf16, with and without an
# earlier part merged by log-sum-exp (a draft cache's packed prefix); bf16 also through the kernel's
# AMX tiles (AMX CPUs' default) and the masked flash call (VERICACHE_ATTENTION forces either).
@pytest.mark.parametrize("dtype, tol, verify", [(torch.float32, 1e-5, "kernel"), (torch.bfloat16, 2e-2, "kernel"),
                                                (torch.bfloat16, 2e-2, "flash"), (torch.bfloat16, 2e-2, "amx")])
@pytest.mark.parametrize("n", [1, 7, 17, 40])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_block_attention_equals_masked_softmax(dtype, tol, verify, n, head_dim, with_prefix, monkeypatch):
    if verify == "amx" and not getattr(kernels.build("dense_attention"), "amx", False):
        pytest.skip("no AMX tiles on this CPU")
    monkeypatch.setenv("VERICACHE_ATTENTION", verify)  # a decode step (n = 1) never takes flash
    g = torch.Generator().manual_seed(n)
    total, split, hd = 1300, 100, head_dim  # with a prefix: entries [0, split) are the earlier part
    q, k, v = (torch.randn(s, generator=g) for s in [(n, 6, hd), (2, total, hd), (2, total, hd)])
    want = _masked_softmax_attention(q, k, v, n, 0.25)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    prefix = None
    if with_prefix:
        qh = q.float().view(n, 2, 3, hd).permute(1, 2, 0, 3).reshape(2, 3 * n, hd)  # rows j*n + i
        s = qh @ k[:, :split].float().transpose(-1, -2) * 0.25
        prefix = (s.softmax(-1) @ v[:, :split].float(), s.logsumexp(-1))
        k, v = k[:, split:], v[:, split:]
    got = attend(q, k, v, n, 0.25, prefix)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_rollback_is_truncation(tiny_model):
    """Rejected entries are dropped by lowering n; re-feeding other tokens gives a fresh-run result."""
    rt = Runtime(tiny_model)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))
    c = rt.new_cache(64)
    rt.forward(ids[:30], torch.arange(30), [Segment(c, 30)])
    rt.forward(torch.tensor([1, 2, 3, 4]), torch.arange(30, 34), [Segment(c, 4)])
    c.n = 30
    got, _ = rt.forward(ids[30:], torch.arange(30, 40), [Segment(c, 10)])
    fresh = _pieces(rt, ids, [30])[30:]
    torch.testing.assert_close(got, fresh, atol=1e-5, rtol=1e-5)


def test_bad_input(tiny_model):
    rt = Runtime(tiny_model)
    c = rt.new_cache(4)
    with pytest.raises(ValueError, match="tokens/positions"):
        rt.forward(torch.tensor([1, 2]), torch.tensor([0]), [Segment(c, 2)])
    with pytest.raises(ValueError, match="cache full"):
        rt.forward(torch.arange(5), torch.arange(5), [Segment(c, 5)])
    assert isinstance(c, KVCache) and c.n == 0


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the PyTorch path is taken")
def test_the_dense_kernel_builds_and_agrees_with_flash():
    """Where a compiler exists the verify path really runs the kernel (a build failure would only
    fall back to flash, and the test above would pass either way). fp32 caches: flash's result to
    fp32 rounding. bf16 caches on an AVX512-BF16 CPU (``dpbf16``: q and the probabilities rounded to
    bf16, as in a bf16 flash kernel): no further from the exact float64 result than PyTorch's own
    bf16 flash is; elsewhere the fp32 arithmetic of the fp32 path."""
    mod = kernels.build("dense_attention")
    assert mod is not None
    g = torch.Generator().manual_seed(1)
    for d, s in ((64, 8201), (128, 1023)):  # an odd last tile: the bf16 path pairs tokens
        q = torch.randn(3, 51, d, generator=g).bfloat16().float()  # a bf16 model's q is bf16
        k, v = torch.randn(3, s, d, generator=g), torch.randn(3, s, d, generator=g)
        scale = d ** -0.5
        out, lse = mod.dense_attention(q, k, v, scale)
        want, want_lse = _flash_lse(q, k, v, scale)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)

        kb, vb = k.bfloat16(), v.bfloat16()
        scores = q.double() @ kb.double().transpose(-1, -2) * scale
        exact_lse = scores.logsumexp(-1)
        exact = (scores - exact_lse[..., None]).exp() @ vb.double()
        flash, flash_lse = _flash_lse(q.bfloat16(), kb, vb, scale)
        for dp in (True, False) if mod.dpbf16 else (False,):
            out, lse = mod.dense_attention(q, kb, vb, scale, dpbf16=dp)
            if dp:
                assert (out.double() - exact).abs().max() <= (flash.double() - exact).abs().max()
                assert (lse.double() - exact_lse).abs().max() <= max((flash_lse.double() - exact_lse).abs().max(), 1e-6)
            else:
                torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(lse.double(), exact_lse, atol=1e-5, rtol=1e-5)
    k, v = torch.randn(3, 700, 64, generator=g), torch.randn(3, 700, 64, generator=g)
    with pytest.raises(RuntimeError, match="head size 64 or 128"):
        mod.dense_attention(torch.randn(3, 51, 32), k[..., :32].bfloat16().contiguous(), v[..., :32].bfloat16().contiguous(), 0.125)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the PyTorch path is taken")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_the_dense_kernel_scores_a_decode_steps_few_rows(rows, d):
    """A decode step's 1-4 rows per KV head take the dot-product scores (one vector of rows): against
    float64 for fp32 and bf16 caches, over a length no tile divides, with the row-vector form's
    result for the same rows inside a larger block (rows do not depend on the rows beside them)."""
    mod = kernels.build("dense_attention")
    g = torch.Generator().manual_seed(rows * d)
    q = torch.randn(2, rows, d, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        k, v = (torch.randn(2, 1537, d, generator=g).to(dtype) for _ in range(2))
        out, lse = mod.dense_attention(q, k, v, d ** -0.5, dpbf16=False)
        scores = q.double() @ k.double().transpose(-1, -2) * d ** -0.5
        torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), scores.softmax(-1) @ v.double(), atol=1e-5, rtol=1e-4)
        wide = torch.cat([q, torch.randn(2, 13, d, generator=g)], 1)  # 13 more rows: the row-vector form
        out_wide, lse_wide = mod.dense_attention(wide, k, v, d ** -0.5, dpbf16=False)
        torch.testing.assert_close(out, out_wide[:, :rows], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, lse_wide[:, :rows], atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the PyTorch path is taken")
def test_the_dense_kernel_gives_the_same_result_at_every_vector_width():
    """The kernel's vector width follows the CPU (16 floats with AVX-512, 8 with AVX2); the other
    width's code is built here too (-DVERICACHE_VEC_WIDTH) and must agree with the native build, so
    a machine of one kind checks the code the other kind runs (fp32 arithmetic in both)."""
    native = kernels.build("dense_attention")
    other = kernels.build("dense_attention", vec_width=8 if native.vec_width == 16 else 16)
    assert other is not None and other.vec_width != native.vec_width
    g = torch.Generator().manual_seed(2)
    for d, s, rows, causal in ((64, 1500, 3, 0), (64, 700, 51, 17), (128, 600, 15, 5), (64, 33, 9, 3)):
        q = torch.randn(3, rows, d, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            k, v = torch.randn(3, s, d, generator=g).to(dtype), torch.randn(3, s, d, generator=g).to(dtype)
            want, want_lse = native.dense_attention(q, k, v, d ** -0.5, dpbf16=False, causal=causal)
            got, got_lse = other.dense_attention(q, k, v, d ** -0.5, dpbf16=False, causal=causal)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("s,n", [(8201, 17), (1030, 17), (517, 5), (40, 40)])  # a block alone in the last tile; no past
def test_the_dense_kernel_masks_a_verify_block_causally(s, n):
    """causal=n: the last n entries are a block whose token i % n (row i) sees the entries up to
    its own, as attend's two-part path (past + masked block, merged) computes it; every path and
    dtype against float64."""
    mod = kernels.build("dense_attention")
    g = torch.Generator().manual_seed(s + n)
    q = torch.randn(3, 3 * n, 64, generator=g).bfloat16().float()
    k, v = torch.randn(3, s, 64, generator=g), torch.randn(3, s, 64, generator=g)
    pos = torch.arange(3 * n) % n + (s - n)  # each row's own entry
    visible = torch.arange(s)[None, :] <= pos[:, None]
    for dtype, dps in ((torch.float32, (False,)), (torch.bfloat16, (True, False) if mod.dpbf16 else (False,))):
        kc, vc = k.to(dtype), v.to(dtype)
        scores = (q.double() @ kc.double().transpose(-1, -2) * 0.125).masked_fill(~visible, float("-inf"))
        exact_lse = scores.logsumexp(-1)
        exact = (scores - exact_lse[..., None]).exp() @ vc.double()
        for dp in dps:
            out, lse = mod.dense_attention(q, kc, vc, 0.125, dpbf16=dp, causal=n)
            tol = 2e-2 if dp else 1e-5  # dp: q and the probabilities rounded to bf16
            torch.testing.assert_close(out.double(), exact, atol=tol, rtol=tol)
            torch.testing.assert_close(lse.double(), exact_lse, atol=tol, rtol=1e-5 if not dp else tol)
    with pytest.raises(RuntimeError, match="block length dividing the rows"):
        mod.dense_attention(q, k, v, 0.125, causal=n + 1)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the PyTorch path is taken")
@pytest.mark.parametrize("s", [517, 1030, 1537])
@pytest.mark.parametrize("d, group, n", [(64, 3, 17), (128, 3, 17), (64, 2, 9)])  # 64, 64, 32 padded rows
def test_a_verify_row_is_its_decode_step_bit_for_bit(s, d, group, n):
    """bf16 pair dot products (AVX512-BF16, and the AMX tiles that share their numerics): row i of a
    causal block of n tokens over s entries equals the decode step of token i (its GQA group alone
    over the entries up to its own) bit for bit. Tiles, masked entries and the blocking of rows and
    tokens leave a row's sums as they are, so a verify block and full-KV decoding round bf16 alike
    (odd tile ends: the path pairs tokens). The fp32-arithmetic path scores a decode step's few rows
    as dot products (another order), so it agrees to float rounding only."""
    mod = kernels.build("dense_attention")
    paths = [dict(dpbf16=True)] * mod.dpbf16 + [dict(amx=True)] * mod.amx
    if not paths:
        pytest.skip("no AVX512-BF16 or AMX on this CPU")
    g = torch.Generator().manual_seed(s)
    q = torch.randn(3, group * n, d, generator=g).bfloat16().float()
    k, v = torch.randn(3, s, d, generator=g).bfloat16(), torch.randn(3, s, d, generator=g).bfloat16()
    for path in paths:
        block, block_lse = mod.dense_attention(q, k, v, d ** -0.5, causal=n, **path)
        for i in range(n):
            rows = [j * n + i for j in range(group)]  # row j * n + i: GQA member j, token i
            end = s - n + i + 1
            step, step_lse = mod.dense_attention(q[:, rows].contiguous(), k[:, :end], v[:, :end], d ** -0.5, **path)
            assert torch.equal(step, block[:, rows]) and torch.equal(step_lse, block_lse[:, rows]), (path, i)


def test_the_attention_path_follows_the_cpu_and_the_override(monkeypatch):
    """auto: the AMX tiles for bf16 where the kernel has them (decode steps and verify blocks), the
    AVX path otherwise and for fp32; VERICACHE_ATTENTION forces a path for A/B runs (flash only for
    verify blocks), an unknown one or amx without tiles is an error."""
    from lmcache_vericache.engine.runtime import attention_path

    mod = kernels.build("dense_attention")
    if mod is None:
        pytest.skip("no C++ compiler: the PyTorch path is taken")
    k = torch.zeros(3, 64, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("VERICACHE_ATTENTION", "auto")
    tiles = "amx" if mod.amx else "kernel"
    assert attention_path(mod, k, 1) == attention_path(mod, k, 17) == tiles and attention_path(mod, k.float(), 17) == "kernel"
    assert not mod.amx or "amx_bf16" in kernels._cpu_flags().split()  # tiles only where the CPU reports them
    monkeypatch.setenv("VERICACHE_ATTENTION", "kernel")
    assert attention_path(mod, k, 17) == "kernel"
    monkeypatch.setenv("VERICACHE_ATTENTION", "flash")
    assert attention_path(mod, k, 2) == "flash" and attention_path(mod, k, 1) == "kernel"
    monkeypatch.setenv("VERICACHE_ATTENTION", "tiles")
    with pytest.raises(ValueError, match="one of auto, amx, kernel, flash"):
        attention_path(mod, k, 1)
    if not mod.amx:
        monkeypatch.setenv("VERICACHE_ATTENTION", "amx")
        with pytest.raises(ValueError, match="no AMX tiles"):
            attention_path(mod, k, 1)


_needs_amx = pytest.mark.skipif(not getattr(kernels.build("dense_attention"), "amx", False),
                                reason="no AMX tiles on this CPU (or no compiler)")


@_needs_amx
@pytest.mark.parametrize("s,rows,n,d", [(8201, 51, 17, 64), (1030, 51, 17, 64), (517, 15, 5, 64), (40, 120, 40, 64),
                                        (1500, 3, 0, 64), (600, 128, 0, 128), (33, 33, 11, 128), (700, 3, 1, 64)])
def test_the_amx_path_equals_the_avx512_bf16_numerics(s, rows, n, d):
    """The tile path (amx.h) computes what the vdpbf16ps path does (q and probabilities rounded to
    bf16, fp32 sums): apart only where a probability rounds to the neighbouring bf16 (the scale is
    applied in another order), and no further from float64 than
    it is, across tile edges (lengths no 16 / 32 / 512 divides), causal blocks (a block alone in the
    last tile; rows masked out of whole tiles), row counts no 16 divides, head sizes 64 and 128."""
    mod = kernels.build("dense_attention")
    g = torch.Generator().manual_seed(s + rows)
    q = torch.randn(3, rows, d, generator=g).bfloat16().float()
    k, v = (torch.randn(3, s, d, generator=g).bfloat16() for _ in range(2))
    pos = (torch.arange(rows) % n + (s - n)) if n else torch.full((rows,), s - 1)
    scores = (q.double() @ k.double().transpose(-1, -2) * d ** -0.5).masked_fill(
        torch.arange(s)[None, :] > pos[:, None], float("-inf"))
    exact_lse = scores.logsumexp(-1)
    exact = (scores - exact_lse[..., None]).exp() @ v.double()
    out, lse = mod.dense_attention(q, k, v, d ** -0.5, causal=n, amx=True)
    dp_out, dp_lse = mod.dense_attention(q, k, v, d ** -0.5, causal=n, dpbf16=True)
    torch.testing.assert_close(out, dp_out, atol=5e-4, rtol=1e-2)
    torch.testing.assert_close(lse, dp_lse, atol=2e-6, rtol=1e-6)
    assert (out.double() - exact).abs().max() <= 1.05 * (dp_out.double() - exact).abs().max() + 1e-6
    with pytest.raises(RuntimeError, match="at most 128 rows"):
        mod.dense_attention(torch.randn(3, 129, d), k, v, 0.125, amx=True)


@_needs_amx
def test_a_verify_rows_attention_on_the_tiles_equals_its_decode_step_bit_for_bit():
    """On the tiles a row's result does not depend on the rows beside it nor on masked entries
    after it: a verify block's row i equals the decode step of the same token (same q, the entries
    up to its own) exactly, so verify and plain decoding agree on attention (their linear layers
    may still round differently)."""
    mod = kernels.build("dense_attention")
    g = torch.Generator().manual_seed(5)
    s, n = 8193, 17
    q = torch.randn(3, 3 * n, 64, generator=g).bfloat16().float()  # row j*n + i: member j, token i
    k, v = (torch.randn(3, s, 64, generator=g).bfloat16() for _ in range(2))
    out, lse = mod.dense_attention(q, k, v, 0.125, causal=n, amx=True)
    for i in (0, 7, 16):
        rows = q.view(3, 3, n, 64)[:, :, i]  # the GQA group of token i: [3, 3, 64]
        e = s - n + i + 1  # the entries token i sees
        step, step_lse = mod.dense_attention(rows.contiguous(), k[:, :e], v[:, :e], 0.125, amx=True)
        assert torch.equal(step, out.view(3, 3, n, 64)[:, :, i]) and torch.equal(step_lse, lse.view(3, 3, n)[:, :, i])




@pytest.mark.parametrize("n", [5, 35])  # 8 x 35 = 280 rows: past the 256 rows oneDNN used to take
def test_a_bf16_verify_block_gives_its_decode_steps_logits_bit_for_bit(n):
    """A verify block of n tokens per request (batch 8) computes every token's logits exactly as n
    single-token steps do, also past 256 rows: one linear path for every row count a verify block of
    the default horizon can have (engine/linear.py's MAX_ROWS), so bf16 VeriCache emits full-KV
    decoding's tokens even at near-ties."""
    import transformers

    from lmcache_vericache.engine import linear as lin

    if lin.kernel_for(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)) is None:
        pytest.skip("bf16 weights take oneDNN on this CPU (AMX) or no kernel is built")
    # head size 64: the dense attention kernel's, whose decode and verify paths sum alike
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    rt = Runtime(model)
    assert 8 * n <= lin.MAX_ROWS
    g = torch.Generator().manual_seed(n)
    prefix = 40
    caches = []
    for _ in range(8):
        c = rt.new_cache(prefix + n)
        rt.forward(torch.randint(0, 256, (prefix,), generator=g), torch.arange(prefix), [Segment(c, prefix)])
        caches.append(c)
    toks = torch.randint(0, 256, (8, n), generator=g)
    copies = [rt.new_cache(prefix + n) for _ in caches]
    for d, c in zip(copies, caches):
        d.k.copy_(c.k), d.v.copy_(c.v)
        d.n = c.n
    block, _ = rt.forward(toks.reshape(-1), torch.arange(prefix, prefix + n).repeat(8), [Segment(c, n) for c in caches])
    steps = [rt.forward(toks[:, i], torch.full((8,), prefix + i), [Segment(d, 1) for d in copies])[0] for i in range(n)]
    assert torch.equal(block, torch.stack(steps, 1).reshape(8 * n, -1))
