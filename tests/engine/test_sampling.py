"""Sampling is lossless in distribution: emitted tokens follow the full-KV distribution exactly.

Checked by chi-square tests against distributions computed exactly, on the acceptance rule alone
(with temperature, top-k and top-p) and end to end on a tiny Llama whose compressed-KV draft
distribution is far from the target's (total variation ~0.4). The same test must reject a verifier
with a realistic bug (sampling from p instead of the residual after a rejection)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import lmcache_vericache.engine.rounds as engine_mod
from lmcache_vericache.engine import Sampling, VeriCacheEngine, accept
from lmcache_vericache.engine.verify import draw
from lmcache_vericache.models import tiny_llama

VOCAB, N = 4, 3000


def _pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value, cells with expected count < 5 pooled."""
    exp = probs.double() * observed.sum()
    small = exp < 5
    obs_c = torch.cat([observed[~small].double(), observed[small].double().sum()[None]])
    exp_c = torch.cat([exp[~small], exp[small].sum()[None]])
    if exp_c[-1] == 0:
        obs_c, exp_c = obs_c[:-1], exp_c[:-1]
    return float(chisquare(obs_c.numpy(), exp_c.numpy() * obs_c.sum().item() / exp_c.sum().item()).pvalue)


# float32 weights take the kernel's draw (kernels/token_ops.cpp), float64 PyTorch's cumsum: both
# must draw the same distribution and refuse the same weights
DRAW_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "torch"])


@DRAW_DTYPES
def test_draw_follows_its_weights_and_never_draws_a_zero(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0], dtype=dtype)  # unnormalized, zeros inside and at both ends
    counts = torch.bincount(torch.tensor([draw(w, g) for _ in range(20000)]), minlength=len(w)).float()
    assert counts[w == 0].sum() == 0
    assert _pvalue(counts, w / w.sum()) > 1e-3
    # a vocabulary-sized float32 distribution from softmax, as the engine draws them
    p = torch.softmax(torch.randn(49152, generator=g) * 3, 0).to(dtype)
    top = p.topk(4).indices
    counts = torch.zeros(5)
    for _ in range(8000):
        x = draw(p, g)
        counts[int((top == x).nonzero()[0]) if x in top else 4] += 1
    assert _pvalue(counts, torch.cat([p[top], 1 - p[top].sum()[None]])) > 1e-3


@DRAW_DTYPES
@pytest.mark.parametrize("u", [0.0, 0.5, 1 - 2.0 ** -53])  # the smallest, a middle and the largest uniform
def test_draw_at_the_ends_of_the_uniform_never_picks_a_zero(u, dtype, monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(u, dtype=torch.float64))
    assert draw(torch.tensor([0.0, 1.0, 0.0], dtype=dtype), None) == 1
    assert draw(torch.tensor([0.0, 0.0, 2.0, 3.0, 0.0], dtype=dtype), None) == (2 if u < 0.4 else 3)
    # past the kernel's 256-entry blocks: zero blocks at both ends, the mass in one entry of a middle block
    w = torch.zeros(1000, dtype=dtype)
    w[300], w[700] = 1.0, 3.0
    assert draw(w, None) == (300 if u < 0.25 else 700)


