"""The engine runtime over vLLM's own Llama-family module: no second copy of the weights.

vLLM on CPU packs every linear weight into a oneDNN handle and frees the plain tensor
(``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so its weights cannot be viewed as HF
``q_proj``/``k_proj``/... tensors. Instead this module gives :class:`~lmcache_vericache.engine.runtime.Runtime`
the HF-shaped surface it reads, backed by vLLM's modules: the fused ``qkv_proj`` runs once and is
split, ``o_proj`` drops vLLM's bias tuple, RoPE comes from vLLM's own ``cos_sin_cache`` and logits
from ``compute_logits``. Everything else (norms, MLP, embedding) is vLLM's module called as is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..engine.runtime import KVCache, Runtime, Segment

Tensor = torch.Tensor


class _Attention:
    """HF attention surface over vLLM's ``LlamaAttention``; one fused QKV GEMM per call of ``q_proj``."""

    def __init__(self, attn: torch.nn.Module):
        self.attn = attn
        self.scaling = attn.scaling
        self._sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        self._h: Tensor | None = None
        self._kv: tuple[Tensor, Tensor] | None = None

    def q_proj(self, h: Tensor) -> Tensor:
        q, k, v = self.attn.qkv_proj(h)[0].split(self._sizes, dim=-1)
        self._h, self._kv = h, (k, v)
        return q

    def _take(self, h: Tensor, i: int) -> Tensor:
        if h is not self._h or self._kv is None:  # the runtime must ask for q first, same input
            raise RuntimeError("k_proj/v_proj called without q_proj on the same input")
        return self._kv[i]

    def k_proj(self, h: Tensor) -> Tensor:
        return self._take(h, 0)

    def v_proj(self, h: Tensor) -> Tensor:
        return self._take(h, 1)

    def o_proj(self, x: Tensor) -> Tensor:
        return self.attn.o_proj(x)[0]


class _Layer:
    def __init__(self, layer: torch.nn.Module):
        self.self_attn = _Attention(layer.self_attn)
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp


class _Rope:
    """HF ``rotary_emb(x, positions[None]) -> (cos, sin)`` from vLLM's ``cos_sin_cache``
    (``[max_pos, rot_dim]``, cos half then sin half; neox style = HF's rotate_half)."""

    def __init__(self, rope: torch.nn.Module, head_dim: int):
        if not getattr(rope, "is_neox_style", True) or rope.cos_sin_cache.shape[-1] != head_dim:
            raise NotImplementedError("only full-width neox-style RoPE (Llama family) is supported")
        self.cache = rope.cos_sin_cache

    def __call__(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.cache[positions].chunk(2, dim=-1)
        return torch.cat([cos, cos], -1).to(x.dtype), torch.cat([sin, sin], -1).to(x.dtype)


class _Body:
    def __init__(self, body: torch.nn.Module, head_dim: int):
        self.embed_tokens = body.embed_tokens
        self.layers = [_Layer(lay) for lay in body.layers]
        self.norm = body.norm
        self.rotary_emb = _Rope(body.layers[0].self_attn.rotary_emb, head_dim)


class VllmModelView:
    """What :class:`Runtime` reads of an HF ``*ForCausalLM``, backed by vLLM's module ``model``."""

    def __init__(self, model: torch.nn.Module):
        self.vllm_model = model
        self.config = model.config
        attn = model.model.layers[0].self_attn
        self.model = _Body(model.model, attn.head_dim)

    def lm_head(self, x: Tensor) -> Tensor:
        return self.vllm_model.compute_logits(x)[..., : self.config.vocab_size]

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.vllm_model.model.embed_tokens.parameters()


def runtime_for(model: torch.nn.Module) -> Runtime:
    """A :class:`Runtime` over vLLM's Llama-family module (shares its weights)."""
    return Runtime(VllmModelView(model))  # type: ignore[arg-type]


def runtime_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> Tensor:
    """Float32 logits ``[T, vocab]`` of ``token_ids`` through the runtime over ``model`` (for
    ``LLM.apply_model`` checks that the proposer's forward is the target model's)."""
    rt = runtime_for(model)
    cache: KVCache = rt.new_cache(len(token_ids))
    logits, _ = rt.forward(torch.tensor(list(token_ids)), torch.arange(len(token_ids)),
                           [Segment(cache, len(token_ids))])
    return logits.cpu()
