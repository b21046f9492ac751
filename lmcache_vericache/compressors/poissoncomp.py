"""PoissonComp: Poisson sampling of tokens with importance-proportional inclusion probabilities.

From VerKV (PoissonComp + KVFetch: query-agnostic compression with (epsilon, delta)-verified
attention; docs/verkv.md), written from its equations. Importance ``tau`` comes from ``ctx.scores``, else by KVzip's
precedence (queries by max attention, else the key-norm proxy; see ``kvzip.py``), normalized to
[0, 1] per KV head. Tokens in ``H`` (absolute positions < ``n_sink`` and the chunk's last
``n_local``, both cut to fit the budget, sinks first) are kept with probability 1; every other token
i of head h independently with ``r_hi = min(1, c_h * tau_hi)``, ``c_h`` found by bisection so that
``sum_i r_hi = keep_ratio * T - |H|``: the expected number kept is the budget, the actual varies.

Each KV head draws its own independent Bernoulli sample, as the paper specifies. The format stores
one ``[H, n]`` block per layer, so heads that drew fewer tokens are padded up to the layer's largest
sample with unsampled tokens (the likeliest first). Per layer the chunk stores, beside ``pos`` and
the exact K/V of the stored tokens:

* ``r``  float16 ``[H, T]``: every token's inclusion probability (1 on ``H``), rounded to float16
  *before* sampling, so the stored ``r`` are exactly the ones the sample was drawn with;
* ``in`` uint8 ``[H, n]``: 1 where the stored token belongs to the sample (or ``H``), 0 for padding.

A plain drafter attends to every stored token (padding is real, exact KV: it only keeps a few more);
the estimator of :mod:`lmcache_vericache.engine.certificate` uses ``r`` and ``in`` and ignores the
padding, whose choice depends on the sample (using it would bias the estimator).

The generator is seeded with ``seed`` and the chunk's ``start``: the same chunk always gives the same
sample, different chunks of one prefix get independent ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import register
from .base import CompressionContext, KVCompressor, Layout, TokenEvictor, budget
from .kvzip import kvzip_scores
from .params import check_ratio

Tensor = torch.Tensor


def inclusion_probabilities(tau: Tensor, target: float, iters: int = 64) -> Tensor:
    """``r = min(1, c * tau)`` along the last axis with ``c`` per row such that ``sum r = target``.

    ``tau``: ``[..., n]`` nonnegative; zeros never get picked, so the sum saturates at the number of
    positive entries (all of them then get r = 1)."""
    tau = tau.double()
    if (tau < 0).any():
        raise ValueError("importance scores must be nonnegative for Poisson sampling")
    positive = (tau > 0).sum(-1, keepdim=True)
    lo = torch.zeros_like(positive, dtype=torch.float64)
    hi = 1.0 / tau.masked_fill(tau <= 0, float("inf")).amin(-1, keepdim=True).clamp_min(1e-300)
    for _ in range(iters):  # sum min(1, c tau) is monotone in c
        mid = (lo + hi) / 2
        low = torch.minimum(torch.ones_like(tau), mid * tau).sum(-1, keepdim=True) < target
        lo, hi = torch.where(low, mid, lo), torch.where(low, hi, mid)
    r = torch.minimum(torch.ones_like(tau), hi * tau)
    return torch.where(positive <= target, (tau > 0).double(), r)


def is_poisson_sample(method: str, params: Mapping[str, Any]) -> bool:
    """Whether chunks of ``method`` with ``params`` are PoissonComp samples (directly or as the
    evictor of ``compose``): they carry the inclusion probabilities KVFetch needs."""
    return method == "poissoncomp" or (method == "compose" and params.get("evict") == "poissoncomp")


@register
@dataclass
class PoissonComp(KVCompressor, TokenEvictor):
    name = "poissoncomp"
    examples = ({"keep_ratio": 0.25}, {"keep_ratio": 0.125, "n_sink": 0, "n_local": 0, "seed": 7})
    keep_ratio: float = 0.25
    n_sink: int = 4
    n_local: int = 16
    seed: int = 0

    def validate(self) -> None:
        check_ratio("keep_ratio", self.keep_ratio)
        for field in ("n_sink", "n_local", "seed"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} must be an int >= 0, got {value!r}")

    def probabilities(self, kv: Tensor, ctx: CompressionContext) -> Tensor:
        """Inclusion probabilities ``[L, H, T]`` float64 (1 on ``H``), float16-representable."""
        n_tokens = kv.shape[2]
        tau = kvzip_scores(kv, ctx)
        if (tau < 0).any():
            raise ValueError("poissoncomp needs nonnegative importance scores")
        top = tau.amax(-1, keepdim=True)
        tau = torch.where(top > 0, tau / top.clamp_min(1e-30), torch.ones_like(tau))
        k = budget(n_tokens, self.keep_ratio)
        pos = torch.arange(n_tokens)
        sinks = (pos + ctx.start < self.n_sink) & (pos < k)  # H fits the budget, sinks first
        n_local = min(self.n_local, k - int(sinks.sum()))
        hard = sinks | (pos >= n_tokens - n_local) if n_local else sinks
        r = inclusion_probabilities(tau.masked_fill(hard, 0.0), k - int(hard.sum())).masked_fill(hard, 1.0)
        return r.half().double()  # what is stored is what is sampled with

    def sample(self, kv: Tensor, ctx: CompressionContext) -> tuple[Tensor, Tensor]:
        """``(r, z)``: inclusion probabilities and the Poisson sample (bool), both ``[L, H, T]``."""
        r = self.probabilities(kv, ctx)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + ctx.start)
        return r, torch.rand(r.shape, generator=gen, dtype=torch.float64) < r

    def select_with_extras(self, kv: Tensor, ctx: CompressionContext) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
        r, z = self.sample(kv, ctx)
        keep, extras = [], []
        for layer_r, layer_z in zip(r, z):
            n = max(1, int(layer_z.sum(-1).max()))  # an empty layer cannot be attended to: pad one
            # Sampled tokens first (rank 2), then padding by r (likeliest first), then the rest.
            rank = layer_z.double() * 2 + layer_r
            idx = rank.topk(n, dim=-1).indices.sort(dim=-1).values
            keep.append(idx)
            extras.append({"r": layer_r.half().contiguous(), "in": layer_z.gather(1, idx).to(torch.uint8).contiguous()})
        return keep, extras

    def select(self, kv: Tensor, ctx: CompressionContext) -> list[Tensor]:
        return self.select_with_extras(kv, ctx)[0]

    def kept_counts(self, shape, num_kv_heads):
        return None  # a Poisson sample: each layer keeps 1..T tokens

    def extra_layout(self, num_kv_heads: int, n_tokens: int, n_kept: int) -> Layout:
        return {"r": (torch.float16, (num_kv_heads, n_tokens)), "in": (torch.uint8, (num_kv_heads, n_kept))}

    def check_extras(self, extras: dict[str, Tensor], pos: Tensor) -> None:
        r, member = extras["r"], extras["in"]
        if not bool(torch.isfinite(r).all()) or bool((r < 0).any()) or bool((r > 1).any()):
            raise ValueError("inclusion probabilities must be finite and within [0, 1]")
        if bool((member > 1).any()):
            raise ValueError("sample membership flags must be 0 or 1")
        if bool((r.gather(1, pos.long())[member == 1] <= 0).any()):
            raise ValueError("a sampled token has inclusion probability 0")
        sure = torch.zeros_like(member, dtype=torch.bool).new_zeros(r.shape)
        sure.scatter_(1, pos.long(), member == 1)
        if bool(((r == 1) & ~sure).any()):
            raise ValueError("a token kept for sure (r = 1) is not stored as sampled")
