"""VerKV's bounded shrinkage estimator, its Bernstein certificate and KVFetch's fetch plan.

Written from the VerKV equations (docs/verkv.md). For one query, token i of the prefix has attention
weight ``w_i = exp(q.k_i * scale - m)``; the softmax denominator is ``D = sum_i w_i``. Tokens are
split into ``H`` (known exactly: kept for sure, or fetched) and ``L`` (sampled independently with
inclusion probability ``0 < r_i < 1``; ``Z_i`` says whether i was drawn). The estimator

    D^ = sum_H w_i + sum_L Z_i lambda_i w_i / r_i,
    lambda_i = clip_[r_i, 1](beta r_i / (w_i (1 - r_i))),   beta = sum_L w_i (1 - lambda_i)

minimizes ``MSE(lambda) = (sum_L w_i (1 - lambda_i))^2 + sum_L lambda_i^2 w_i^2 (1 - r_i) / r_i``
(``beta`` is the bias, a fixed point solved here by bisection), and with probability >= 1 - delta

    |D^ - D| / D <= eps^(L) = (beta + b l / 3 + sqrt((b l / 3)^2 + 2 V l)) / D,   l = log(2 / delta),
    V = sum_L lambda_i^2 w_i^2 (1 - r_i) / r_i,   b = max_L lambda_i w_i max(r_i, 1 - r_i) / r_i.

KVFetch moves tokens from ``L`` to ``H`` (fetches them) until ``eps^ < epsilon``: tokens ordered by
``g_i = eps^(L) - eps^(L minus i)`` (evaluated here at fixed lambda, a first-order version of the
paper's score), the shortest fetch found by bisection on the order with lambda re-solved each time.
The numerator uses the same weights, so attention is ``N^ / D^`` over the known and sampled tokens.

Everything is batched: rows (a query and a head each) along the leading axes, tokens along the last.
Weights must come from the sketch for tokens not resident (the paper's step 1); which tokens get
fetched depends on the sketch and ``r`` only, never on ``Z``, so the estimator stays as specified.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor
_R_MIN = 1e-12  # r = 0 (a token never drawn) counts fully as bias, without dividing by zero


def shrinkage(w: Tensor, r: Tensor, in_l: Tensor, iters: int = 50) -> tuple[Tensor, Tensor]:
    """``(lambda, beta)`` of the bounded shrinkage estimator: ``lambda [..., T]`` (1 outside ``L``),
    ``beta [...]``. ``w``, ``r``: ``[..., T]``; ``in_l``: bool ``[..., T]``, the tokens of ``L``."""
    w, r = w.double(), r.double().clamp(_R_MIN, 1.0)
    live = in_l & (w > 0)
    a = torch.where(live, r / (w.clamp_min(1e-300) * (1 - r).clamp_min(1e-300)), torch.zeros_like(w))
    wl = torch.where(in_l, w, torch.zeros_like(w))

    def lam_at(beta: Tensor) -> Tensor:
        return torch.where(live, torch.minimum(torch.ones_like(w), torch.maximum(r, beta[..., None] * a)),
                           torch.ones_like(w))

    # f(beta) = sum_L w (1 - lambda(beta)) - beta decreases from f(0) >= 0 to f(sum_L w (1 - r)) <= 0.
    lo = torch.zeros(w.shape[:-1], dtype=torch.float64, device=w.device)
    hi = (wl * (1 - r)).sum(-1)
    for _ in range(iters):
        mid = (lo + hi) / 2
        above = (wl * (1 - lam_at(mid))).sum(-1) > mid
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    lam = lam_at((lo + hi) / 2)
    return lam, (wl * (1 - lam)).sum(-1)


def mse(w: Tensor, r: Tensor, in_l: Tensor, lam: Tensor) -> Tensor:
    """The estimator's mean squared error at ``lam`` (VerKV eq. 6), ``[...]``."""
    w, r = w.double(), r.double().clamp(_R_MIN, 1.0)
    wl = torch.where(in_l, w, torch.zeros_like(w))
    return (wl * (1 - lam)).sum(-1) ** 2 + (lam ** 2 * wl ** 2 * (1 - r) / r).sum(-1)


