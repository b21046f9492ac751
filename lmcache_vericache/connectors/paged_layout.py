"""Token-major K/V from vLLM's CPU paged KV cache, and back.

vLLM's CPU attention backend keeps, per layer, ``(num_blocks, kv_heads, block_size, 2 * head_size)``
and views it as ``(num_blocks, kv_heads, 2 * block_size, head_size)`` split into a K half and a V
half. The element order *inside* a (block, head) tile is whatever the cache-write kernel of the
layer's ISA chooses, not "token t: K then V":

* ``vec`` / ``vec16`` (x86 AVX-512/AVX2, any float dtype): K transposed (``[head_size, block]``),
  then V token-major (``[block, head_size]``);
* ``amx`` (bf16 on AMX CPUs): both halves tiled in 16-token / 2-element VNNI groups.

Rather than hard-code each kernel's tiling, :func:`probe_layout` asks vLLM's own
``cpu_attn_reshape_and_cache`` where every (K/V, token, dim) lands, by writing index-encoded values
into one scratch block. The result (a permutation of one tile) is cached per (ISA, dtype, block,
head size); :func:`gather` and :func:`scatter` are plain index operations on it. Exact for float32,
bfloat16 and float16 caches; quantized (fp8) caches raise ``NotImplementedError``.
"""

from __future__ import annotations

import functools

import torch

from ..backends.fused_planes import BlockLayout, vec_layout  # noqa: F401  (the closed form, host-neutral)

Tensor = torch.Tensor
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DIGIT = 16  # base of the index encoding: digits 1..16 are exact in every float dtype above


@functools.cache
def probe_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> BlockLayout:
    """Where vLLM's cache-write op for ``isa`` puts each element of a tile (one scratch block)."""
    if dtype not in FLOAT_DTYPES:
        raise NotImplementedError(f"paged layout: cache dtype {dtype} is not supported (float32/bfloat16/float16 only)")
    import vllm._custom_ops as ops

    n = 2 * block_size * head_size
    logical = torch.arange(n).view(2, block_size, head_size)  # K indices then V indices
    pos = torch.zeros(n, dtype=torch.long)
    scale = 1
    while scale < n:  # one pass per base-16 digit of the logical index
        digit = (logical // scale) % _DIGIT + 1  # 1..16, never the zero of an unwritten slot
        cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        kc, vc = cache.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        key, val = (digit[p][:, None, :].to(dtype).contiguous() for p in (0, 1))
        ops.cpu_attn_reshape_and_cache(key, val, kc, vc, torch.arange(block_size), isa)
        tile = cache.view(n).to(torch.long)
        if bool((tile == 0).any()):
            raise RuntimeError(f"paged layout probe: ISA {isa!r} left part of the block unwritten")
        pos += (tile - 1) * scale
        scale *= _DIGIT
    # pos[offset] = logical index stored there; invert to offset of each logical index.
    if not torch.equal(pos.sort().values, torch.arange(n)):
        raise RuntimeError(f"paged layout probe: ISA {isa!r} tile is not a permutation")
    src = torch.empty(n, dtype=torch.long)
    src[pos] = torch.arange(n)
    return BlockLayout(src.view(2, block_size, head_size))


def layout_for(kv_cache: Tensor, isa: str) -> BlockLayout:
    """Layout of one layer's paged cache ``(num_blocks, kv_heads, block_size, 2*head_size)``."""
    _, _, block_size, two_d = kv_cache.shape
    return probe_layout(isa, kv_cache.dtype, block_size, two_d // 2)


def slots_for(block_ids: Tensor, start: int, stop: int, block_size: int) -> Tensor:
    """Slots of token positions ``[start, stop)`` of a request whose blocks are ``block_ids``."""
    p = torch.arange(start, stop)
    return block_ids.to(torch.long)[p // block_size] * block_size + p % block_size


def _index(layout: BlockLayout, slots: Tensor) -> tuple[Tensor, Tensor]:
    slots = slots.to(torch.long)
    blk, off = slots // layout.block_size, slots % layout.block_size
    return blk[None, :, None], layout.src[:, off]  # [1, T, 1], [2, T, D]


def gather(kv_cache: Tensor, layout: BlockLayout, slots: Tensor) -> tuple[Tensor, Tensor]:
    """K and V of the tokens at ``slots``, token-major ``[kv_heads, T, head_size]`` each (a copy)."""
    nb, h = kv_cache.shape[:2]
    blk, idx = _index(layout, slots)
    kv = kv_cache.view(nb, h, -1)[blk, :, idx]  # advanced indices first: [2, T, D, H]
    kv = kv.permute(0, 3, 1, 2)
    return kv[0], kv[1]


def scatter(kv_cache: Tensor, layout: BlockLayout, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Write token-major ``k``/``v`` ``[kv_heads, T, head_size]`` into the tokens at ``slots``."""
    nb, h = kv_cache.shape[:2]
    blk, idx = _index(layout, slots)
    kv_cache.view(nb, h, -1)[blk, :, idx] = torch.stack([k, v]).permute(0, 2, 3, 1).to(kv_cache.dtype)
