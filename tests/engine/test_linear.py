"""The few-rows linear kernel (engine/kernels/linear.cpp) and its dispatch (engine/linear.py):
the products of fp32 and bf16 weights to float rounding, rows independent of the batch, every
block size and tail, and PyTorch where the kernel does not apply."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from lmcache_vericache.engine import kernels
from lmcache_vericache.engine import linear as lin

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: PyTorch's path is taken")


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 17, 64, 136])
def test_the_kernel_computes_x_times_w_transposed(dtype, rows):
    """Every row-block size (4 and the 1-3 tails) and a column count no block size divides (191),
    against float64 from the same (bf16-rounded) weights."""
    mod = kernels.build("linear")
    g = torch.Generator().manual_seed(rows)
    for k, n in ((576, 191), (1536, 576), (64, 7), (80, 13)):  # 80: bf16 rows widened (K % 32 != 0)
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g).to(dtype)
        y = mod.linear(x, w)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        torch.testing.assert_close(y.double(), _exact(x, w), atol=1e-4 * k ** 0.5, rtol=1e-5)
        # bf16 rows: the float sums rounded to bf16 once (as .to() rounds them); bf16 weights with
        # K % 32 == 0 on an AVX512-BF16 build take the pair dot products (another summation order)
        xb = x.bfloat16()
        yb = mod.linear(xb, w)
        assert yb.dtype == torch.bfloat16
        if mod.bf16_dot and dtype == torch.bfloat16 and k % 32 == 0:
            exact = _exact(xb, w)
            assert ((yb.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4 * k ** 0.5).all()
        else:
            assert torch.equal(yb, mod.linear(xb.float(), w).bfloat16())


@needs_compiler
def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Row m's output is bit-identical whether it runs alone, in a block of 4 or 8 rows (the kernel's
    two register shapes, chosen by the call's rows) or in a tail: a decode step and a verify block
    compute the same linear layers."""
    native = kernels.build("linear")
    # the other vector width's build too: on an AVX2 CPU only the 16-wide build has the tall shape
    other = kernels.build("linear", vec_width=8 if native.vec_width == 16 else 16)
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(23, 576, generator=g)
    for mod, dtype in [(m, d) for m in (native, other) for d in (torch.float32, torch.bfloat16)]:
        w = torch.randn(200, 576, generator=g).to(dtype)
        # bf16 rows of bf16 weights: the AVX512-BF16 dot path where the build has it
        for x in (x32, x32.bfloat16()):
            full = mod.linear(x, w)
            for m in (0, 5, 21, 22):
                assert torch.equal(mod.linear(x[m:m + 1].contiguous(), w)[0], full[m])
            # 4 + a 3-row tail, a 2-row tail, one block of 4, one of 8, 8 + a 5-row tail (23 rows: 8 + 8 + 7)
            for a, b in ((3, 10), (21, 23), (0, 4), (0, 8), (5, 18)):
                assert torch.equal(mod.linear(x[a:b].contiguous(), w), full[a:b])


@needs_compiler
def test_the_kernel_rejects_what_it_cannot_compute():
    mod = kernels.build("linear")
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 \\[M, K\\]"):
        mod.linear(x.double(), torch.randn(8, 64).double())
    with pytest.raises(RuntimeError, match="x's K"):
        mod.linear(x, torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="multiple of"):
        mod.linear(torch.randn(2, 60), torch.randn(8, 60))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        mod.linear(x, torch.randn(8, 64).half())


@needs_compiler
def test_the_kernel_gives_the_same_result_at_every_vector_width():
    """The vector width follows the CPU (16 floats with AVX-512, 8 with AVX2); the other width's
    code is built here too and agrees with the native one to float rounding."""
    native = kernels.build("linear")
    other = kernels.build("linear", vec_width=8 if native.vec_width == 16 else 16)
    assert other is not None and other.vec_width != native.vec_width
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(9, 576, generator=g), torch.randn(70, 576, generator=g).to(dtype)
        torch.testing.assert_close(other.linear(x, w), native.linear(x, w), atol=1e-4, rtol=1e-5)
        # bf16 rows (the dot path where one build has it): float sums in another order
        xb = x.bfloat16()
        torch.testing.assert_close(other.linear(xb, w, float_out=True), native.linear(xb, w, float_out=True),
                                   atol=1e-3, rtol=1e-4)


@needs_compiler
def test_float_out_gives_the_sums_a_bias_is_added_to():
    """``float_out``: the float32 sums before the one rounding, for every x dtype (bf16 rows of bf16
    weights: the dot path), rows still independent of the rows beside them; linear() adds a bias to
    them and rounds once."""
    mod = kernels.build("linear")
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(11, 576, generator=g).to(dtype), torch.randn(50, 576, generator=g).to(dtype)
        y = mod.linear(x, w, float_out=True)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y.double(), _exact(x, w), atol=1e-4 * 576 ** 0.5, rtol=1e-4)
        assert torch.equal(mod.linear(x, w).float(), y.to(dtype).float())  # rounded once, either way
        assert torch.equal(mod.linear(x[3:5].contiguous(), w, float_out=True), y[3:5])
        if lin.kernel_for(x, w) is mod:
            b = torch.randn(50, generator=g).to(dtype)
            assert torch.equal(lin.linear(x, w, b), (y + b).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, lin.MAX_ROWS + 1])
