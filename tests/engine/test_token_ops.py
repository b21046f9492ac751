"""The per-token ops kernel (engine/token_ops.py, kernels/token_ops.cpp) against the PyTorch code it
replaces: RMSNorm as Llama's module computes it, rotary embedding bit for bit, the sampler's softmax
and inverse-CDF draw; and that the engine takes it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lmcache_vericache.engine import Sampling, kernels, token_ops
from lmcache_vericache.engine.hf_model import HfModel

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


@pytest.fixture(scope="module")
def mod():
    m = kernels.build("token_ops")
    if m is None:
        pytest.skip("no C++ compiler: the PyTorch paths run instead")
    return m


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@DTYPES
@pytest.mark.parametrize("rows", [1, 8, 48])
def test_rms_norm_matches_llamas_module(mod, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data = (torch.randn(576, generator=g) * 0.5 + 1).to(dtype)
    x = (torch.randn(rows, 576, generator=g) * 4).to(dtype)
    assert token_ops.is_llama_rms_norm(norm)
    with torch.inference_mode():
        ref, got = norm(x), token_ops.rms_norm(norm, x)
    assert got.dtype == dtype and got.shape == x.shape
    # the mean is summed in another order: the normalized value may round one ulp apart before the weight
    torch.testing.assert_close(got, ref, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=0)
    # rows are independent: one row alone gives what it gave among the others
    assert torch.equal(token_ops.rms_norm(norm, x[-1:].contiguous())[0], got[-1])


def test_a_norm_with_hooks_is_not_taken():
    norm = LlamaRMSNorm(8)
    norm.register_forward_hook(lambda *a: None)
    assert not token_ops.is_llama_rms_norm(norm)
    assert not token_ops.is_llama_rms_norm(torch.nn.LayerNorm(8))


@DTYPES
@pytest.mark.parametrize("heads", [3, 9])
def test_rope_equals_pytorchs_ops_bit_for_bit(mod, dtype, heads):
    g = torch.Generator().manual_seed(heads)
    x = torch.randn(17, heads, 64, generator=g).to(dtype)
    angles = torch.randn(17, 1, 64, generator=g) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert torch.equal(token_ops.rope(x, cos, sin), _rotate(x, cos, sin))
    # a view that is not contiguous takes PyTorch's path: the same values
    wide = torch.randn(17, heads, 128, generator=g).to(dtype)
    assert torch.equal(token_ops.rope(wide[..., :64], cos, sin), _rotate(wide[..., :64], cos, sin))


@pytest.mark.parametrize("temperature", [0.3, 0.8, 1.7])
def test_softmax_matches_pytorch(mod, temperature):
    x = torch.randn(5, 49152 + 3, generator=torch.Generator().manual_seed(0)) * 4  # a tail past the vectors
    got = token_ops.softmax(x, temperature)
    ref = (x / temperature).softmax(-1)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-12)
    torch.testing.assert_close(got.double().sum(-1), torch.ones(5, dtype=torch.float64), rtol=1e-5, atol=0)
    assert torch.equal(token_ops.softmax(x[2], temperature), got[2])  # one row alone: the same row
    assert torch.equal(Sampling(temperature).probs(x), got)  # what the sampler uses without top-k / top-p


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_softmax_of_a_row_with_inf_or_nan_is_pytorchs(mod, bad):
    x = torch.randn(2, 100, generator=torch.Generator().manual_seed(1))
    x[1, 37] = bad  # past the first vector, a finite maximum elsewhere in the row for NaN
    assert torch.equal(token_ops.softmax(x, 1.0).isnan(), (x / 1.0).softmax(-1).isnan())


def test_softmax_gives_a_masked_logit_probability_zero(mod):
    x = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2)) * 3
    x[0, ::7] = float("-inf")  # in the vectors and in the tail
    got = token_ops.softmax(x, 0.8)
    assert (got[0, ::7] == 0).all() and (got[x > float("-inf")] > 0).all()
    torch.testing.assert_close(got, (x / 0.8).softmax(-1), rtol=2e-5, atol=0)
    # and far below the maximum, where the polynomial exp is floored: still the true, tiny value
    y = torch.tensor([[0.0, -200.0, -50.0]])
    torch.testing.assert_close(token_ops.softmax(y, 1.0), y.softmax(-1), rtol=1e-5, atol=1e-37)


def test_draw_index_is_the_cumsum_inverse_cdf(mod):
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(49152, generator=g) * 3, 0)
    p[torch.randint(0, 49152, (5000,), generator=g)] = 0
    cdf = p.double().cumsum(0)
    for u in torch.rand(2000, dtype=torch.float64, generator=g).tolist() + [0.0, 1 - 2.0 ** -53]:
        i = token_ops.draw_index(p, u)
        assert i == int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True))
        assert p[i] > 0
    for bad in (torch.zeros(600), torch.tensor([1.0, float("nan")]), torch.tensor([1.0, -1e-30]), torch.zeros(0)):
        assert token_ops.draw_index(bad, 0.5) == -1
    assert token_ops.draw_index(p.double(), 0.5) is None  # not the kernel's dtype: the caller's path


def test_smollm2_takes_the_kernels_norms_and_a_hooked_norm_its_own(mod, smollm2, monkeypatch):
    model, _ = smollm2
    hf = HfModel(model)
    norm = model.model.layers[0].input_layernorm
    assert token_ops.is_llama_rms_norm(norm)
    x = torch.randn(4, model.config.hidden_size).to(hf.dtype)
    called = []
    kernel = mod.rms_norm  # the real kernel, spied on: its result is what the module's is compared with
    monkeypatch.setattr(mod, "rms_norm", lambda *a: called.append(1) or kernel(*a))
    with torch.inference_mode():
        torch.testing.assert_close(hf.input_norm(0, x), norm(x), rtol=2 ** -7, atol=0)
    assert called  # the kernel's call
    # a hook registered after the model was wrapped is honoured: the module runs, with its hook
    handle = norm.register_forward_hook(lambda m, a, out: out * 0)
    try:
        with torch.inference_mode():
            assert not hf.input_norm(0, x).any()
    finally:
        handle.remove()


def test_the_other_vector_width_builds_and_agrees(mod):
    """The vector width follows the CPU (16 floats with AVX-512, 8 with AVX2): the other width's code
    is built here too, so a CPU of the other kind meets no build error, and computes the same."""
    other = kernels.build("token_ops", vec_width=8 if mod.vec_width == 16 else 16)
    assert other is not None and other.vec_width != mod.vec_width
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 49152 + 5, generator=g) * 4
    x[1, ::9] = float("-inf")
    torch.testing.assert_close(other.softmax(x, 0.7), mod.softmax(x, 0.7), rtol=1e-5, atol=0)
    p = mod.softmax(x, 0.7)[1]
    for u in torch.rand(200, dtype=torch.float64, generator=g).tolist():
        assert other.draw(p, u) == mod.draw(p, u)
    for dtype in (torch.bfloat16, torch.float32):
        h = (torch.randn(7, 576, generator=g) * 3).to(dtype)
        w = torch.randn(576, generator=g).to(dtype)
        torch.testing.assert_close(other.rms_norm(h, w, 1e-5), mod.rms_norm(h, w, 1e-5), rtol=2 ** -7, atol=0)
        q, c, s = (torch.randn(5, 3, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(dtype),
                   torch.randn(5, 64, generator=g).to(dtype))
        assert torch.equal(other.rope(q, c, s), mod.rope(q, c, s))
