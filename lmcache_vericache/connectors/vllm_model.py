"""The engine's model interface over vLLM's own Llama-family module: no second copy of the weights.

vLLM on CPU packs every linear weight into a oneDNN handle and frees the plain tensor
(``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so its weights can only be used by calling
vLLM's modules. :class:`VllmModel` does that: the fused ``qkv_proj`` runs once and is split,
``o_proj``'s ``(output, bias)`` tuple is unpacked, RoPE comes from vLLM's ``cos_sin_cache`` and
logits from ``compute_logits``; norms, MLP and embedding are vLLM's modules called as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.cache import KVCache
from ..engine.model import DecoderModel
from ..engine.runtime import Runtime, Segment

Tensor = torch.Tensor


class VllmModel(DecoderModel):
    """:class:`DecoderModel` over vLLM's ``LlamaForCausalLM`` (and Qwen2/Qwen3/Mistral, same layout)."""

    def __init__(self, model: torch.nn.Module):
        self._bind(model)
        self.vllm = model
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.scaling
        self._split = [attn.q_size, attn.kv_size, attn.kv_size]
        weight = next(self.body.embed_tokens.parameters())  # linear weights may be freed (oneDNN)
        self.dtype, self.device = weight.dtype, weight.device
        rope = attn.rotary_emb
        # vLLM's cache row is [cos half | sin half]; neox style over the full head is HF's rotate_half.
        if not getattr(rope, "is_neox_style", True) or rope.cos_sin_cache.shape[-1] != self.head_dim:
            raise NotImplementedError("only full-width neox-style RoPE (Llama family) is supported")
        self._cos_sin = rope.cos_sin_cache

    def embed(self, tokens: Tensor) -> Tensor:
        return self.body.embed_tokens(tokens)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self._cos_sin[positions].chunk(2, dim=-1)
        return torch.cat([cos, cos], -1).to(self.dtype), torch.cat([sin, sin], -1).to(self.dtype)

    def input_norm(self, layer: int, x: Tensor) -> Tensor:
        return self.layers[layer].input_layernorm(x)

    def qkv(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n, d = h.shape[0], self.head_dim
        q, k, v = self.layers[layer].self_attn.qkv_proj(h)[0].split(self._split, dim=-1)
        return q.view(n, self.num_heads, d), k.view(n, self.num_kv_heads, d), v.view(n, self.num_kv_heads, d)

    def qk_norm(self, layer: int, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        attn = self.layers[layer].self_attn
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            return attn.q_norm(q), attn.k_norm(k)
        return q, k

    def o_proj(self, layer: int, x: Tensor) -> Tensor:
        return self.layers[layer].self_attn.o_proj(x)[0]

    def post_attention_norm(self, layer: int, x: Tensor) -> Tensor:
        return self.layers[layer].post_attention_layernorm(x)

    def mlp(self, layer: int, x: Tensor) -> Tensor:
        return self.layers[layer].mlp(x)

    def final_norm(self, x: Tensor) -> Tensor:
        return self.body.norm(x)

    def lm_head(self, x: Tensor) -> Tensor:
        return self.vllm.compute_logits(x)[..., :self.vocab_size]  # vLLM pads the vocabulary


def runtime_for(model: torch.nn.Module) -> Runtime:
    """A :class:`Runtime` over vLLM's Llama-family module (shares its weights)."""
    return Runtime(VllmModel(model))


def runtime_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> Tensor:
    """Float32 logits ``[T, vocab]`` of ``token_ids`` through the runtime over ``model`` (for
    ``LLM.apply_model`` checks that the proposer's forward is the target model's)."""
    rt = runtime_for(model)
    cache: KVCache = rt.new_cache(len(token_ids))
    logits, _ = rt.forward(torch.tensor(list(token_ids)), torch.arange(len(token_ids)),
                           [Segment(cache, len(token_ids))])
    return logits.cpu()
