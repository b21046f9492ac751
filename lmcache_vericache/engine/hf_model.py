"""The model interface over a Hugging Face Llama-family ``*ForCausalLM`` (Llama, SmolLM2, Mistral,
Qwen2, Qwen3): the HF modules and their weights are used as they are (shared, not copied); their
``nn.Linear`` layers run through :func:`~.linear.linear` (the package's few-rows kernel on a CPU)."""

from __future__ import annotations

import torch

from . import token_ops
from .linear import apply
from .model import DecoderModel

Tensor = torch.Tensor


class HfModel(DecoderModel):
    """:class:`DecoderModel` over ``model.model.layers[i].self_attn.{q,k,v,o}_proj`` and friends."""

    def __init__(self, model: torch.nn.Module):
        cfg = self._bind(model)
        self.hf = model
        # the gated MLP of every Llama-family model, down(act(gate(x)) * up(x)), computed here with
        # engine/linear.py's layers; any other MLP is called as it is (decided once, not per step)
        self._gated_mlp = [all(hasattr(layer.mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
                           for layer in self.layers]
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.layers[0].self_attn.scaling
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        self._probe = torch.empty(0, dtype=self.dtype, device=self.device)  # HF rotary reads dtype/device off x

    def embed(self, tokens: Tensor) -> Tensor:
        return self.body.embed_tokens(tokens)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.body.rotary_emb(self._probe, positions[None])
        return cos[0], sin[0]

    def input_norm(self, layer: int, x: Tensor) -> Tensor:
        return token_ops.rms_norm(self.layers[layer].input_layernorm, x)

    def qkv(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        attn, n, d = self.layers[layer].self_attn, h.shape[0], self.head_dim
        return (apply(attn.q_proj, h).view(n, self.num_heads, d), apply(attn.k_proj, h).view(n, self.num_kv_heads, d),
                apply(attn.v_proj, h).view(n, self.num_kv_heads, d))

    def qk_norm(self, layer: int, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        attn = self.layers[layer].self_attn
        if hasattr(attn, "q_norm"):  # Qwen3
            return attn.q_norm(q), attn.k_norm(k)
        return q, k

    def o_proj(self, layer: int, x: Tensor) -> Tensor:
        return apply(self.layers[layer].self_attn.o_proj, x)

    def post_attention_norm(self, layer: int, x: Tensor) -> Tensor:
        return token_ops.rms_norm(self.layers[layer].post_attention_layernorm, x)

    def mlp(self, layer: int, x: Tensor) -> Tensor:
        mlp = self.layers[layer].mlp
        if not self._gated_mlp[layer]:
            return mlp(x)
        return apply(mlp.down_proj, mlp.act_fn(apply(mlp.gate_proj, x)) * apply(mlp.up_proj, x))

    def final_norm(self, x: Tensor) -> Tensor:
        return token_ops.rms_norm(self.body.norm, x)

    def lm_head(self, x: Tensor) -> Tensor:
        return apply(self.hf.lm_head, x)
