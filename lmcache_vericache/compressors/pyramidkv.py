"""PyramidKV: SnapKV scoring with per-layer budgets shrinking linearly with depth.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", 2024
(arXiv 2406.02069). Lower layers attend broadly and get more tokens, upper layers few: budgets form an
arithmetic sequence from ``max`` (layer 0) down to ``min = mean / beta`` (last layer), with
``max = 2 * mean - min`` so the mean budget is ``keep_ratio * T``. As in the paper's code, if ``max``
exceeds the chunk it is capped at ``T`` and ``min`` raised to keep the mean. Integer budgets sum to
exactly ``L * budget(T, keep_ratio)``. Scoring, pooling, window and fallback are SnapKV's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import register
from .base import budget
from .snapkv import SnapKV


@register
@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"
    examples = ({"keep_ratio": 0.25, "fallback": "key_norm"}, {"keep_ratio": 0.5, "beta": 4.0, "fallback": "key_norm"})
    beta: float = 20.0

    def validate(self) -> None:
        super().validate()
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta >= 1):
            raise ValueError(f"beta must be a finite number >= 1, got {self.beta!r}")

    def layer_budgets(self, n_layers: int, n_tokens: int) -> list[int]:
        mean = budget(n_tokens, self.keep_ratio)
        if n_layers == 1:
            return [mean]
        lo = max(1.0, mean / self.beta)
        hi = 2 * mean - lo
        if hi > n_tokens:
            hi, lo = float(n_tokens), 2.0 * mean - n_tokens
        exact = torch.linspace(hi, lo, n_layers, dtype=torch.float64)
        out = exact.floor()
        # hand the rounding remainder to the largest fractions: the sum stays exact, the order monotone
        short = n_layers * mean - int(out.sum())
        out[(exact - out).argsort(descending=True, stable=True)[:short]] += 1
        return [int(b) for b in out.clamp(1, n_tokens)]
