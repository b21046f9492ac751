"""PoissonComp: Poisson sampling of tokens with importance-proportional inclusion probabilities.

From VerKV (PoissonComp + KVFetch); the formulas used are the ones below. Importance ``tau`` comes from
``ctx.scores``, else by KVzip's precedence (queries by max attention, else the key-norm proxy; see
``kvzip.py``), normalized to [0, 1]. Tokens in ``H`` (absolute positions < ``n_sink`` and the
chunk's last ``n_local``, both cut to fit the budget, sinks first) are kept with probability 1;
every other token i independently with ``r_i = min(1, c * tau_i)``, ``c`` found by bisection so that
``sum r_i = keep_ratio * T - |H|``: the expected number kept is the budget, the actual number varies.

One sample per layer, shared by its KV heads: the format needs equal counts across the heads of a
layer (layers may differ), and independent per-head samples would only meet that by padding or
trimming, which breaks the inclusion probabilities. So ``tau`` is the max over heads of each head's
normalized score (a token kept for one head is kept for all), and the sample is an exact Poisson
sample with known ``r``. The ``r`` are not stored (the format holds no extra eviction buffers);
``inclusion_probabilities`` recomputes them from the same scores for KVFetch-style estimators.

The generator is seeded with ``seed`` and the chunk's ``start``: the same chunk always gives the same
sample, different chunks of one prefix get independent ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .base import CompressionContext, KVCompressor, TokenEvictor, budget, check_ratio
from .kvzip import kvzip_scores


def inclusion_probabilities(tau: torch.Tensor, target: float, iters: int = 64) -> torch.Tensor:
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

    def probabilities(self, kv: torch.Tensor, ctx: CompressionContext) -> torch.Tensor:
        """Inclusion probabilities ``[L, T]`` (1 on ``H``)."""
        n_tokens = kv.shape[2]
        tau = kvzip_scores(kv, ctx)
        if (tau < 0).any():
            raise ValueError("poissoncomp needs nonnegative importance scores")
        top = tau.amax(-1, keepdim=True)
        tau = torch.where(top > 0, tau / top.clamp_min(1e-30), torch.ones_like(tau)).amax(1)  # [L, T]
        k = budget(n_tokens, self.keep_ratio)
        pos = torch.arange(n_tokens)
        sinks = (pos + ctx.start < self.n_sink) & (pos < k)  # H fits the budget, sinks first
        n_local = min(self.n_local, k - int(sinks.sum()))
        hard = sinks | (pos >= n_tokens - n_local) if n_local else sinks
        target = k - int(hard.sum())
        return inclusion_probabilities(tau.masked_fill(hard, 0.0), target).masked_fill(hard, 1.0)

    def kept_counts(self, shape, num_kv_heads):
        return None  # a Poisson sample: each layer keeps 1..T tokens

    def check_positions(self, pos: torch.Tensor, n_tokens: int) -> None:
        super().check_positions(pos, n_tokens)
        if pos.shape[0] > 1 and not bool((pos == pos[:1]).all()):
            raise ValueError("poissoncomp keeps the same tokens in every head of a layer; these differ")

    def select(self, kv: torch.Tensor, ctx: CompressionContext) -> list[torch.Tensor]:
        r = self.probabilities(kv, ctx)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + ctx.start)
        keep = torch.rand(r.shape, generator=gen, dtype=torch.float64) < r
        out = []
        for layer_keep, layer_r in zip(keep, r):
            if not layer_keep.any():  # an empty layer cannot be attended to: keep its likeliest token
                layer_keep[layer_r.argmax()] = True
            out.append(layer_keep.nonzero().squeeze(1).expand(ctx.num_kv_heads, -1).contiguous())
        return out
