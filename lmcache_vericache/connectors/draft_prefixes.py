"""How the proposer's draft caches hold their compressed prefix, per chunk source, and what that costs.

A draft cache's prefix is either *dense* (the chunks decompressed into the cache's buffers: any
method, read at the model dtype's bytes) or *chunked* (the chunks as stored, in one
:class:`~..engine.chunk_prefix.ChunkArena` per format, read in registers by the Triton kernels:
int8, int4, KIVI, TurboQuant). ``triton_draft``: ``True`` chunked (refused at start-up where the
kernels cannot read the proposer's own chunks), ``False`` dense, ``None`` chunked on CUDA where they
can. The chunks come from the KV connector's store where there is one (its compressor and chunk
size), else from the proposer's own options; a store's format the kernels cannot read is drafted
dense (said once in the log).

Ownership: one :class:`DraftPrefixes` per proposer, used from vLLM's worker thread (``propose``);
its arenas charge their growth to the proposer's :class:`~.draft_budget.DraftBudget` through
``charge`` and live as long as the proposer."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..compressors import KVCompressor
from ..engine.cache import KVCache
from ..engine.chunk_prefix import ChunkArena, ChunkPrefix, kernel_format
from ..engine.runtime import Runtime
from .worker_context import ChunkSource

logger = logging.getLogger(__name__)


class DraftPrefixes:
    """Draft-cache prefixes of one proposer (see the module docstring)."""

    def __init__(self, rt: Runtime, compressor: KVCompressor, chunk_size: int, triton_draft: bool | None,
                 charge: Callable[[int, int], bool]):
        self.rt, self.compressor, self.chunk_size = rt, compressor, chunk_size
        self.triton_draft, self._charge = triton_draft, charge
        # Keyed by id(compressor): compressors are unhashable dataclasses, and each lives as long as we do.
        self._arenas: dict[int, ChunkArena | None] = {}
        self._ratios: dict[int, float] = {}

    def check(self) -> None:
        """``ValueError`` naming why, where ``triton_draft`` is on and the kernels cannot read the
        proposer's own chunks (at start-up, rather than drafting dense silently)."""
        if self.triton_draft:
            rt = self.rt
            kernel_format(self.compressor, rt.num_kv_heads, self.chunk_size, rt.head_dim, rt.dtype)

    def chunking(self, source: ChunkSource | None) -> tuple[KVCompressor, int]:
        """The compressor and chunk size of draft prefixes: the KV connector's store's, else ours."""
        return (source.store.compressor, source.chunk_size) if source else (self.compressor, self.chunk_size)

    def arena(self, source: ChunkSource | None) -> ChunkArena | None:
        """The arena of ``source``'s chunks (``None``: dense draft caches), made on first use."""
        compressor, c = self.chunking(source)
        key = id(compressor)
        if key not in self._arenas:
            want, rt, arena = self.triton_draft, self.rt, None
            if want or (want is None and rt.device.type == "cuda"):
                try:
                    fmt = kernel_format(compressor, rt.num_kv_heads, c, rt.head_dim, rt.dtype)
                    arena = ChunkArena(fmt, rt.num_layers, rt.device, charge=self._charge)
                except ValueError as e:
                    if want:
                        logger.warning("triton_draft: the %s chunks of the KV connector's store are drafted "
                                       "over decompressed copies: %s", compressor.name, e)
            self._arenas[key] = arena
        return self._arenas[key]

    def new_cache(self, source: ChunkSource | None) -> KVCache:
        """An empty draft cache for chunks of ``source`` (chunked where its arena exists)."""
        cache = self.rt.new_cache(0)
        if (arena := self.arena(source)) is not None:
            cache.packed = ChunkPrefix(arena)
        return cache

    def kept_ratio(self, source: ChunkSource | None) -> float:
        """Share of a chunk's full bytes a draft cache holds for it: for a dense prefix its
        decompressed entries (a quantizer keeps all of them), for a chunked one its stored bytes.
        Measured once per compressor on a random chunk."""
        compressor, c = self.chunking(source)
        key = id(compressor)
        if key not in self._ratios:
            rt = self.rt
            probe = torch.randn(2, rt.num_layers, c, rt.num_kv_heads * rt.head_dim).to(rt.dtype)
            ckv = compressor.compress(probe, rt.num_kv_heads)
            if self.arena(source) is not None:
                self._ratios[key] = ckv.nbytes / ckv.full_nbytes
            else:
                layers = compressor.decompress(ckv)
                self._ratios[key] = sum(layer.keys.shape[1] for layer in layers) / (rt.num_layers * c)
        return self._ratios[key]