@DRAW_DTYPES
def test_draw_is_seeded_and_refuses_empty_weights(dtype):
    w = torch.rand(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    a = [draw(w, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert a == [draw(w, torch.Generator().manual_seed(7)) for _ in range(3)]
    for bad in (torch.zeros(5), torch.tensor([1.0, float("inf")]), torch.tensor([1.0, float("nan")]),
                torch.tensor([2.0, -1.0]), torch.tensor([1.0] * 300 + [-0.5])):
        with pytest.raises(ValueError, match="cannot draw"):
            draw(bad.to(dtype), None)


def test_accept_rule_matches_target_with_filters(one_thread):
    g = torch.Generator().manual_seed(0)
    s = Sampling(temperature=0.8, top_k=7, top_p=0.9)
    target, draft = torch.randn(2, 10, generator=g) * 0.7, torch.randn(10, generator=g) * 0.7
    p, q = s.probs(target[0]), s.probs(draft)
    counts = torch.zeros(10)
    for _ in range(8000):
        x = int(torch.multinomial(q, 1, generator=g))
        k, nxt = accept([x], [q], target, s, g)
        counts[x if k == 1 else nxt] += 1
    assert counts[p == 0].sum() == 0  # filtered tokens never appear
    assert _pvalue(counts, p) > 1e-3


@pytest.fixture(scope="module")
def sharp_tiny():
    # Larger init than the default tiny model: peaked attention, so evicting most of the prefix
    # really changes the next-token distribution (otherwise p ~ q and no bias could be seen).
    return tiny_llama(seed=0, vocab_size=VOCAB, initializer_range=0.2)


def _exact_joint(model, prompt: list[int]) -> torch.Tensor:
    """P(t1, t2, t3) of full-KV sampling at temperature 1, all VOCAB**3 cells."""
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    ids = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logp = model(ids).logits[:, -3:].float().log_softmax(-1)
    joint = logp[:, 0].gather(1, pairs[:, :1]) + logp[:, 1].gather(1, pairs[:, 1:]) + logp[:, 2]
    return joint.exp().reshape(-1)  # index t1*V*V + t2*V + t3


def _emitted_joint(model, prompt: list[int], cached: bool = False) -> torch.Tensor:
    eng = VeriCacheEngine(model, "streamingllm", {"keep_ratio": 0.25, "n_sink": 1}, chunk_size=16, draft_len=2,
                          eos_ids=set())  # token 2 is the config's EOS; the exact joint assumes no stop
    if cached:  # the prompt's prefix is in the store: the first verify block is the prompt tail + drafts
        eng.generate([prompt], 1)
    outs = eng.generate([prompt] * N, 3, temperature=1.0, seed=1234)
    idx = torch.tensor([o.tokens[0] * VOCAB * VOCAB + o.tokens[1] * VOCAB + o.tokens[2] for o in outs])
    assert sum(o.stats.rounds for o in outs) >= N  # the tokens after the first really went through draft/verify
    assert all(o.stats.cached_chunks == (3 if cached else 0) for o in outs)
    return torch.bincount(idx, minlength=VOCAB ** 3).float()


def _biased_accept(drafts, q, target_logits, sampling, gen):
    """The classic bug: after a rejection, sample from p instead of normalize(max(0, p - q))."""
    p = sampling.probs(target_logits)
    for i, x in enumerate(drafts):
        if float(torch.rand((), generator=gen)) * float(q[i][x]) < float(p[i, x]):
            continue
        return i, int(torch.multinomial(p[i], 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=gen))


@pytest.mark.parametrize("cached", [False, True], ids=["prefilled", "prefix-from-store"])
def test_engine_sampling_matches_full_kv(sharp_tiny, one_thread, cached):
    prompt = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    assert _pvalue(_emitted_joint(sharp_tiny, prompt, cached), _exact_joint(sharp_tiny, prompt)) > 1e-3


def test_biased_verifier_is_caught(sharp_tiny, one_thread, monkeypatch):
    prompt = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    monkeypatch.setattr(engine_mod, "accept", _biased_accept)
    assert _pvalue(_emitted_joint(sharp_tiny, prompt), _exact_joint(sharp_tiny, prompt)) < 1e-6


def test_sampling_is_seeded(tiny_model, one_thread):
    # Two engines in the same state (empty stores): a second call on one engine would find the prompt's
    # prefix in its store, draft on a different schedule and draw another sample of the same distribution.
    prompt = list(range(100))
    a, b = (VeriCacheEngine(tiny_model, "int8", chunk_size=32, draft_len=4).generate(
        [prompt, prompt], 20, temperature=0.9, top_k=50, seed=7) for _ in range(2))
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert a[0].tokens != a[1].tokens  # request i uses seed + i


def test_bad_sampling_params(tiny_model):
    eng = VeriCacheEngine(tiny_model, "int8")
    for kw in [dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.5)]:
        with pytest.raises(ValueError):
            eng.generate([1, 2, 3], 4, **kw)
