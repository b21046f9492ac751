"""VerKV's bounded shrinkage estimator, its Bernstein certificate and KVFetch's fetch plan.

Written from the VerKV equations (docs/verkv.md). For one query, token i of the prefix has attention
weight ``w_i = exp(q.k_i * scale - m)``; the softmax denominator is ``D = sum_i w_i``. Tokens are
split into ``H`` (known exactly: kept for sure, or fetched) and ``L`` (sampled independently with
inclusion probability ``0 < r_i < 1``; ``Z_i`` says whether i was drawn). The estimator

    D^ = sum_H w_i + sum_L Z_i lambda_i w_i / r_i,
    lambda_i = clip_[r_i, 1](beta r_i / (w_i (1 - r_i))),   beta = sum_L w_i (1 - lambda_i)

minimizes ``MSE(lambda) = (sum_L w_i (1 - lambda_i))^2 + sum_L lambda_i^2 w_i^2 (1 - r_i) / r_i``
(``beta`` is the bias, a fixed point solved here exactly), and with probability >= 1 - delta

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


def _real(x: Tensor) -> Tensor:
    """Computations run in float32, or float64 where the caller passes float64."""
    return x if x.dtype == torch.float64 else x.float()


_R_MIN = 1e-12  # r = 0 (a token never drawn) counts fully as bias, without dividing by zero


def shrinkage(w: Tensor, r: Tensor, in_l: Tensor) -> tuple[Tensor, Tensor]:
    """``(lambda, beta)`` of the bounded shrinkage estimator: ``lambda [..., T]`` (1 outside ``L``),
    ``beta [...]``. ``w``, ``r``: ``[..., T]``; ``in_l``: bool ``[..., T]``, the tokens of ``L``."""
    return _Shrinkage(w, r, in_l).solve(in_l)


class _Shrinkage:
    """Solves ``f(beta) = sum_L w_i (1 - lambda_i(beta)) - beta = 0`` exactly, for ``L`` and any
    subset of it. Each term is ``w_i (1 - r_i)`` up to ``beta = w_i (1 - r_i)``, then falls with slope
    ``r_i / (1 - r_i)`` until ``beta = w_i (1 - r_i) / r_i``, then is 0: ``f`` is continuous,
    decreasing and piecewise linear. The ``2T`` breakpoints are sorted once; a subset only zeroes
    the slope changes of the tokens it drops (a breakpoint without one changes nothing), so each
    solve is a cumulative sum over the same order."""

    def __init__(self, w: Tensor, r: Tensor, in_l: Tensor):
        self.w, self.r = _real(w), _real(r).clamp(_R_MIN, 1.0)
        self.live = in_l & (self.w > 0) & (self.r < 1)
        zero = torch.zeros_like(self.w)
        self.lo = torch.where(self.live, self.w * (1 - self.r), zero)  # term i starts falling here
        self.c = torch.where(self.live, self.r / (1 - self.r), zero)  # ... with this slope
        self.events, self.order = torch.cat([self.lo, self.lo / self.r], -1).sort(-1)
        self.gap = self.events.diff(dim=-1, prepend=torch.zeros_like(self.events[..., :1]))

    def solve(self, subset: Tensor) -> tuple[Tensor, Tensor]:
        w, r = self.w, self.r
        live = self.live & subset
        c = torch.where(live, self.c, torch.zeros_like(self.c))
        slope_after = torch.cat([-c, c], -1).gather(-1, self.order).cumsum(-1) - 1  # f' right of each event
        slope_before = torch.cat([torch.full_like(slope_after[..., :1], -1.0), slope_after[..., :-1]], -1)
        f_at = torch.where(live, self.lo, torch.zeros_like(w)).sum(-1, keepdim=True) + (slope_before * self.gap).cumsum(-1)
        pos = (f_at > 0).sum(-1, keepdim=True)  # f decreases: the root follows the last event with f > 0
        j = (pos - 1).clamp_min(0)
        e_j, f_j, s_j = self.events.gather(-1, j), f_at.gather(-1, j), slope_after.gather(-1, j)
        beta = torch.where(pos > 0, e_j - f_j / s_j, torch.zeros_like(e_j)).squeeze(-1)
        lam = torch.where(live, torch.minimum(torch.ones_like(w), torch.maximum(r, beta[..., None] * c / w.clamp_min(1e-300))),
                          torch.ones_like(w))
        return lam, torch.where(subset, w * (1 - lam), torch.zeros_like(w)).sum(-1)


def mse(w: Tensor, r: Tensor, in_l: Tensor, lam: Tensor) -> Tensor:
    """The estimator's mean squared error at ``lam`` (VerKV eq. 6), ``[...]``."""
    w, r = _real(w), _real(r).clamp(_R_MIN, 1.0)
    wl = torch.where(in_l, w, torch.zeros_like(w))
    return (wl * (1 - lam)).sum(-1) ** 2 + (lam ** 2 * wl ** 2 * (1 - r) / r).sum(-1)


