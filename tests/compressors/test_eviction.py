"""Token-eviction methods do what their papers say, on inputs where the right answer is known."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from lmcache_vericache import compressors
from lmcache_vericache.compressors import codec
from lmcache_vericache.compressors.base import CompressionContext, LayerKV, budget, split_heads
from lmcache_vericache.compressors.poissoncomp import inclusion_probabilities
from lmcache_vericache.compressors.scoring import key_norm_score, window_attention

H, D = 3, 16


def make_kv(n_layers: int = 2, n_tokens: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, n_layers, n_tokens, H * D, generator=torch.Generator().manual_seed(seed))


def kept(method: str, kv: torch.Tensor, start: int = 0, **kw) -> list[torch.Tensor]:
    """Absolute kept positions per layer ``[H, n]``, through the real compress/decompress path."""
    params = {k: kw.pop(k) for k in list(kw) if k not in ("queries", "scores")}
    c = compressors.get(method, **params)
    return [layer.positions for layer in c.decompress(c.compress(kv, H, start=start, **kw))]


def set_key(kv: torch.Tensor, layer: int, token: int, head: int, vec: torch.Tensor) -> None:
    kv[0, layer, token, head * D:(head + 1) * D] = vec


def basis(i: int, scale: float = 1.0) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), D).float() * scale


# -- shared scoring ------------------------------------------------------------------------------

def test_window_attention_is_causal_inside_the_chunk():
    kv, q = make_kv(1, 8), torch.randn(1, 2 * H, 3, D)
    attn = window_attention(kv, CompressionContext(H, queries=q), window_in_chunk=True)
    assert attn.shape == (1, H, 2, 3, 8)
    for j in range(3):  # query j sits at token 5 + j
        assert torch.all(attn[..., j, 6 + j:] == 0) and torch.all(attn[..., j, :6 + j] > 0)
    assert torch.allclose(attn.sum(-1), torch.ones(1, H, 2, 3))


def test_bad_query_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="queries must be"):
        kept("snapkv", make_kv(), queries=torch.randn(2, 4, 3, D))  # 4 query heads for 3 KV heads


@pytest.mark.parametrize("method", ["snapkv", "h2o", "pyramidkv"])
def test_query_methods_without_queries_or_scores_raise(method):
    with pytest.raises(ValueError, match="needs queries= or scores="):
        kept(method, make_kv())


@pytest.mark.parametrize(
    "method,bad",
    [
        ("snapkv", {"keep_ratio": 0.0}), ("snapkv", {"kernel_size": 4}), ("snapkv", {"pooling": "median"}),
        ("snapkv", {"fallback": "random"}), ("h2o", {"recent_ratio": 1.5}), ("pyramidkv", {"beta": 0.5}),
        ("kvzip", {"keep_ratio": 1.2}), ("poissoncomp", {"n_local": -1}), ("poissoncomp", {"seed": 1.5}),
    ],
)
def test_bad_parameters_raise_value_error(method, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        compressors.get(method, **bad)


# -- SnapKV --------------------------------------------------------------------------------------

def test_snapkv_keeps_exactly_the_top_scored_tokens():
    kv, scores = make_kv(), torch.rand(2, H, 32)
    pos = kept("snapkv", kv, start=100, keep_ratio=0.25, scores=scores)
    for layer in range(2):
        want = scores[layer].topk(8, dim=-1).indices.sort(-1).values + 100
        assert torch.equal(pos[layer], want)


def test_snapkv_scores_by_the_window_attention_per_gqa_group():
    kv = make_kv(1, 32) * 0.01
    q = torch.zeros(1, 2 * H, 4, D)
    for head, token in enumerate((5, 17, 29)):
        set_key(kv, 0, token, head, basis(head))
        q[0, 2 * head:2 * head + 2, :, head] = 20.0  # both query heads of the group look at `token`
    pos = kept("snapkv", kv, keep_ratio=1 / 32, kernel_size=1, queries=q)[0]
    assert pos.tolist() == [[5], [17], [29]]


def test_snapkv_pooling_keeps_the_neighbours_of_a_hot_token():
    kv = make_kv(1, 32)
    kv_q = torch.zeros(1, H, 1, D)
    for head in range(H):
        set_key(kv, 0, 10, head, basis(0, 30.0))
    kv_q[..., 0] = 1.0
    pos = kept("snapkv", kv, keep_ratio=3 / 32, kernel_size=3, pooling="max", queries=kv_q)[0]
    assert pos.tolist() == [[9, 10, 11]] * H


def test_snapkv_window_in_chunk_keeps_the_window_and_masks_the_future():
    kv = make_kv(1, 32) * 0.01
    q = torch.zeros(1, H, 4, D)
    q[..., 0] = 20.0
    for head in range(H):
        set_key(kv, 0, 30, head, basis(0))  # inside the window: the first window queries cannot see it
        set_key(kv, 0, 3, head, basis(0, 0.5))
    pos = kept("snapkv", kv, keep_ratio=5 / 32, kernel_size=1, window_in_chunk=True, queries=q)[0]
    assert pos.tolist() == [[3, 28, 29, 30, 31]] * H


def test_snapkv_key_norm_fallback_is_explicit_and_prefers_small_keys():
    kv = make_kv(1, 32)
    for head in range(H):
        set_key(kv, 0, 7, head, basis(1, 1e-3))
    assert kept("snapkv", kv, keep_ratio=1 / 32, kernel_size=1, fallback="key_norm")[0].tolist() == [[7]] * H


# -- H2O -----------------------------------------------------------------------------------------

def spread_vs_peak_queries() -> tuple[torch.Tensor, torch.Tensor]:
    """Token 4 gets moderate attention from three queries (largest sum), token 20 nearly all the
    attention of one query (largest max)."""
    kv = torch.zeros(2, 1, 32, H * D)
    q = torch.zeros(1, H, 4, D)
    for head in range(H):
        set_key(kv, 0, 4, head, basis(0))
        set_key(kv, 0, 20, head, basis(1))
    q[:, :, 0, 1] = 80.0
    q[:, :, 1:, 0] = 16.0
    return kv, q


def test_h2o_keeps_the_heavy_hitter_by_accumulated_attention():
    kv, q = spread_vs_peak_queries()
    assert kept("h2o", kv, keep_ratio=1 / 32, recent_ratio=0.0, queries=q)[0].tolist() == [[4]] * H


def test_h2o_splits_the_budget_between_recent_and_heavy_hitters():
    scores = torch.arange(32, 0, -1).float().expand(2, H, 32)  # early tokens score highest
    pos = kept("h2o", make_kv(), keep_ratio=0.25, recent_ratio=0.5, scores=scores)
    assert pos[0].tolist() == [[0, 1, 2, 3, 28, 29, 30, 31]] * H


# -- PyramidKV -----------------------------------------------------------------------------------

def test_pyramidkv_budgets_shrink_with_depth_and_average_to_keep_ratio():
    c = compressors.get("pyramidkv", keep_ratio=0.25, beta=4.0)
    b = c.layer_budgets(6, 64)
    assert all(x >= y for x, y in zip(b, b[1:])) and b[0] > b[-1]
    assert sum(b) == 6 * budget(64, 0.25) and b[-1] == 4  # min = mean / beta
    capped = compressors.get("pyramidkv", keep_ratio=0.75).layer_budgets(4, 32)
    assert max(capped) == 32 and sum(capped) == 4 * 24


def test_pyramidkv_keeps_each_layers_top_scores_at_its_budget():
    kv, scores = make_kv(4, 32), torch.rand(4, H, 32)
    c = compressors.get("pyramidkv", keep_ratio=0.25, beta=8.0)
    pos = kept("pyramidkv", kv, keep_ratio=0.25, beta=8.0, scores=scores)
    for layer, n in enumerate(c.layer_budgets(4, 32)):
        assert torch.equal(pos[layer], scores[layer].topk(n, dim=-1).indices.sort(-1).values)


# -- KVzip ---------------------------------------------------------------------------------------

def test_kvzip_uses_max_attention_of_reconstruction_queries():
    kv, q = spread_vs_peak_queries()
    assert kept("kvzip", kv, keep_ratio=1 / 32, queries=q)[0].tolist() == [[20]] * H


def test_kvzip_without_queries_prefers_the_small_norm_key():
    kv = make_kv(2, 32)
    for head in range(H):
        set_key(kv, 1, 13, head, basis(2, 1e-3))
    pos = kept("kvzip", kv, keep_ratio=1 / 32)
    assert pos[1].tolist() == [[13]] * H


def test_kvzip_prefers_given_scores():
    scores = torch.zeros(2, H, 32)
    scores[:, :, 21] = 1.0
    assert kept("kvzip", make_kv(), keep_ratio=1 / 32, scores=scores)[0].tolist() == [[21]] * H


# -- PoissonComp ---------------------------------------------------------------------------------

def test_inclusion_probabilities_meet_the_budget():
    tau = torch.tensor([[1.0, 0.5, 0.25, 0.25, 0.0, 0.1]])
    r = inclusion_probabilities(tau, 3.0)  # c = 20 / 11: token 0 saturates at 1
    assert math.isclose(r.sum().item(), 3.0, abs_tol=1e-9) and r[0, 4] == 0
    assert r[0, 0] == 1.0 and math.isclose(r[0, 2].item() / r[0, 5].item(), 2.5, rel_tol=1e-6)
    assert torch.equal(inclusion_probabilities(tau, 9.0), (tau > 0).double())  # saturates
    with pytest.raises(ValueError, match="nonnegative"):
        inclusion_probabilities(-tau, 1.0)


def test_poissoncomp_probabilities_sum_to_the_budget():
    kv = make_kv(3, 64)
    c = compressors.get("poissoncomp", keep_ratio=0.25, n_sink=4, n_local=8)
    r = c.probabilities(kv, CompressionContext(H))
    assert r.shape == (3, H, 64)
    assert torch.allclose(r.sum(-1), torch.full((3, H), 16.0, dtype=torch.float64), atol=0.05)  # float16 r
    assert torch.all(r[..., :4] == 1) and torch.all(r[..., -8:] == 1)
    assert torch.equal(r, r.half().double())  # stored exactly as sampled


def test_poissoncomp_is_seeded_and_samples_each_head_independently():
    kv = make_kv(2, 128)
    a, b = kept("poissoncomp", kv, seed=1), kept("poissoncomp", kv, seed=1)
    c = kept("poissoncomp", kv, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert any(x.shape != y.shape or not torch.equal(x, y) for x, y in zip(a, c))
    ctx = CompressionContext(H, scores=torch.ones(2, H, 128))  # equal r in every head
    _, z = compressors.get("poissoncomp", seed=3).sample(kv, ctx)
    assert not torch.equal(z[:, 0], z[:, 1])  # one Bernoulli sample per KV head


def test_poissoncomp_inclusion_frequency_matches_r():
    kv, scores = make_kv(1, 48), torch.rand(1, H, 48)
    params = {"keep_ratio": 0.25, "n_sink": 2, "n_local": 2}
    r = compressors.get("poissoncomp", **params).probabilities(kv, CompressionContext(H, scores=scores))[0]
    runs = 400
    hits, sizes = torch.zeros(H, 48), []
    for seed in range(runs):
        z = compressors.get("poissoncomp", seed=seed, **params).sample(kv, CompressionContext(H, scores=scores))[1][0]
        hits += z
        sizes.append(int(z[0].sum()))
    assert (hits / runs - r.float()).abs().max() < 0.1  # binomial sd <= 0.025
    assert abs(sum(sizes) / runs - 12) < 0.5  # expected size = budget
    assert len(set(sizes)) > 1  # Poisson sampling: the size varies


def test_poissoncomp_stores_the_sample_padding_and_probabilities():
    kv, scores = make_kv(2, 64), torch.rand(2, H, 64)
    c = compressors.get("poissoncomp", keep_ratio=0.25, n_sink=2, n_local=2, seed=5)
    ckv = c.compress(kv, H, scores=scores)
    r, z = c.sample(kv, CompressionContext(H, scores=scores))
    for layer, parts in enumerate(ckv.buffers_by_layer()):
        assert torch.equal(parts["r"].double(), r[layer])
        pos, member = parts["pos"].long(), parts["in"].bool()
        for h in range(H):
            assert set(pos[h][member[h]].tolist()) == set(z[layer, h].nonzero().flatten().tolist())
            assert not z[layer, h, pos[h][~member[h]]].any()  # padding: tokens outside the sample
        assert pos.shape[1] == int(z[layer].sum(-1).max())
    codec.validate(codec.from_bytes(codec.to_bytes(ckv)))
    for name, bad in (("r", lambda b: b.fill_(2.0)), ("in", lambda b: b.fill_(3)),
                      ("r", lambda b: b.fill_(0.0))):
        broken = codec.from_bytes(codec.to_bytes(ckv))
        bad(broken.buffers[f"L0.{name}"])
        with pytest.raises(codec.CodecError):
            codec.validate(broken)


def test_poissoncomp_keeps_sinks_only_in_the_first_chunk_and_never_zero_scores():
    kv, scores = make_kv(1, 64), torch.rand(1, H, 64)
    scores[..., 10:20] = 0.0
    for seed in range(20):
        z = compressors.get("poissoncomp", seed=seed, n_sink=4, n_local=4).sample(
            kv, CompressionContext(H, scores=scores))[1][0, 0]
        first = z.nonzero().flatten()
        assert set(range(4)) | set(range(60, 64)) <= set(first.tolist())
        assert not set(range(10, 20)) & set(first.tolist())
    later = compressors.get("poissoncomp", n_sink=4, n_local=4).probabilities(
        kv, CompressionContext(H, start=64, scores=scores)
    )
    assert torch.all(later[0, :, -4:] == 1) and torch.all(later[0, :, :4] < 1)


def test_poissoncomp_rejects_negative_scores():
    with pytest.raises(ValueError, match="nonnegative"):
        kept("poissoncomp", make_kv(), scores=-torch.rand(2, H, 32))


# -- real model: SmolLM2 KV of a real source file ------------------------------------------------

@pytest.fixture(scope="module")
def real_kv(smollm2):
    """Prefix KV (first 256 tokens of json/decoder.py) and the queries of the 64 tokens after it."""
    from lmcache_vericache.data import prompt_ids, stdlib_source
    from lmcache_vericache.models import prefill_kv

    model, tok = smollm2
    kv, queries = prefill_kv(model, prompt_ids(tok, stdlib_source("json/decoder.py"), 320), window=64)
    return kv[:, :, :256].contiguous(), queries, model.config.num_key_value_heads


def attention_output(q, k, v):
    a = torch.einsum("hgwd,htd->hgwt", q, k.float()) / math.sqrt(q.shape[-1])
    return torch.einsum("hgwt,htd->hgwd", a.softmax(-1), v.float())


def output_error(layers, kv, queries, heads) -> float:
    """Mean relative error of the window queries' attention output over kept vs full prefix KV."""
    full = split_heads(kv, heads)
    errs = []
    for layer, lk in enumerate(layers):
        q = queries[layer].view(heads, -1, *queries.shape[2:]).float()
        attend = functools.partial(attention_output, q)
        ref = attend(full[0, layer], full[1, layer])
        errs.append(((attend(lk.keys, lk.values) - ref).norm() / ref.norm()).item())
    return sum(errs) / len(errs)


