"""StreamingLLM: attention sinks plus a recent window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
(arXiv 2309.17453). Keeps the first ``n_sink`` tokens of the sequence and the most recent tokens.

Applied to one chunk of a longer prefix, "recent" means the end of that chunk: the sinks are the
absolute positions ``< n_sink`` (only the first chunk has them) and the rest of the budget goes to the
chunk's last tokens. The engine keeps the newest tokens of the whole sequence at full precision, which
supplies the true recent window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .base import CompressionContext, KVCompressor, TokenEvictor, budget
from .params import check_ratio


@register
@dataclass
class StreamingLLM(KVCompressor, TokenEvictor):
    name = "streamingllm"
    keep_ratio: float = 0.25
    n_sink: int = 4

    def validate(self) -> None:
        check_ratio("keep_ratio", self.keep_ratio)
        if self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")

    def select(self, kv: torch.Tensor, ctx: CompressionContext) -> list[torch.Tensor]:
        n_layers, n_tokens = kv.shape[1], kv.shape[2]
        k = budget(n_tokens, self.keep_ratio)
        pos = torch.arange(n_tokens)
        sinks = pos[pos + ctx.start < self.n_sink][:k]
        recent = pos[max(len(sinks), n_tokens - (k - len(sinks))):]
        idx = torch.cat([sinks, recent]).expand(ctx.num_kv_heads, -1).contiguous()
        return [idx] * n_layers
