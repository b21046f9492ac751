"""vLLM-on-CPU's fused MP objects, token-major and back.

LMCache's MP server hands an adapter vLLM-on-CPU's KV as one plane per chunk, ``[L, T, 2W]``
(``W`` = KV heads x head size). Its per-layer fused transfer copies each paged block whole: row
``b * BS + r``, columns ``h * 2D .. (h + 1) * 2D`` of a layer's plane hold bytes ``r * 2D ..
(r + 1) * 2D`` of block ``b``'s tile of head ``h``. Inside a tile, the cache-write kernel of vLLM's
attention ISA decides where token ``t``'s K or V dim ``d`` lands
(docs/host-notes.md#vllm-cpu-block-layout): ``vec`` / ``vec16`` have a closed form (:func:`vec_layout`);
``amx`` is only known by probing vLLM's own op, which the package's vLLM side does
(:mod:`lmcache_vericache.connectors.paged_layout`), not a store or an LMCache server: planes tiled
that way are stored as they come.

:func:`token_major` turns such a plane into the store's ``[2, L, T, W]`` chunk (compressible, what
a drafter reads), :func:`tile_into` writes a chunk back into a plane; the two are inverse
permutations, so a full chunk round-trips bit for bit whatever the tiling.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

#: vLLM-on-CPU's fused K/V plane ``[L, T, 2W]`` (LMCache ``kv_size == 1``) stored as it comes: rows
#: are paged blocks tiled in vLLM's own order, not tokens (docs/host-notes.md#vllm-cpu-block-layout).
LAYOUT_VLLM_CPU_FUSED = "vllm_cpu_fused"
#: ``vllm_cpu_tiling`` values: a vLLM CPU attention ISA, ``auto`` (vLLM's own choice on this host)
#: or ``none`` (planes stored as they come, full-only: no drafting from them).
TILINGS = ("auto", "vec", "vec16", "none")


@dataclass(frozen=True)
class BlockLayout:
    """``src[part, t, d]``: offset inside a (block, head) tile of K (part 0) / V (part 1) of
    in-block token ``t``, dim ``d``."""

    src: torch.Tensor  # [2, block_size, head_size] int64

    @property
    def block_size(self) -> int:
        return self.src.shape[1]

    @property
    def head_size(self) -> int:
        return self.src.shape[2]


def vec_layout(block_size: int, head_size: int) -> BlockLayout:
    """Closed form of vLLM's ``vec``/``vec16`` CPU kernels: K transposed, then V token-major."""
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_size)[None, :]
    k = d * block_size + t
    v = block_size * head_size + t * head_size + d
    return BlockLayout(torch.stack([k, v]))


def vllm_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The ISA vLLM-on-CPU 0.32 picks for its attention on this host (its ``_get_attn_isa`` on x86:
    ``vec``, ``vec16`` or ``amx``); ``none`` on another architecture (its tiles are not known here)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "none"
    if head_size % 32 and head_size % 16 == 0:
        return "vec16"
    if dtype == torch.bfloat16 and block_size % 32 == 0 and torch.cpu._is_amx_tile_supported():
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def check_tiling(tiling: object, block_size: object, where: str = "L2 adapter_params") -> None:
    """``ValueError`` naming ``vllm_cpu_tiling`` / ``vllm_cpu_block_size`` where either is invalid."""
    if tiling not in TILINGS:
        raise ValueError(f"{where}: vllm_cpu_tiling must be one of {TILINGS}, got {tiling!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{where}: vllm_cpu_block_size must be an int >= 1, got {block_size!r}")


def block_layout(isa: str, block_size: int, head_size: int) -> BlockLayout | None:
    """The tile layout of ISA ``isa`` (:func:`isa_of` resolves a ``vllm_cpu_tiling``); ``None`` where
    planes are stored as they come (``none``; ``amx`` or another architecture's ISA: not known
    without vLLM's probe)."""
    return vec_layout(block_size, head_size) if isa in ("vec", "vec16") else None


def isa_of(tiling: str, dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The ISA name ``tiling`` stands for (``auto`` resolved)."""
    return vllm_isa(dtype, block_size, head_size) if tiling == "auto" else tiling


def layout_name(isa: str, block_size: int) -> str:
    """Key-space layout of fused planes stored token-major after undoing the tiles of ISA ``isa``
    over ``block_size``-token blocks: what the adapter stores them under and the proposer beside the
    server asks for (both facts, so a server configured with another tiling never serves its chunks
    to an engine that tiles otherwise)."""
    return f"{LAYOUT_VLLM_CPU_FUSED}.{isa}.b{block_size}"


def qualified(layout: str, kv_rank: int = 0, group: int = 0, salt: str | None = None) -> str:
    """``layout`` with an MP ``ObjectKey``'s qualifiers (rank, object group, cache salt), as the
    adapter's key spaces name them."""
    return layout + "".join(f"/{n}.{v}" for n, v in (("rank", kv_rank), ("group", group), ("salt", salt)) if v)


def kv_rank(world_size: int = 1, rank: int = 0) -> int:
    """The ``kv_rank`` LMCache's MP server gives a worker's objects (``ObjectKey.ComputeKVRank`` of
    LMCache 0.5.6: world size, global rank, local world size, local rank, a byte each; a worker is
    its own local world here): 16,777,472 for the one worker of TP = PP = 1."""
    return (world_size << 24) | (rank << 16) | (world_size << 8) | rank


def token_major(plane: torch.Tensor, layout: BlockLayout, heads: int) -> torch.Tensor:
    """The ``[2, L, T, W]`` token-major chunk of a fused plane ``[L, T, 2W]`` (a copy)."""
    L, T, two_w = plane.shape
    bs, d = layout.block_size, layout.head_size
    nb = T // bs
    tiles = plane.reshape(L, nb, bs, heads, 2 * d).permute(0, 1, 3, 2, 4).reshape(L, nb, heads, bs * 2 * d)
    kv = tiles[..., layout.src.reshape(-1)].view(L, nb, heads, 2, bs, d)
    return kv.permute(3, 0, 1, 4, 2, 5).reshape(2, L, T, heads * d)


def tile_into(chunk: torch.Tensor, layout: BlockLayout, heads: int, plane: torch.Tensor) -> None:
    """Write the token-major ``chunk`` ``[2, L, T, W]`` into the fused ``plane`` ``[L, T, 2W]``."""
    _, L, T, _ = chunk.shape
    bs, d = layout.block_size, layout.head_size
    nb = T // bs
    logical = chunk.reshape(2, L, nb, bs, heads, d).permute(1, 2, 4, 0, 3, 5).reshape(L, nb, heads, 2 * bs * d)
    tiles = torch.empty_like(logical)
    tiles[..., layout.src.reshape(-1)] = logical
    plane.view(L, nb, bs, heads, 2 * d).copy_(tiles.view(L, nb, heads, bs, 2 * d).permute(0, 1, 3, 2, 4))


def fits(shape: torch.Size | tuple, block_size: int, heads: int) -> bool:
    """Whether a fused plane of ``shape`` is whole blocks of ``heads`` heads."""
    L, T, two_w = (int(s) for s in shape)
    return T % block_size == 0 and two_w % (2 * heads) == 0