def epsilon_hat(w: Tensor, r: Tensor, in_l: Tensor, lam: Tensor, beta: Tensor, d: Tensor, delta: float) -> Tensor:
    """Bernstein certificate ``eps^(L)`` (VerKV lemma 1): ``|D^ - D| / D <= eps^`` with probability
    ``>= 1 - delta``. ``d``: the denominator ``D`` ``[...]`` (from the sketch where not known)."""
    w, r = _real(w), _real(r).clamp(_R_MIN, 1.0)
    wl = torch.where(in_l, w, torch.zeros_like(w))
    l_delta = math.log(2 / delta)
    var = (lam ** 2 * wl ** 2 * (1 - r) / r).sum(-1)
    b = (lam * wl / r * torch.maximum(r, 1 - r)).amax(-1)
    t = b * l_delta / 3
    return (beta + t + (t * t + 2 * var * l_delta).sqrt()) / _real(d)


def estimate(w: Tensor, r: Tensor, known: Tensor, drawn: Tensor, lam: Tensor) -> Tensor:
    """Per-token multipliers of the estimator: 1 on ``known`` (H and fetched), ``Z_i lambda_i / r_i``
    on ``L``; ``D^ = sum(mult * w)`` and ``N^ = sum(mult * w * v)``. ``drawn``: ``Z`` (bool)."""
    r = _real(r).clamp(_R_MIN, 1.0)
    return torch.where(known, torch.ones_like(lam), torch.where(drawn, lam / r, torch.zeros_like(lam)))


def fetch_order(w: Tensor, r: Tensor, in_l: Tensor, lam: Tensor, delta: float) -> Tensor:
    """Rank (0 = fetch first) of every token by ``g_i`` at fixed ``lam``: dropping i from ``L`` removes
    its bias ``w_i (1 - lambda_i)`` and its variance term. Tokens outside ``L`` rank last."""
    rc = _real(r).clamp(_R_MIN, 1.0)
    wl = torch.where(in_l, _real(w), torch.zeros_like(rc))
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
    w = _real(w)
    d = w.sum(-1) if d is None else _real(d)
    in_l = ~known & (r < 1)
    solver = _Shrinkage(w, r, in_l)
    lam, beta = solver.solve(in_l)
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
        lam_m, beta_m = solver.solve(rest)
        ok = epsilon_hat(w, r, rest, lam_m, beta_m, d, delta) < epsilon
        active = hi - lo > 1
        hi = torch.where(active & ok, mid, hi)
        lo = torch.where(active & ~ok, mid, lo)
    fetch = in_l & (rank < hi[..., None])
    rest = in_l & ~fetch
    lam_f, beta_f = solver.solve(rest)
    return fetch, eps0, epsilon_hat(w, r, rest, lam_f, beta_f, d, delta)