def test_linear_is_f_linear_in_the_input_dtype(dtype, rows):
    """Every path of the dispatch (kernel up to MAX_ROWS, BLAS above; bias added) gives
    F.linear's result in x's dtype, to that dtype's rounding."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=g).to(dtype)
    w, b = torch.randn(48, 128, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    for bias in (None, b):
        y = lin.linear(x, w, bias)
        assert y.dtype == dtype and y.shape == (rows, 48)
        want = _exact(x, w) + (0 if bias is None else bias.double())
        tol = 1e-4 if dtype == torch.float32 else 0.1  # bf16: the output's own rounding (|y| ~ 10)
        torch.testing.assert_close(y.double(), want, atol=tol, rtol=tol)


@needs_compiler
def test_linear_takes_the_kernel_for_decode_rows_here(monkeypatch):
    """The dispatch picks the kernel for a decode step's rows of fp32 weights, and of bf16 ones
    where the CPU has no bf16 arithmetic or has AVX512-BF16 without AMX tiles (oneDNN's there), so
    the tests above cover the path the engine runs; ``VERICACHE_LINEAR`` forces a path."""
    mod = kernels.build("linear")
    x, w = torch.randn(8, 576), torch.randn(64, 576)
    assert lin.kernel_for(x, w) is not None
    kernel_here = not lin._bf16_arithmetic() or (mod.bf16_dot and not lin._amx())
    assert (lin.kernel_for(x.bfloat16(), w.bfloat16()) is not None) == kernel_here
    assert torch.equal(lin.linear(x, w), mod.linear(x, w))
    xb, wb = x.bfloat16(), w.bfloat16()
    monkeypatch.setenv("VERICACHE_LINEAR", "kernel")
    assert lin.kernel_for(xb, wb) is mod and torch.equal(lin.linear(xb, wb), mod.linear(xb, wb))
    monkeypatch.setenv("VERICACHE_LINEAR", "blas")
    assert lin.kernel_for(xb, wb) is None and torch.equal(lin.linear(xb, wb), F.linear(xb, wb))
    assert lin.kernel_for(x, w) is mod  # fp32 weights: the kernel whatever the choice for bf16
    monkeypatch.setenv("VERICACHE_LINEAR", "onednn")
    with pytest.raises(ValueError, match="VERICACHE_LINEAR must be one of auto, kernel, blas"):
        lin.linear(xb, wb)


def test_hf_models_layers_go_through_linear_and_match_hf(monkeypatch):
    """HfModel's q/k/v/o, gated MLP and LM head take engine/linear.py's path and compute what the
    HF modules compute (fp32 to float rounding, bf16 to bf16 rounding), a hooked module is called
    as it is."""
    import transformers

    from lmcache_vericache.engine import HfModel

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(cfg).eval()
    calls = []
    real = lin.linear
    monkeypatch.setattr(lin, "linear", lambda *a: calls.append(a[1].shape) or real(*a))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        hf.to(dtype)
        m, layer = HfModel(hf), hf.model.layers[0]
        x = torch.randn(5, 64).to(dtype)
        calls.clear()
        with torch.no_grad():
            torch.testing.assert_close(m.mlp(0, x), layer.mlp(x), atol=tol, rtol=tol)
            torch.testing.assert_close(m.o_proj(0, x), layer.self_attn.o_proj(x), atol=tol, rtol=tol)
            torch.testing.assert_close(m.lm_head(x), hf.lm_head(x), atol=tol, rtol=tol)
            q, k, v = m.qkv(0, x)
            torch.testing.assert_close(q.reshape(5, -1), layer.self_attn.q_proj(x), atol=tol, rtol=tol)
        assert len(calls) == 3 + 1 + 1 + 3  # gate, up, down; o; lm_head; q, k, v
    handle = hf.lm_head.register_forward_hook(lambda mod, args, out: out * 0)
    with torch.no_grad():
        assert not HfModel(hf).lm_head(torch.randn(2, 64).bfloat16()).any()  # the hook ran
    handle.remove()


def test_linear_takes_pytorchs_path_where_the_kernel_does_not_apply():
    """fp16 weights, a K no vector width divides, 3-d inputs: F.linear, bit for bit."""
    g = torch.Generator().manual_seed(4)
    cases = [(torch.randn(3, 64, generator=g).half(), torch.randn(8, 64, generator=g).half()),
             (torch.randn(3, 60, generator=g), torch.randn(8, 60, generator=g)),
             (torch.randn(2, 3, 64, generator=g), torch.randn(8, 64, generator=g))]
    for x, w in cases:
        assert torch.equal(lin.linear(x, w), F.linear(x, w))
    module = torch.nn.LayerNorm(64)  # not an nn.Linear: called as it is
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(lin.apply(module, x), module(x))
