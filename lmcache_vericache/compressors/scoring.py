"""Token importance shared by the eviction methods: attention of given queries, or a query-agnostic proxy.

Order of precedence, the same for every method: ``ctx.scores`` (the engine's own importance) over
``ctx.queries`` (attention computed here) over the key-norm proxy, and the proxy only where the method
asks for it: a method that needs queries raises instead of silently scoring something else.

The proxy is the key L2 norm (Devoto et al. 2024, arXiv 2406.11430: keys with a small norm receive
more attention). Measured on SmolLM2-135M (640 tokens of ``json/decoder.py``, attention of the last
64 queries over the rest, per KV head): Spearman +0.40 for ``1/||k||`` against -0.27 for "keys used as
their own queries", so the latter is not offered; +0.18 on a 256-token chunk scored by the 64 queries
after it (``tests/compressors/test_eviction.py`` checks both claims on the real model). A weak signal.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import CompressionContext, split_heads
from .params import check_choice

FALLBACKS = ("error", "key_norm")


def window_attention(kv: Tensor, ctx: CompressionContext, window_in_chunk: bool = False) -> Tensor:
    """Softmax attention of ``ctx.queries`` ``[L, Hq, w, D]`` over the chunk's keys: ``[L, H, G, w, T]``,
    ``G = Hq // H`` query heads per KV head (GQA). With ``window_in_chunk`` the queries are the chunk's
    own last ``w`` tokens, so each one only sees the keys up to itself (causal mask)."""
    keys = split_heads(kv, ctx.num_kv_heads)[0].float()  # [L, H, T, D]
    n_layers, heads, n_tokens, head_dim = keys.shape
    q = ctx.queries
    if q is None or q.dim() != 4 or q.shape[0] != n_layers or q.shape[3] != head_dim or q.shape[1] % heads:
        got = None if q is None else tuple(q.shape)
        raise ValueError(f"queries must be [L={n_layers}, Hq (multiple of {heads}), w, D={head_dim}], got {got}")
    w = q.shape[2]
    if window_in_chunk and w > n_tokens:
        raise ValueError(f"window_in_chunk: {w} queries but the chunk has only {n_tokens} tokens")
    q = q.detach().cpu().float().view(n_layers, heads, q.shape[1] // heads, w, head_dim)
    logits = torch.einsum("lhgwd,lhtd->lhgwt", q, keys) / math.sqrt(head_dim)
    if window_in_chunk:
        future = torch.arange(n_tokens) > (torch.arange(w) + n_tokens - w)[:, None]
        logits = logits.masked_fill(future, float("-inf"))
    return logits.softmax(-1)


def key_norm_score(kv: Tensor, num_kv_heads: int) -> Tensor:
    """Query-agnostic proxy ``1 / ||k||``, ``[L, H, T]``, positive, higher = more important."""
    return split_heads(kv, num_kv_heads)[0].float().norm(dim=-1).clamp_min(1e-6).reciprocal()


def importance(
    kv: Tensor,
    ctx: CompressionContext,
    *,
    method: str,
    reduce: str = "sum",
    window_in_chunk: bool = False,
    fallback: str = "error",
) -> Tensor:
    """Per-token importance ``[L, H, T]`` (see module docstring for the precedence).

    ``reduce``: how attention from the queries is aggregated, "sum" (SnapKV, H2O: summed over queries,
    averaged over a GQA group) or "max" (KVzip: the most any query gives the token)."""
    check_choice("fallback", fallback, FALLBACKS)
    if ctx.scores is not None:
        return ctx.scores.detach().cpu().float()
    if ctx.queries is not None:
        attn = window_attention(kv, ctx, window_in_chunk)
        return attn.sum(3).mean(2) if reduce == "sum" else attn.amax(dim=(2, 3))
    if fallback == "key_norm":
        return key_norm_score(kv, ctx.num_kv_heads)
    raise ValueError(
        f"{method} needs queries= or scores= (observation-window attention); none given. "
        f"Pass them to compress(), or set fallback='key_norm' to use the query-agnostic key-norm score"
    )


def pool(scores: Tensor, kernel_size: int, mode: str, length: int | None = None) -> Tensor:
    """SnapKV's 1-D pooling along tokens (stride 1, same length) over the first ``length`` tokens."""
    if kernel_size == 1:
        return scores
    n = scores.shape[-1] if length is None else length
    flat = scores[..., :n].reshape(-1, 1, n)
    op = torch.nn.functional.avg_pool1d if mode == "avg" else torch.nn.functional.max_pool1d
    pooled = op(flat, kernel_size, stride=1, padding=kernel_size // 2).view(*scores.shape[:-1], n)
    return torch.cat([pooled, scores[..., n:]], dim=-1)
