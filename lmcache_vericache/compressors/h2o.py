"""H2O: heavy hitters (accumulated attention) plus the most recent tokens.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
NeurIPS 2023 (arXiv 2306.14048). A token's score is the attention it has accumulated, summed over
every query that saw it (averaged over a GQA group); ``recent_ratio`` of the budget goes to the most
recent tokens, the rest to the highest scores.

Storage-layer variant: the paper accumulates during decoding; here the accumulation runs over the
queries the engine passes (``compress(queries=...)``, after the chunk, or the chunk's own last tokens
with a causal mask when ``window_in_chunk``), or ``ctx.scores`` are used as the accumulated attention.
"Recent" is the end of the chunk (the engine keeps the sequence's newest tokens at full precision).
Without queries or scores this raises unless ``fallback="key_norm"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .base import CompressionContext, KVCompressor, TokenEvictor, budget, topk_keep
from .params import check_choice, check_ratio
from .scoring import FALLBACKS, importance


@register
@dataclass
class H2O(KVCompressor, TokenEvictor):
    name = "h2o"
    examples = ({"keep_ratio": 0.25, "fallback": "key_norm"}, {"keep_ratio": 0.5, "recent_ratio": 0.0, "fallback": "key_norm"})
    keep_ratio: float = 0.25
    recent_ratio: float = 0.5
    window_in_chunk: bool = False
    fallback: str = "error"

    def validate(self) -> None:
        check_ratio("keep_ratio", self.keep_ratio)
        if not (0.0 <= self.recent_ratio <= 1.0):
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio!r}")
        check_choice("fallback", self.fallback, FALLBACKS)

    def select(self, kv: torch.Tensor, ctx: CompressionContext) -> list[torch.Tensor]:
        n_tokens = kv.shape[2]
        scores = importance(
            kv, ctx, method=self.name, window_in_chunk=self.window_in_chunk, fallback=self.fallback
        )
        k = budget(n_tokens, self.keep_ratio)
        recent = torch.arange(n_tokens) >= n_tokens - round(k * self.recent_ratio)
        return [topk_keep(s, k, recent) for s in scores]
