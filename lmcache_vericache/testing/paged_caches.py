"""Paged KV caches as vLLM's GPU workers allocate them, on any device (the CPU in tests), and the
attention backends' own reading of them: the oracle of the connector's layout strategies."""

from __future__ import annotations

import torch


def vllm_caches(layout, *, layers: int, heads: int, head_size: int, block_size: int, num_blocks: int,
                kernel_block: int | None = None, dtype: torch.dtype = torch.float32, seed: int = 0,
                device: str = "cpu") -> list[torch.Tensor]:
    """One model's per-layer ``[B, H, N, 2D]`` caches in ``layout`` (a ``KVCacheLayout``) from vLLM's
    ``allocate_kv_cache`` over one buffer, filled with random values."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, layout)
    tensor = KVCacheTensor(size=spec.page_size_bytes * num_blocks * layers, layers=names,
                           layer_stride=layer_stride, block_stride=block_stride)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    kv = allocate_kv_cache(config, torch.device(device), layout, None if kernel_block is None else [kernel_block])
    caches = [kv[n] for n in names]
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(dtype))
    return caches


def backend_kv(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[H, T, D]`` of ``slots`` as vLLM's attention backends read a layer's cache
    (FlashAttention's ``kv_cache.transpose(1, 2).split(head_size, -1)``)."""
    d = cache.shape[3] // 2
    key_cache, value_cache = cache.transpose(1, 2).split(d, dim=-1)  # [blocks, block, heads, D]
    n = cache.shape[2]
    blk, off = slots // n, slots % n
    return key_cache[blk, off].transpose(0, 1), value_cache[blk, off].transpose(0, 1)
