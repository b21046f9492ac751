"""KVFetch over PoissonComp chunks of real SmolLM2 KV (engine/kvfetch.py): the (epsilon, delta)
guarantee of VerKV's theorem 2 with an exact sketch, and exact attention when everything is fetched."""

from __future__ import annotations

import math

import pytest
import torch

from lmcache_vericache import compressors
from lmcache_vericache.engine.kvfetch import CertifiedPrefix

PREFIX, WINDOW = 512, 64


@pytest.fixture(scope="module")
def real(smollm2):
    """KV of the first 512 tokens of json/decoder.py, the queries of the 64 tokens after them, and
    that prefix compressed 8x by PoissonComp (query-agnostic scores, as a store would)."""
    from lmcache_vericache.data import prompt_ids, stdlib_source
    from lmcache_vericache.models import prefill_kv

    model, tok = smollm2
    kv, queries = prefill_kv(model, prompt_ids(tok, stdlib_source("json/decoder.py"), PREFIX + WINDOW), window=WINDOW)
    heads = model.config.num_key_value_heads
    prefix = kv[:, :, :PREFIX].contiguous()
    ckv = compressors.get("poissoncomp", keep_ratio=0.125, seed=1).compress(prefix, heads)
    return prefix, queries, heads, ckv


def relative_errors(prefix_kv, queries, heads, ckv, layers=None, **options) -> tuple[torch.Tensor, CertifiedPrefix, float]:
    """|D^ - D| / D of every (query, head) decision of ``layers`` (default all); the prefix; max output error."""
    p = CertifiedPrefix(prefix_kv.shape[1], **options)
    p.append(ckv, prefix_kv)
    d = queries.shape[-1]
    scale = 1 / math.sqrt(d)
    errs, out_err = [], 0.0
    for li in range(prefix_kv.shape[1]) if layers is None else layers:
        q = queries[li].float().reshape(heads, -1, d)  # [Hkv, g * w, D]: a KV head's query rows
        k = prefix_kv[0, li].view(PREFIX, heads, d).transpose(0, 1).float()
        v = prefix_kv[1, li].view(PREFIX, heads, d).transpose(0, 1).float()
        logits = q @ k.transpose(1, 2) * scale
        out, lse = p.attend(q, li, scale)
        errs.append((lse - logits.logsumexp(-1)).double().exp().sub(1).abs().flatten())
        ref = logits.softmax(-1) @ v
        out_err = max(out_err, ((out - ref).norm() / ref.norm()).item())
    return torch.cat(errs), p, out_err


def test_certified_attention_meets_epsilon_delta_on_real_kv(real):
    errs, p, _ = relative_errors(*real, epsilon=0.05, delta=0.1, sketch_bits=None)
    assert errs.numel() >= 10_000 and p.stats.decisions == errs.numel()
    violations = (errs > 0.05).double().mean().item()
    assert violations <= 0.1, violations  # theorem 2 (the paper saw < 0.7% with an exact sketch)
    unfetched, q, _ = relative_errors(*real, epsilon=1e9, delta=0.1, sketch_bits=None)
    assert q.stats.tokens_fetched == 0
    assert (unfetched > 0.05).double().mean().item() > violations  # fetching is what buys the guarantee
    assert 0 < p.stats.tokens_fetched < p.stats.tokens_attended


def test_fetching_everything_is_exact_attention(real):
    errs, p, out_err = relative_errors(*real, layers=(0, 15, 29), epsilon=1e-12, delta=0.1, sketch_bits=2)
    assert errs.max().item() < 1e-4 and out_err < 1e-4


def test_options_are_validated():
    for bad in ({"epsilon": 0}, {"delta": 1.0}, {"sketch_bits": 3}):
        with pytest.raises(ValueError):
            CertifiedPrefix(2, **bad)
    p = CertifiedPrefix(2)
    with pytest.raises(ValueError, match="PoissonComp"):
        p.append(compressors.get("streamingllm").compress(torch.randn(2, 2, 32, 8), 2), torch.randn(2, 2, 32, 8))
