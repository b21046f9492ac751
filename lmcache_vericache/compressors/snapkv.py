"""SnapKV: keep the tokens an observation window of queries attends to.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024 (arXiv 2404.14469).
Attention of the window's queries over the keys (softmax, scale 1/sqrt(D)), summed over the window
and averaged over the query heads of a GQA group, smoothed by 1-D pooling, then top-k per KV head.

Storage-layer variant: the queries come from the engine (``compress(queries=...)``). By default they
are taken to sit after the chunk (the prompt's last tokens scoring an earlier chunk). With
``window_in_chunk`` they are the chunk's own last ``w`` tokens, as in the paper: causal mask, scores
over the tokens before the window, and the window itself always kept (inside the budget).
``ctx.scores`` from the engine are used as given (no pooling). Without queries or scores this raises,
unless ``fallback="key_norm"`` picks the documented query-agnostic score (see ``scoring.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .base import CompressionContext, KVCompressor, TokenEvictor, budget, topk_keep
from .params import check_choice, check_ratio
from .scoring import FALLBACKS, importance, pool


@register
@dataclass
class SnapKV(KVCompressor, TokenEvictor):
    name = "snapkv"
    examples = (
        {"keep_ratio": 0.25, "fallback": "key_norm"},
        {"keep_ratio": 0.5, "kernel_size": 3, "pooling": "max", "fallback": "key_norm"},
    )
    keep_ratio: float = 0.25
    kernel_size: int = 5
    pooling: str = "avg"
    window_in_chunk: bool = False
    fallback: str = "error"

    def validate(self) -> None:
        check_ratio("keep_ratio", self.keep_ratio)
        if not (isinstance(self.kernel_size, int) and self.kernel_size >= 1 and self.kernel_size % 2):
            raise ValueError(f"kernel_size must be an odd int >= 1, got {self.kernel_size!r}")
        check_choice("pooling", self.pooling, ("avg", "max"))
        check_choice("fallback", self.fallback, FALLBACKS)

    def layer_budgets(self, n_layers: int, n_tokens: int) -> list[int]:
        """Tokens kept per layer; the same everywhere (PyramidKV overrides)."""
        return [budget(n_tokens, self.keep_ratio)] * n_layers

    def select(self, kv: torch.Tensor, ctx: CompressionContext) -> list[torch.Tensor]:
        n_layers, n_tokens = kv.shape[1], kv.shape[2]
        scores = importance(
            kv, ctx, method=self.name, window_in_chunk=self.window_in_chunk, fallback=self.fallback
        )
        window = 0
        if self.window_in_chunk and ctx.scores is None and ctx.queries is not None:
            window = ctx.queries.shape[2]
        if ctx.scores is None:  # pool what we computed, over the tokens before the window only
            scores = pool(scores, self.kernel_size, self.pooling, n_tokens - window)
        forced = torch.arange(n_tokens) >= n_tokens - window if window else None
        return [topk_keep(scores[layer], k, forced) for layer, k in enumerate(self.layer_budgets(n_layers, n_tokens))]
