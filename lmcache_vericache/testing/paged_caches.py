"""Paged KV caches as vLLM's GPU workers allocate them, on any device (the CPU in tests), and the
attention backends' own reading of them: the oracle of the connector's layout strategies.

:func:`layout_caches` builds them without vLLM (a GPU check machine has none), for each of vLLM's
six physical layouts (:data:`LAYOUTS`) with kernel-block splitting; :func:`vllm_caches` asks vLLM's
own ``allocate_kv_cache``, and a test holds the two equal (shape, strides, offset) for every layout."""

from __future__ import annotations

import torch

#: vLLM's ``KVCacheLayout`` members: the physical order of the logical axes ``[L, B, H, N, C]``.
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def _strides(shape: tuple[int, ...], order: tuple[int, ...], fixed: tuple = (None,) * 5) -> list[int]:
    """Element strides of the logical axes laid out in ``order`` (innermost last), ``fixed`` kept."""
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or step
        step = strides[dim] * shape[dim]
    return strides


def splittable(layout: str) -> bool:
    """Whether vLLM can split a block of ``layout`` into kernel blocks (L, then B, outermost: a
    block of a layer is one dense page)."""
    return LAYOUTS[layout][:2] == (0, 1)


def layout_caches(layout: str, *, layers: int, heads: int, head_size: int, block_size: int, num_blocks: int,
                  kernel_block: int | None = None, dtype: torch.dtype = torch.float32, seed: int | None = 0,
                  device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, 2D]`` views of one buffer, as vLLM 0.32's ``allocate_kv_cache`` lays
    out ``layout`` (a :data:`LAYOUTS` name): a block of ``block_size`` tokens, or ``block_size /
    kernel_block`` kernel blocks of it (then ``B`` and ``N`` count kernel blocks); random values
    from ``seed`` (``None``: zeros). No vLLM needed."""
    order = LAYOUTS[layout]
    width = 2 * head_size * dtype.itemsize  # C in bytes: K then V of a token and head
    layer_stride, block_stride, *_ = _strides((layers, num_blocks, heads, block_size, width), order)
    kb = kernel_block or block_size
    if block_size % kb:
        raise ValueError(f"kernel block {kb} must divide the block size {block_size}")
    ratio = block_size // kb
    if ratio > 1:
        if block_stride != heads * block_size * width:
            raise ValueError(f"layout {layout} does not keep a block as one dense page: it cannot be split")
        block_stride //= ratio
    shape = (layers, num_blocks * ratio, heads, kb, width)
    strides = _strides(shape, order, (layer_stride, block_stride, None, None, None))
    buf = torch.zeros(layers * num_blocks * heads * block_size * width, dtype=torch.int8, device=device)
    view = torch.as_strided(buf, shape, strides)
    caches = [view[li].view(dtype) for li in range(layers)]
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for c in caches:
            c.copy_(torch.randn(c.shape, generator=g).to(dtype))
    return caches


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
