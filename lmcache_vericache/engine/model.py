"""The model interface the runtime drives: the pieces of a Llama-family decoder, one call each.

:class:`~lmcache_vericache.engine.runtime.Runtime` owns the loop, the KV caches and attention; a
:class:`DecoderModel` only computes the per-token parts with the host's own modules and weights.
Adapters: :class:`~lmcache_vericache.engine.hf_model.HfModel` (Hugging Face ``*ForCausalLM``) and
:class:`~lmcache_vericache.connectors.vllm_model.VllmModel` (vLLM's module, inside its worker).

Shapes: ``N`` tokens in a flat batch, hidden states ``[N, hidden]``, q ``[N, num_heads, head_dim]``,
k/v ``[N, num_kv_heads, head_dim]``. Layer methods take the layer index first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

Tensor = torch.Tensor


class DecoderModel(ABC):
    """A decoder-only transformer with pre-norm blocks, RoPE and GQA attention (Llama, Qwen2/3, Mistral)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # attention softmax scale
    dtype: torch.dtype
    device: torch.device
    vocab_size: int
    eos_ids: set[int]

    def _bind(self, model: torch.nn.Module) -> Any:
        """What every adapter reads the same way from a ``*ForCausalLM``: full attention checked,
        ``body`` (the decoder stack), ``layers``, ``num_layers``, ``vocab_size``, ``eos_ids``.
        Returns the model's config."""
        cfg = model.config
        check_full_attention(cfg)
        self.body = model.model
        self.layers = list(self.body.layers)
        self.num_layers = len(self.layers)
        self.vocab_size = cfg.vocab_size
        self.eos_ids = eos_ids(cfg)
        return cfg

    @abstractmethod
    def embed(self, tokens: Tensor) -> Tensor: ...

    @abstractmethod
    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin ``[N, head_dim]`` in the model dtype, for rotate-half (neox) RoPE."""

    @abstractmethod
    def input_norm(self, layer: int, x: Tensor) -> Tensor: ...

    @abstractmethod
    def qkv(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of the normed hidden states, per head, before RoPE."""

    def qk_norm(self, layer: int, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head norm of q and k before RoPE (Qwen3); identity for models without one."""
        return q, k

    @abstractmethod
    def o_proj(self, layer: int, x: Tensor) -> Tensor:
        """Output projection of the attention output ``[N, num_heads*head_dim]``."""

    @abstractmethod
    def post_attention_norm(self, layer: int, x: Tensor) -> Tensor: ...

    @abstractmethod
    def mlp(self, layer: int, x: Tensor) -> Tensor: ...

    @abstractmethod
    def final_norm(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def lm_head(self, x: Tensor) -> Tensor:
        """Logits ``[N, vocab_size]`` (any float dtype; the runtime returns float32)."""


def check_full_attention(cfg: Any) -> None:
    """Reject sliding-window attention: it changes which entries a query may see, and every cache
    here holds (and every attention reads) the whole context."""
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and window < getattr(cfg, "max_position_embeddings", 0):
        raise ValueError("models with sliding-window attention are not supported by the engine")


def eos_ids(cfg: Any) -> set[int]:
    """End-of-sequence ids of an HF-style config (``eos_token_id``: none, one or a list)."""
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