def test_real_model_key_norm_proxy_tracks_attention(real_kv):
    """The documented query-agnostic score correlates with real attention; keys used as their own
    queries (the rejected alternative) do worse."""
    from scipy.stats import spearmanr

    kv, queries, heads = real_kv
    truth = window_attention(kv, CompressionContext(heads, queries=queries)).sum(3).mean(2)  # [L, H, T]
    keys = split_heads(kv, heads)[0].float()
    self_attn = (keys @ keys.transpose(-1, -2) / math.sqrt(keys.shape[-1])).softmax(-1).amax(-2)

    def rho(score):
        r = [spearmanr(score[la, h], truth[la, h]).statistic for la in range(kv.shape[1]) for h in range(heads)]
        return sum(r) / len(r)

    proxy = rho(key_norm_score(kv, heads))
    assert proxy > 0.1 and proxy > rho(self_attn) + 0.1


def test_real_model_eviction_beats_random_at_the_same_budget(real_kv):
    kv, queries, heads = real_kv
    full = split_heads(kv, heads)
    gen = torch.Generator().manual_seed(0)
    rand = []
    for _ in range(3):
        idx = torch.randperm(256, generator=gen)[:64].sort().values
        rand.append(output_error(
            [LayerKV(full[0, la][:, idx], full[1, la][:, idx], idx.expand(heads, -1)) for la in range(kv.shape[1])],
            kv, queries, heads,
        ))
    random_err = sum(rand) / len(rand)
    errs = {}
    for method, ctx in [("snapkv", "q"), ("h2o", "q"), ("pyramidkv", "q"), ("kvzip", "q"), ("kvzip", "-"),
                        ("poissoncomp", "q"), ("poissoncomp", "-")]:
        c = compressors.get(method, keep_ratio=0.25)
        ckv = c.compress(kv, heads, queries=queries if ctx == "q" else None)
        errs[method, ctx] = output_error(c.decompress(ckv), kv, queries, heads)
    assert all(e < random_err for e in errs.values()), (errs, random_err)
    assert errs["kvzip", "q"] < errs["kvzip", "-"] and errs["poissoncomp", "q"] < errs["poissoncomp", "-"]
