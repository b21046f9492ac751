"""How much a compressor changes what the model computes, measured the way drafting uses the cache.

Setting (shared by ``vericache compressors``, the quality tests and benchmarks): a prefill of
``N + w`` tokens; the first ``N`` tokens' KV is compressed chunk by chunk (LMCache chunks, each with its
absolute ``start``); the last ``w`` tokens stay at full precision, as the engine's recent window does,
and their queries (after RoPE) are the observation window. They are passed as ``queries=`` to every
chunk, since they come after it, which is what SnapKV-style scoring expects. The number that matters
for every method is the relative error of those queries' attention output over compressed + window
KV against full KV; K/V reconstruction errors are over the kept tokens only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .compressors import CompressedKV, KVCompressor, LayerKV
from .compressors.base import split_heads

CHUNK_SIZE = 256  # LMCache's default chunk


def full_layers(kv: Tensor, num_kv_heads: int, start: int = 0) -> list[LayerKV]:
    """Uncompressed ``[2, L, T, H*D]`` as per-layer ``LayerKV`` (every token kept)."""
    k, v = split_heads(kv, num_kv_heads)  # [L, H, T, D]
    pos = torch.arange(start, start + kv.shape[2]).expand(num_kv_heads, -1)
    return [LayerKV(k[i], v[i], pos) for i in range(kv.shape[1])]


def concat_layers(parts: list[list[LayerKV]]) -> list[LayerKV]:
    """Join consecutive spans (lists of per-layer ``LayerKV``) along the token axis."""
    return [
        LayerKV(*(torch.cat([getattr(p[i], f) for p in parts], dim=1) for f in ("keys", "values", "positions")))
        for i in range(len(parts[0]))
    ]


def attention_output(queries: Tensor, q_positions: Tensor, layers: list[LayerKV]) -> Tensor:
    """Causal softmax attention of ``queries`` ``[L, Hq, w, D]`` at absolute ``q_positions`` ``[w]``
    over each layer's kept keys/values (GQA: query head ``h`` reads KV head ``h // (Hq/H)``), in fp32.
    Returns ``[L, Hq, w, D]``."""
    outs = []
    for q, layer in zip(queries.float(), layers):
        groups = q.shape[0] // layer.keys.shape[0]
        k = layer.keys.float().repeat_interleave(groups, 0)
        v = layer.values.float().repeat_interleave(groups, 0)
        pos = layer.positions.repeat_interleave(groups, 0)  # [Hq, n]
        logits = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        logits = logits.masked_fill(pos[:, None, :] > q_positions[None, :, None], float("-inf"))
        outs.append(logits.softmax(-1) @ v)
    return torch.stack(outs)


def rel_err(approx: Tensor, exact: Tensor) -> float:
    """Relative Frobenius error ``||approx - exact|| / ||exact||``."""
    return float((approx.float() - exact.float()).norm() / exact.float().norm().clamp_min(1e-30))


def compress_chunks(
    comp: KVCompressor, kv: Tensor, num_kv_heads: int, queries: Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> list[CompressedKV]:
    """Compress ``kv`` ``[2, L, T, H*D]`` chunk by chunk, each with its absolute ``start``."""
    return [
        comp.compress(kv[:, :, s:s + chunk_size], num_kv_heads, start=s, queries=queries)
        for s in range(0, kv.shape[2], chunk_size)
    ]


def evaluate(
    comp: KVCompressor, kv: Tensor, num_kv_heads: int, queries: Tensor, chunk_size: int = CHUNK_SIZE
) -> dict[str, float]:
    """Metrics of ``comp`` on the KV of a prefill (``[2, L, N + w, H*D]``) whose last ``w`` tokens'
    queries are ``queries`` ``[L, Hq, w, D]`` (see module docstring).

    Returns ``ratio`` (full / stored bytes of the compressed span), ``kept`` (fraction of token-heads
    kept), ``k_err``/``v_err`` (relative error over kept tokens) and ``attn_err``.
    """
    n_total, w = kv.shape[2], queries.shape[2]
    n = n_total - w
    if n <= 0:
        raise ValueError(f"need more tokens ({n_total}) than observation queries ({w})")
    chunks = compress_chunks(comp, kv[:, :, :n], num_kv_heads, queries, chunk_size)
    approx = concat_layers([comp.decompress(c) for c in chunks])
    exact = full_layers(kv[:, :, :n], num_kv_heads)
    sq = {"k": [0.0, 0.0], "v": [0.0, 0.0]}  # [sum err^2, sum ref^2] over all layers
    for a, e in zip(approx, exact):
        idx = a.positions.unsqueeze(-1).expand(-1, -1, e.keys.shape[-1])
        for name, got, ref in (("k", a.keys, e.keys), ("v", a.values, e.values)):
            ref = ref.gather(1, idx).float()
            sq[name][0] += float((got.float() - ref).pow(2).sum())
            sq[name][1] += float(ref.pow(2).sum())
    window = full_layers(kv[:, :, n:], num_kv_heads, start=n)
    q_pos = torch.arange(n, n_total)
    out_c = attention_output(queries, q_pos, concat_layers([approx, window]))
    out_f = attention_output(queries, q_pos, full_layers(kv, num_kv_heads))
    kept = sum(a.positions.numel() for a in approx) / (len(approx) * num_kv_heads * n)
    return {
        "ratio": sum(c.full_nbytes for c in chunks) / max(1, sum(c.nbytes for c in chunks)),
        "kept": kept,
        "k_err": math.sqrt(sq["k"][0] / max(sq["k"][1], 1e-30)),
        "v_err": math.sqrt(sq["v"][0] / max(sq["v"][1], 1e-30)),
        "attn_err": rel_err(out_c, out_f),
    }
