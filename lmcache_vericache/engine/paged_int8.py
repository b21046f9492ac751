"""The package's ``int8`` chunks in vLLM's paged ``int8_per_token_head`` KV format.

vLLM's Triton ``unified_attention`` with ``kv_cache_dtype="int8_per_token_head"`` reads int8 codes
from the paged cache (``[blocks, block_size, kv_heads, head_dim]`` per K and V) and one float32
scale per (token, head) from scale caches ``[blocks, block_size, kv_heads]``, applied to the scores
and the softmax weights. That is the format ``compressors.int8`` stores (absmax / 127 per token and
head, fp16 scales): a stored chunk is copied in as it is, its scales widened to fp32, and vLLM's
own kernel attends over it with no dequantized copy. This module only lays bytes out; it does not
import vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor
Int8Layer = tuple[Tensor, Tensor, Tensor, Tensor]  # kq [H, n, D] int8, ks [H, n(, 1)], vq, vs


def write(layer: Int8Layer, slots: Tensor, key_cache: Tensor, value_cache: Tensor, k_scales: Tensor,
          v_scales: Tensor) -> None:
    """Write one layer's codes of ``n`` tokens (``compressor.int8_layers(ckv)[layer]``) at vLLM slots
    ``slots`` ([n] int64, ``block * block_size + offset``) of the caches (views are fine)."""
    kq, ks, vq, vs = layer
    h, n, d = kq.shape
    if kq.dtype != torch.int8 or vq.dtype != torch.int8:
        raise ValueError(f"codes must be int8, got {kq.dtype} / {vq.dtype}")
    if tuple(key_cache.shape[2:]) != (h, d) or key_cache.dtype != torch.int8:
        raise ValueError(f"key_cache must be int8 [blocks, block_size, {h}, {d}], got "
                         f"{key_cache.dtype} {tuple(key_cache.shape)}")
    if slots.shape != (n,):
        raise ValueError(f"slots must be [{n}], got {tuple(slots.shape)}")
    block_size = key_cache.shape[1]
    blk, off = slots // block_size, slots % block_size
    dev = key_cache.device
    blk, off = blk.to(dev), off.to(dev)
    key_cache[blk, off] = kq.transpose(0, 1).to(dev)
    value_cache[blk, off] = vq.transpose(0, 1).to(dev)
    k_scales[blk, off] = ks.reshape(h, n).T.to(dev, torch.float32)
    v_scales[blk, off] = vs.reshape(h, n).T.to(dev, torch.float32)


@dataclass
class PagedInt8:
    """Fresh paged caches holding some requests' int8 prefixes, blocks allocated in order: what
    ``unified_attention`` takes (``block_table`` int32 ``[B, max_blocks]``, ``seq_lens`` int32 ``[B]``)."""

    key_cache: Tensor
    value_cache: Tensor
    k_scales: Tensor
    v_scales: Tensor
    block_table: Tensor
    seq_lens: Tensor

    @classmethod
    def of(cls, requests: Sequence[Sequence[Int8Layer]], block_size: int = 16,
           device: torch.device | str = "cpu") -> PagedInt8:
        """``requests``: per request, its chunks' int8 layers in token order."""
        if not requests or not any(requests):
            raise ValueError("PagedInt8 needs at least one request with a chunk")
        h, _, d = next(c for r in requests for c in r)[0].shape
        lens = [sum(c[0].shape[1] for c in r) for r in requests]
        nblocks = [-(-n // block_size) for n in lens]
        total, width = sum(nblocks), max(1, max(nblocks))
        key_cache = torch.zeros(total, block_size, h, d, dtype=torch.int8, device=device)
        value_cache, k_scales = torch.zeros_like(key_cache), torch.zeros(total, block_size, h, device=device)
        v_scales = torch.zeros_like(k_scales)
        table = torch.zeros(len(requests), width, dtype=torch.int32)
        first = 0
        for i, (chunks, nb) in enumerate(zip(requests, nblocks)):
            table[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
            pos = first * block_size
            for layer in chunks:
                n = layer[0].shape[1]
                write(layer, torch.arange(pos, pos + n), key_cache, value_cache, k_scales, v_scales)
                pos += n
            first += nb
        return cls(key_cache, value_cache, k_scales, v_scales, table.to(device),
                   torch.tensor(lens, dtype=torch.int32, device=device))
