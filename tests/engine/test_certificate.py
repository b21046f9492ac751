"""VerKV's estimator, certificate and fetch plan against its formulas (engine/certificate.py)."""

from __future__ import annotations

import math

import torch

from lmcache_vericache.engine.certificate import (
    epsilon_hat,
    estimate,
    fetch_order,
    fetch_plan,
    mse,
    shrinkage,
)


def case(rows: int = 4, n: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(rows, n, generator=g, dtype=torch.float64) ** 4 * 5  # skewed, like attention
    r = torch.rand(rows, n, generator=g, dtype=torch.float64).clamp(0.05, 0.95)
    return w, r, torch.ones(rows, n, dtype=torch.bool)


def test_two_token_case_by_hand():
    # w = (1, 1), r = (1/2, 1/2): lambda = clip(beta), beta = 2 (1 - lambda) -> beta = lambda = 2/3.
    w, r = torch.ones(1, 2, dtype=torch.float64), torch.full((1, 2), 0.5, dtype=torch.float64)
    in_l = torch.ones(1, 2, dtype=torch.bool)
    lam, beta = shrinkage(w, r, in_l)
    assert torch.allclose(lam, torch.full((1, 2), 2 / 3, dtype=torch.float64)) and math.isclose(beta.item(), 2 / 3)
    ld = math.log(2 / 0.1)
    v, b = 2 * (4 / 9) * 1 * (0.5 / 0.5), (2 / 3) * 2 * 0.5  # V and b of lemma 1
    want = (2 / 3 + b * ld / 3 + math.sqrt((b * ld / 3) ** 2 + 2 * v * ld)) / 2
    assert math.isclose(epsilon_hat(w, r, in_l, lam, beta, torch.tensor([2.0], dtype=torch.float64), 0.1).item(), want, rel_tol=1e-9)


def test_shrinkage_is_the_fixed_point_and_minimizes_the_mse():
    w, r, in_l = case()
    in_l[:, :5] = False  # H
    lam, beta = shrinkage(w, r, in_l)
    clip = torch.minimum(torch.ones_like(r), torch.maximum(r, beta[:, None] * r / (w * (1 - r))))
    assert torch.allclose(lam[in_l], clip[in_l], rtol=1e-9) and bool((lam[~in_l] == 1).all())
    assert torch.allclose(beta, (w * (1 - lam) * in_l).sum(-1))
    best = mse(w, r, in_l, lam)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):  # any other lambda in [r, 1] does worse (theorem 1: the unique minimizer)
        other = (lam + 0.05 * torch.randn(lam.shape, generator=g, dtype=torch.float64)).clamp(max=1).maximum(r)
        assert bool((mse(w, r, in_l, other) >= best - 1e-12).all())
    assert bool((mse(w, r, in_l, torch.ones_like(lam)) > best).all())  # beats Horvitz-Thompson (lambda = 1)


def draws(r: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((n, *r.shape), generator=g, dtype=torch.float64) < r


def test_horvitz_thompson_is_unbiased_and_shrinkage_is_biased_by_beta():
    w, r, in_l = case(rows=3, n=30, seed=2)
    in_l[:, -4:] = False
    known = ~in_l
    z = draws(r, 40_000)
    lam, beta = shrinkage(w, r, in_l)
    d = w.sum(-1)
    ht = (estimate(w, r, known, z, torch.ones_like(lam)) * w).sum(-1).mean(0)
    shrunk = (estimate(w, r, known, z, lam) * w).sum(-1).mean(0)
    assert torch.allclose(ht, d, rtol=0.01)  # E[D^] = D at lambda = 1
    assert torch.allclose(shrunk, d - beta, rtol=0.01)  # E[D^] = D - beta: the bias it trades


def test_certificate_holds_with_probability_one_minus_delta():
    w, r, in_l = case(rows=8, n=60, seed=3)
    lam, beta = shrinkage(w, r, in_l)
    d = w.sum(-1)
    eps = epsilon_hat(w, r, in_l, lam, beta, d, 0.1)
    z = draws(r, 5_000, seed=4)
    err = ((estimate(w, r, ~in_l, z, lam) * w).sum(-1) - d).abs() / d
    assert (err > eps).double().mean().item() <= 0.1


def test_fetch_plan_reaches_epsilon_with_the_fewest_tokens_in_its_order():
    w, r, _ = case(rows=6, n=50, seed=5)
    known = torch.zeros_like(w, dtype=torch.bool)
    known[:, :3] = True
    fetch, before, after = fetch_plan(w, r, known, 0.05, 0.1)
    assert bool((before >= 0.05).all()) and bool((after < 0.05).all())
    assert not bool((fetch & known).any()) and bool(fetch.any(-1).all())
    in_l = ~known & (r < 1)
    rank = fetch_order(w, r, in_l, shrinkage(w, r, in_l)[0], 0.1)
    k = fetch.sum(-1)
    assert torch.equal(fetch, in_l & (rank < k[:, None]))  # a prefix of g's order
    shorter = in_l & (rank >= (k - 1)[:, None])  # one token fewer in that order no longer certifies
    lam, beta = shrinkage(w, r, shorter)
    assert bool((epsilon_hat(w, r, shorter, lam, beta, w.sum(-1), 0.1) >= 0.05).all())
    nothing, b2, a2 = fetch_plan(w, r, known, 10.0, 0.1)  # a loose epsilon fetches nothing
    assert not bool(nothing.any()) and torch.equal(b2, a2)
