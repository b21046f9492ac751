"""Where a rank's layers keep each token's K and V in vLLM's paged KV cache: one strategy per device.

A :class:`KVLayout` owns nothing: it reads and writes the per-layer caches vLLM registered
(``register_kv_caches``, in layer order). Slots are vLLM's ``block_id * block_size + offset``;
``k``/``v`` are ``[layers, kv_heads, tokens, head_size]`` (``gather`` returns copies). Calls run on
whichever thread the caller orders them on (:mod:`.device_io` decides the stream); a layout holds
no lock and caches only what it derives from the tensors' shapes.

* :class:`CpuBlockLayout`, vLLM's CPU attention backend: the order inside a (block, head) tile is
  its cache-write kernel's (per ISA), probed once per layer (:mod:`.paged_layout`).
* :class:`LogicalLayout`, every other device: vLLM's logical per-layer view ``[num_blocks, kv_heads,
  block_size, 2*head_size]`` (K at ``[..., :D]``, V at ``[..., D:]``) in whichever memory order its
  ``KVCacheLayout`` chose (layer- or block-outermost, heads inside or outside tokens). Plain 4-D
  advanced indexing works on any strided view, so no order is assumed. Where all layers are views
  of one allocation at a constant distance (vLLM's one backing buffer with a layer stride), they
  are indexed as one ``[L, B, H, N, 2D]`` strided view: one gather or scatter per chunk for every
  layer; otherwise one per layer. Kernel blocks smaller than vLLM's block are addressed by
  ``slot // kernel_block`` (the view's own ``N``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from . import paged_layout as pl

Tensor = torch.Tensor


class KVLayout(ABC):
    """Token-major K/V of slots out of, and into, one rank's paged caches (module docstring)."""

    def __init__(self, layers: list[Tensor]) -> None:
        if not layers:
            raise ValueError("KV layout: no KV cache layers")
        self.layers = layers
        self.device = layers[0].device
        self.dtype = layers[0].dtype
        self.kv_heads, self.head_size = layers[0].shape[1], layers[0].shape[3] // 2

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def width(self) -> int:
        """``kv_heads * head_size``: the last dimension of a stored full chunk."""
        return self.kv_heads * self.head_size

    @abstractmethod
    def gather(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """K, V of the tokens at ``slots``, ``[layers, kv_heads, T, head_size]`` each (copies)."""

    @abstractmethod
    def scatter(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write ``k``/``v`` ``[layers, kv_heads, T, head_size]`` into the tokens at ``slots``."""


class CpuBlockLayout(KVLayout):
    """vLLM's CPU backend: each layer's tile order probed from its ISA's cache-write op. The ISA is
    set on the attention layers after the caches are registered, hence ``isas`` is asked on first
    use."""

    def __init__(self, layers: list[Tensor], isas: Callable[[], list[str | None]]) -> None:
        super().__init__(layers)
        self._isas = isas
        self._tiles: list[pl.BlockLayout] | None = None

    def _tiles_now(self) -> list[pl.BlockLayout]:
        if self._tiles is None:
            isas = self._isas()
            if any(isa is None for isa in isas):
                raise RuntimeError("CPU KV layout: an attention layer has no 'isa' (not vLLM's CPU backend)")
            self._tiles = [pl.layout_for(kv, isa) for kv, isa in zip(self.layers, isas)]
        return self._tiles

    def gather(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        ks, vs = zip(*(pl.gather(kv, t, slots) for kv, t in zip(self.layers, self._tiles_now())))
        return torch.stack(ks), torch.stack(vs)

    def scatter(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        for li, (kv, t) in enumerate(zip(self.layers, self._tiles_now())):
            pl.scatter(kv, t, slots, k[li], v[li])


class LogicalLayout(KVLayout):
    """vLLM's logical ``[B, H, N, 2D]`` view per layer, any memory order (module docstring)."""

    def __init__(self, layers: list[Tensor]) -> None:
        super().__init__(layers)
        self.groups = stacked_layers(layers)  # [L_g, B, H, N, 2D] each, covering the layers in order

    @property
    def shared(self) -> bool:
        """True where one strided view spans every layer (one index op per chunk)."""
        return len(self.groups) == 1 and self.num_layers > 1

    def _index(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        slots = slots_to(slots, self.device)
        n = self.layers[0].shape[2]  # the kernel block: vLLM's block or a divisor of it
        return slots // n, slots % n

    def gather(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        blk, off = self._index(slots)
        # Advanced indices split by a slice go first: [T, L_g, H, 2D] per group.
        kv = torch.cat([g[:, blk, :, off] for g in self.groups], dim=1).permute(1, 2, 0, 3)
        d = self.head_size
        return kv[..., :d], kv[..., d:]

    def scatter(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        blk, off = self._index(slots)
        kv = torch.cat([k, v], dim=-1).to(self.device, self.dtype).permute(2, 0, 1, 3)  # [T, L, H, 2D]
        first = 0
        for g in self.groups:
            g[:, blk, :, off] = kv[:, first:first + g.shape[0]]
            first += g.shape[0]


def slots_to(slots: Tensor, device: torch.device) -> Tensor:
    """``slots`` (host) as int64 on ``device``. On CUDA through pinned memory, non-blocking: a copy
    from pageable memory would make the host wait for the stream it is enqueued on (vLLM's compute
    stream when a save or a draft step reads the cache), a device slot set is ready in stream order."""
    slots = slots.to(torch.long)
    if torch.device(device).type == "cuda" and slots.device.type == "cpu":
        return slots.pin_memory().to(device, non_blocking=True)
    return slots.to(device)


def stacked_layers(layers: list[Tensor]) -> list[Tensor]:
    """``layers`` as ``[L, B, H, N, 2D]`` strided views: one where every layer is the same view of
    one storage at a constant element distance from the previous (vLLM's layer stride), else one
    per layer."""
    first = layers[0]
    el = first.element_size()
    ptrs = [t.data_ptr() for t in layers]
    steps = {b - a for a, b in zip(ptrs, ptrs[1:])}
    same = all(t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype
               and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in layers)
    if len(layers) > 1 and same and len(steps) == 1:
        step = steps.pop()
        if step > 0 and step % el == 0:
            return [first.as_strided((len(layers), *first.shape), (step // el, *first.stride()),
                                     first.storage_offset())]
    return [t.unsqueeze(0) for t in layers]


def layout_for(layers: list[Tensor], isas: Callable[[], list[str | None]]) -> KVLayout:
    """The strategy for caches on ``layers[0]``'s device: the probed CPU tiles on a CPU, vLLM's logical
    view elsewhere."""
    return CpuBlockLayout(layers, isas) if layers[0].device.type == "cpu" else LogicalLayout(layers)
