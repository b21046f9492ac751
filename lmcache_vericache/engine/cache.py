"""KV caches of one request and their layout.

A request has two caches of the same shape (:class:`KVCache`):

* the *full* (verify) cache holds the exact KV of every position; while a stored prefix is being
  swapped in from the store, its entries are poisoned (:func:`poison_prefix`), so a verification
  that skipped the swap cannot pass;
* the *draft* cache holds, per layer, the decompressed chunks of the compressed prefix (a different
  number of entries per layer when the compressor evicts per layer), then the exact KV of the
  positions after it (the open chunk, a window, the committed suffix). :func:`append_chunks` is the
  one way a compressed prefix gets into it, for the engine and for the vLLM proposer alike. A
  *packed* draft cache keeps its prefix in a form of its own instead (``packed``: int8 or codebook
  codes, an arena's chunks, a KVFetch prefix; :mod:`.draft_cache` says which kind when); its dense
  buffers then hold only the exact suffix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..compressors import CompressedKV, KVCompressor

if TYPE_CHECKING:
    from .draft_cache import DraftPrefix

Tensor = torch.Tensor


@dataclass
class KVCache:
    """K/V of one request, per layer ``[num_kv_heads, capacity, head_dim]``.

    Layer ``l`` holds ``base[l]`` leading entries (a compressed prefix in a draft cache; 0 in a
    full cache) followed by ``n`` suffix entries shared by all layers. New tokens are written at
    ``base[l] + n``; truncating means lowering ``n``.
    """

    k: Tensor  # [layers, H, cap, D]
    v: Tensor
    base: list[int] = field(default_factory=list)
    n: int = 0
    packed: DraftPrefix | None = None  # a prefix kept and attended in its own form (base 0; draft_cache.py)

    @classmethod
    def empty(cls, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> KVCache:
        shape = (layers, heads, capacity, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   [0] * layers, 0)

    def clone(self) -> KVCache:
        """An independent copy (own buffers, same base and length)."""
        return KVCache(self.k.clone(), self.v.clone(), list(self.base), self.n,
                       self.packed.clone() if self.packed is not None else None)

    def release(self) -> None:
        """Give back what the packed prefix holds outside this cache (arena slots), now."""
        if self.packed is not None:
            self.packed.release()

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def length(self, layer: int) -> int:
        return self.base[layer] + self.n

    @property
    def uniform(self) -> bool:
        """Every layer's suffix starts at one index (full caches, packed draft caches): one slice
        addresses it in all layers at once."""
        return len(set(self.base)) == 1

    def read_bytes(self) -> int:
        """Bytes of K/V one decode step over this cache reads (dense entries plus the int8 prefix)."""
        per_entry = 2 * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
        dense = sum(self.length(li) for li in range(len(self.base))) * per_entry
        return dense + (self.packed.nbytes if self.packed is not None else 0)

    def reserve(self, need: int, exact: bool = False) -> None:
        """Grow the buffers in place to hold ``need`` entries per layer (at least doubling, so a cache
        grown a little at a time is copied rarely; ``exact``: to ``need``, for a caller that charges
        the bytes)."""
        if need <= self.capacity:
            return
        layers, heads, cap, d = self.k.shape
        grown = KVCache.empty(layers, heads, d, need if exact else max(need, 2 * cap), self.k.dtype, self.k.device)
        grown.k[:, :, :cap], grown.v[:, :, :cap] = self.k, self.v
        self.k, self.v = grown.k, grown.v

    def suffix(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Suffix entries ``[start, stop)`` of every layer: ``[layers, H, stop-start, D]`` each."""
        if self.uniform:
            b = self.base[0]
            return self.k[:, :, b + start:b + stop], self.v[:, :, b + start:b + stop]
        ks = torch.stack([self.k[li, :, b + start:b + stop] for li, b in enumerate(self.base)])
        vs = torch.stack([self.v[li, :, b + start:b + stop] for li, b in enumerate(self.base)])
        return ks, vs

    def write_suffix(self, start: int, k: Tensor, v: Tensor) -> None:
        """Overwrite suffix entries from ``start`` with ``k``/``v`` ``[layers, H, t, D]``."""
        t = k.shape[2]
        if self.uniform:  # one copy for every layer
            b = self.base[0]
            self.k[:, :, b + start:b + start + t] = k
            self.v[:, :, b + start:b + start + t] = v
            return
        for li, b in enumerate(self.base):
            self.k[li, :, b + start:b + start + t] = k[li]
            self.v[li, :, b + start:b + start + t] = v[li]

    def to_2ltd(self, start: int, stop: int) -> Tensor:
        """Entries ``[start, stop)`` (base must be 0) in LMCache's ``KV_2LTD`` layout."""
        return kv_to_2ltd(self.k[:, :, start:stop], self.v[:, :, start:stop])

    def fits_chunk(self, kv: Tensor | None, chunk_size: int) -> bool:
        """Whether ``kv`` is a whole ``KV_2LTD`` chunk of this cache's layers, heads and dtype: what a
        full chunk read from a store must be before it is loaded (a short chunk would leave entries
        unwritten, another dtype would be converted silently)."""
        layers, heads, _, d = self.k.shape
        return kv is not None and tuple(kv.shape) == (2, layers, chunk_size, heads * d) and kv.dtype == self.k.dtype

    def load_2ltd(self, start: int, kv: Tensor) -> None:
        """Write a ``KV_2LTD`` chunk at entries ``start...`` (base must be 0)."""
        _, layers, t, hd = kv.shape
        heads = self.k.shape[1]
        src = kv.view(2, layers, t, heads, hd // heads).transpose(2, 3)
        self.k[:, :, start:start + t].copy_(src[0], non_blocking=True)
        self.v[:, :, start:start + t].copy_(src[1], non_blocking=True)


def kv_to_2ltd(k: Tensor, v: Tensor) -> Tensor:
    """K, V ``[layers, H, T, D]`` each in LMCache's ``KV_2LTD`` layout ``[2, layers, T, H*D]``."""
    layers, heads, t, d = k.shape
    return torch.stack([k, v]).permute(0, 1, 3, 2, 4).reshape(2, layers, t, heads * d)


def append_chunks(cache: KVCache, ckvs: Sequence[CompressedKV], compressor: KVCompressor, room: int = 0,
                  full: Sequence[Tensor] | None = None) -> None:
    """Decompress ``ckvs`` (consecutive chunks, in order) onto the compressed prefix of a draft cache
    and leave ``room`` free entries after the longest layer's prefix.

    The exact suffix is dropped (``n = 0``): its entries are where the prefix grows, and they are
    exact KV of positions the new chunks now cover in compressed form. The caller writes the exact
    KV of the positions past the chunks again. A packed cache's prefix takes the chunks in its own
    form (``DraftPrefix.extend``; a certified one with each chunk's full KV ``full``, ``KV_2LTD``).
    """
    if cache.packed is not None:  # kept in its own form (engine/draft_cache.py): it appends them itself
        cache.packed.extend(ckvs, compressor, full)
        cache.reserve(room)
        cache.n = 0
        return
    per_layer: list[list[tuple[Tensor, Tensor]]] = [[] for _ in cache.base]
    for ckv in ckvs:
        for li, lkv in enumerate(compressor.decompress(ckv)):
            per_layer[li].append((lkv.keys, lkv.values))
    grown = [sum(k.shape[1] for k, _ in chunks) for chunks in per_layer]
    cache.reserve(max(b + g for b, g in zip(cache.base, grown)) + room)
    for li, chunks in enumerate(per_layer):
        if chunks:
            b, g = cache.base[li], grown[li]
            cache.k[li, :, b:b + g] = torch.cat([k for k, _ in chunks], dim=1)
            cache.v[li, :, b:b + g] = torch.cat([v for _, v in chunks], dim=1)
            cache.base[li] = b + g
    cache.n = 0


def poison_prefix(cache: KVCache, n: int) -> None:
    """Fill the first ``n`` entries of a full cache with NaN: they are in the store, and a
    verification over them before the swap brought them back must not pass."""
    cache.k[:, :, :n] = float("nan")
    cache.v[:, :, :n] = float("nan")
