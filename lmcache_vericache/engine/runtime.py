"""A compact forward for Llama-family Hugging Face models over caches of this package.

It reuses the HF module's weights (no copy) but runs its own loop, so that:

* K/V live in preallocated per-layer buffers written in place (no per-step concatenation);
  rolling back a rejected draft is just moving a length back;
* positions are explicit (a draft cache holds an evicted prefix, so buffer index != position);
* one forward takes a flat batch of *segments*, each a run of tokens of one request over one
  cache (nano-vllm style): linear layers see all tokens together, attention runs per segment.
  A batch can therefore mix 1-token draft steps of some requests with the verify blocks of others
  (staggering) in the same pass;
* attention needs no materialized mask: a 1-token step attends to the whole cache; a block of n
  tokens attends to the cache before it (flash kernel, with log-sum-exp) and causally to itself
  (a small n x n product), and the two parts are merged by log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclass
class KVCache:
    """K/V of one request, per layer ``[num_kv_heads, capacity, head_dim]``.

    Layer ``l`` holds ``base[l]`` leading entries (a compressed prefix in a draft cache; 0 in a
    full cache) followed by ``n`` suffix entries shared by all layers. New tokens are written at
    ``base[l] + n``; truncating means lowering ``n``.
    """

    k: Tensor  # [layers, H, cap, D]
    v: Tensor
    base: list[int] = field(default_factory=list)
    n: int = 0

    @classmethod
    def empty(cls, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> KVCache:
        shape = (layers, heads, capacity, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   [0] * layers, 0)

    def clone(self) -> KVCache:
        """An independent copy (own buffers, same base and length)."""
        return KVCache(self.k.clone(), self.v.clone(), list(self.base), self.n)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def length(self, layer: int) -> int:
        return self.base[layer] + self.n

    def suffix(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Suffix entries ``[start, stop)`` of every layer: ``[layers, H, stop-start, D]`` each."""
        if len(set(self.base)) == 1:
            b = self.base[0]
            return self.k[:, :, b + start:b + stop], self.v[:, :, b + start:b + stop]
        ks = torch.stack([self.k[li, :, b + start:b + stop] for li, b in enumerate(self.base)])
        vs = torch.stack([self.v[li, :, b + start:b + stop] for li, b in enumerate(self.base)])
        return ks, vs

    def write_suffix(self, start: int, k: Tensor, v: Tensor) -> None:
        """Overwrite suffix entries from ``start`` with ``k``/``v`` ``[layers, H, t, D]``."""
        t = k.shape[2]
        for li, b in enumerate(self.base):
            self.k[li, :, b + start:b + start + t] = k[li]
            self.v[li, :, b + start:b + start + t] = v[li]

    def to_2ltd(self, start: int, stop: int) -> Tensor:
        """Entries ``[start, stop)`` (base must be 0) in LMCache's ``KV_2LTD`` layout."""
        return kv_to_2ltd(self.k[:, :, start:stop], self.v[:, :, start:stop])

    def load_2ltd(self, start: int, kv: Tensor) -> None:
        """Write a ``KV_2LTD`` chunk at entries ``start...`` (base must be 0)."""
        _, layers, t, hd = kv.shape
        heads = self.k.shape[1]
        src = kv.view(2, layers, t, heads, hd // heads).transpose(2, 3)
        self.k[:, :, start:start + t].copy_(src[0], non_blocking=True)
        self.v[:, :, start:start + t].copy_(src[1], non_blocking=True)


def kv_to_2ltd(k: Tensor, v: Tensor) -> Tensor:
    """K, V ``[layers, H, T, D]`` each in LMCache's ``KV_2LTD`` layout ``[2, layers, T, H*D]``."""
    layers, heads, t, d = k.shape
    return torch.stack([k, v]).permute(0, 1, 3, 2, 4).reshape(2, layers, t, heads * d)


@dataclass
class Segment:
    """``n`` consecutive tokens of one request, attending over ``cache`` (written in place)."""

    cache: KVCache
    n: int


def _flash_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Unmasked attention with its log-sum-exp; q ``[H, m, D]``, k/v ``[H, S, D]``."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], scale=scale)[:2]
        return out[0], lse[0].float()
    s = (q @ k.transpose(-1, -2)).float() * scale
    lse = s.logsumexp(-1)
    return ((s - lse[..., None]).exp().to(v.dtype) @ v), lse


def attend(q: Tensor, k: Tensor, v: Tensor, n: int, scale: float) -> Tensor:
    """Attention of the last ``n`` entries' queries ``q [n, Hq, D]`` over ``k``/``v`` ``[Hkv, S+n, D]``
    (causal within the block). Returns ``[n, Hq*D]``."""
    hkv, total, d = k.shape
    g = q.shape[1] // hkv
    qh = q.view(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, n, D]: query head = kv_head*g + j
    if n == 1:
        # A single new token sees every cached entry: no mask at all, fused kernel, GQA groups as rows.
        out = F.scaled_dot_product_attention(qh.reshape(1, hkv, g, d), k[None], v[None], scale=scale)
        return out.reshape(1, hkv * g * d)
    past = total - n
    kb, vb = k[:, past:], v[:, past:]
    s = (qh @ kb[:, None].transpose(-1, -2)).float() * scale  # [Hkv, g, n, n]
    s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    lse_b = s.logsumexp(-1)
    out = (s - lse_b[..., None]).exp().to(vb.dtype) @ vb[:, None]  # [Hkv, g, n, D]
    if past:
        op, lse_p = _flash_lse(qh.reshape(hkv, g * n, d), k[:, :past], v[:, :past], scale)
        op, lse_p = op.view(hkv, g, n, d), lse_p.view(hkv, g, n)
        m = torch.maximum(lse_p, lse_b)
        wp, wb = (lse_p - m).exp(), (lse_b - m).exp()
        out = ((op.float() * wp[..., None] + out.float() * wb[..., None]) / (wp + wb)[..., None]).to(v.dtype)
    return out.permute(2, 0, 1, 3).reshape(n, hkv * g * d)


class Runtime:
    """Forward of a Llama-family ``*ForCausalLM`` (Llama, SmolLM2, Mistral, Qwen2/3) over :class:`KVCache`."""

    def __init__(self, model: torch.nn.Module):
        cfg = model.config
        self.model = model
        self.body = model.model
        self.layers = list(self.body.layers)
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.layers[0].self_attn.scaling
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.vocab_size = cfg.vocab_size
        self.eos_ids = _eos_ids(cfg)
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            # A sliding window changes which entries a query may see; not supported (yet).
            if cfg.sliding_window < getattr(cfg, "max_position_embeddings", 0):
                raise ValueError("models with sliding-window attention are not supported by the engine")

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache.empty(self.num_layers, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, segments: list[Segment],
                rows: Tensor | None = None, capture_q: int = 0) -> tuple[Tensor, Tensor | None]:
        """Run ``tokens`` (flat ``[N]``, segments back to back) at ``positions`` ``[N]``.

        Appends each segment's K/V to its cache (``cache.n += n``). Returns float32 logits of
        ``rows`` (default: all) and, if ``capture_q``, the post-RoPE queries of the last
        ``capture_q`` tokens ``[layers, Hq, capture_q, D]`` (observation window for eviction).
        """
        total = sum(s.n for s in segments)
        if tokens.shape != (total,) or positions.shape != (total,):
            raise ValueError(f"tokens/positions must be [{total}], got {tuple(tokens.shape)}/{tuple(positions.shape)}")
        for s in segments:
            if s.n <= 0:
                raise ValueError("empty segment")
            if max(s.cache.base) + s.cache.n + s.n > s.cache.capacity:
                raise ValueError(f"cache full: capacity {s.cache.capacity}, need {max(s.cache.base) + s.cache.n + s.n}")
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        x = self.body.embed_tokens(tokens)
        cos, sin = self.body.rotary_emb(x, positions[None])
        cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, D]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        captured = []
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(total, hq, d)
            k = attn.k_proj(h).view(total, hkv, d)
            v = attn.v_proj(h).view(total, hkv, d)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if capture_q:
                captured.append(q[-capture_q:].transpose(0, 1))
            outs, off = [], 0
            for seg in segments:
                c, n = seg.cache, seg.n
                at = c.length(li)
                c.k[li, :, at:at + n] = k[off:off + n].transpose(0, 1)
                c.v[li, :, at:at + n] = v[off:off + n].transpose(0, 1)
                outs.append(attend(q[off:off + n], c.k[li, :, :at + n], c.v[li, :, :at + n], n, self.scale))
                off += n
            x = x + attn.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for seg in segments:
            seg.cache.n += seg.n
        if rows is not None:
            x = x[rows.to(self.device)]
        logits = self.model.lm_head(self.body.norm(x)).float()
        return logits, (torch.stack(captured) if capture_q else None)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _eos_ids(cfg) -> set[int]:
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