def epsilon_hat(w: Tensor, r: Tensor, in_l: Tensor, lam: Tensor, beta: Tensor, d: Tensor, delta: float) -> Tensor:
    """Bernstein certificate ``eps^(L)`` (VerKV lemma 1): ``|D^ - D| / D <= eps^`` with probability
    ``>= 1 - delta``. ``d``: the denominator ``D`` ``[...]`` (from the sketch where not known)."""
    w, r = w.double(), r.double().clamp(_R_MIN, 1.0)
    wl = torch.where(in_l, w, torch.zeros_like(w))
    l_delta = math.log(2 / delta)
    var = (lam ** 2 * wl ** 2 * (1 - r) / r).sum(-1)
    b = (lam * wl / r * torch.maximum(r, 1 - r)).amax(-1)
    t = b * l_delta / 3
    return (beta + t + (t * t + 2 * var * l_delta).sqrt()) / d.double()


def estimate(w: Tensor, r: Tensor, known: Tensor, drawn: Tensor, lam: Tensor) -> Tensor:
    """Per-token multipliers of the estimator: 1 on ``known`` (H and fetched), ``Z_i lambda_i / r_i``
    on ``L``; ``D^ = sum(mult * w)`` and ``N^ = sum(mult * w * v)``. ``drawn``: ``Z`` (bool)."""
    r = r.double().clamp(_R_MIN, 1.0)
    return torch.where(known, torch.ones_like(lam), torch.where(drawn, lam / r, torch.zeros_like(lam)))


def fetch_order(w: Tensor, r: Tensor, in_l: Tensor, lam: Tensor, delta: float) -> Tensor:
    """Rank (0 = fetch first) of every token by ``g_i`` at fixed ``lam``: dropping i from ``L`` removes
    its bias ``w_i (1 - lambda_i)`` and its variance term. Tokens outside ``L`` rank last."""
    rc = r.double().clamp(_R_MIN, 1.0)
    wl = torch.where(in_l, w.double(), torch.zeros_like(rc))
    l_delta = math.log(2 / delta)
    v_i = lam ** 2 * wl ** 2 * (1 - rc) / rc
    v = v_i.sum(-1, keepdim=True)
    t = ((lam * wl / rc * torch.maximum(rc, 1 - rc)).amax(-1) * l_delta / 3)[..., None]
    g = wl * (1 - lam) + (t * t + 2 * v * l_delta).sqrt() - (t * t + 2 * (v - v_i).clamp_min(0) * l_delta).sqrt()
    order = g.masked_fill(~in_l, -math.inf).argsort(-1, descending=True)
    ramp = torch.arange(order.shape[-1], device=order.device).expand_as(order).contiguous()
    return torch.empty_like(order).scatter_(-1, order, ramp)


def fetch_plan(w: Tensor, r: Tensor, known: Tensor, epsilon: float, delta: float,
               d: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """KVFetch's decision per row: ``(fetch, eps_before, eps_after)``, ``fetch`` a bool ``[..., T]`` of
    the fewest tokens (in ``g`` order) whose moving from ``L`` to ``H`` brings ``eps^`` below ``epsilon``.

    ``w``: weights (sketch), ``r``: inclusion probabilities, ``known``: tokens already in ``H``;
    every other token with ``r < 1`` is in ``L``. ``d`` defaults to ``sum w``."""
    w = w.double()
    d = w.sum(-1) if d is None else d.double()
    in_l = ~known & (r < 1)
    lam, beta = shrinkage(w, r, in_l)
    eps0 = epsilon_hat(w, r, in_l, lam, beta, d, delta)
    need = eps0 >= epsilon
    fetch = torch.zeros_like(in_l)
    if not bool(need.any()):
        return fetch, eps0, eps0
    rank = fetch_order(w, r, in_l, lam, delta)
    # Smallest k with eps^(L minus the first k) < epsilon: k = |L| always qualifies (eps^ = 0).
    lo = torch.zeros_like(eps0, dtype=torch.long)
    hi = torch.where(need, in_l.sum(-1), lo)
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        rest = in_l & (rank >= mid[..., None])
        lam_m, beta_m = shrinkage(w, r, rest)
        ok = epsilon_hat(w, r, rest, lam_m, beta_m, d, delta) < epsilon
        active = hi - lo > 1
        hi = torch.where(active & ok, mid, hi)
        lo = torch.where(active & ~ok, mid, lo)
    fetch = in_l & (rank < hi[..., None])
    rest = in_l & ~fetch
    lam_f, beta_f = shrinkage(w, r, rest)
    return fetch, eps0, epsilon_hat(w, r, rest, lam_f, beta_f, d, delta)
