"""The draft cache, one room: what a request's compressed prefix is, for the engine, the vLLM proposer
and the load-window drafter alike.

A draft cache is a :class:`~.cache.KVCache` whose prefix is the request's compressed chunks and whose
suffix is the exact KV of the positions after them. How the prefix is kept is its *kind*
(:data:`DRAFT_KINDS`), chosen once per runtime, compressor and chunk size by :meth:`DraftCaches.choose`:

* ``dense``: the chunks decompressed into the cache's own buffers (any method; a draft step reads
  the model dtype's bytes for every kept entry);
* ``int8``: the int8 codes as stored (:class:`~.int8_attention.Int8Prefix`), attended by the CPU
  int8 kernel with the exact suffix in the same call; auto on a CPU where the compressor stores
  int8 codes and the kernel builds;
* ``codebook``: TurboQuant's codes (:class:`~.codebook_attention.CodebookPrefix`), the same CPU
  kernel; auto on a CPU with AVX512-VNNI (elsewhere its scalar decoding is slower than a dense copy);
* ``chunked``: the stored chunks in one :class:`~.chunk_prefix.ChunkArena` (int8, int4, KIVI,
  TurboQuant), attended by the Triton kernels in one call per layer for a batch; auto on CUDA;
* ``certified``: PoissonComp chunks with their full KV for KVFetch (:mod:`.kvfetch`; the engine's
  ``verkv`` modes only, never auto).

Every kind but ``dense`` is a :class:`DraftPrefix` in ``KVCache.packed``; callers call its methods
(and :meth:`DraftCaches.append`, :meth:`DraftCaches.nbytes`) instead of testing types.
Ownership: a :class:`DraftCaches` belongs to one engine or proposer and is used from its thread; a
``chunked`` one's arena charges its growth through ``charge`` and lives as long as its owner.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..compressors import CompressedKV, KVCompressor
from ..compressors.formats import describe
from . import int8_attention
from .cache import KVCache, append_chunks
from .chunk_prefix import ChunkArena, ChunkPrefix, kernel_format, warm_up
from .codebook_attention import Codebook, CodebookPrefix
from .int8_attention import Int8Prefix
from .kvfetch import CertifiedPrefix

Tensor = torch.Tensor
DRAFT_KINDS = ("dense", "int8", "codebook", "chunked", "certified")


@runtime_checkable
class DraftPrefix(Protocol):
    """A draft cache's compressed prefix kept in a form of its own and attended by its own code.

    * ``extend(ckvs, compressor, full)``: append consecutive chunks (in token order; ``full``: their
      ``KV_2LTD`` full KV, needed by ``certified`` only); all of them or, raising, none;
    * ``length(layer)``: prefix entries of a layer; ``nbytes``: bytes a draft step reads of it;
    * ``clone()``: an independent prefix (chunks never change, so an arena's slots may be shared);
    * ``release()``: give back what it holds now (arena slots); it may take chunks again after;
    * ``attention(jobs, scale, suffixes)`` (static): for jobs ``(q [Hkv, m, D], prefix, layer)`` of
      this kind, ``(out, lse)`` each; ``takes_suffix``: the kernel also attends each job's exact
      suffix in the same call (else the runtime merges it); ``batched``: prefixes of one arena are
      attended by the runtime's padded batch path; ``arena_backed``: its bytes live in an arena
      charged on its own (not per cache).
    """

    takes_suffix: ClassVar[bool]
    batched: ClassVar[bool]
    arena_backed: ClassVar[bool]

    def extend(self, ckvs: Sequence[CompressedKV], compressor: KVCompressor,
               full: Sequence[Tensor] | None = None) -> None: ...

    def length(self, layer: int) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def clone(self) -> DraftPrefix: ...

    def release(self) -> None: ...


@dataclass
class DraftCaches:
    """Draft caches of one kind for one runtime, compressor and chunk size (the module docstring)."""

    rt: Any  # engine.runtime.Runtime (not imported: the runtime imports the prefix kinds)
    compressor: KVCompressor
    chunk_size: int
    kind: str = "dense"
    codebook: Codebook | None = None
    arena: ChunkArena | None = None
    kvfetch: dict | None = None
    _ratio: float | None = field(default=None, init=False, repr=False)

    @classmethod
    def choose(cls, rt: Any, compressor: KVCompressor, chunk_size: int, *, int8: bool | None = None,
               codebook: bool | None = None, triton: bool | None = None, kvfetch: dict | None = None,
               charge: Callable[[int, int], bool] | None = None) -> DraftCaches:
        """The kind for these options (``True``: that kind or a ``ValueError`` naming the option and
        why not; ``None``: where it applies and pays; ``False``: never). Asked for the Triton kernels,
        the CPU kernels' auto stands aside. ``kvfetch`` (KVFetch options) makes ``certified`` caches."""
        if kvfetch is not None:
            for name, wanted in (("triton_draft", triton), ("codebook_draft", codebook), ("int8_draft", int8)):
                if wanted:
                    raise ValueError(f"{name}: a KVFetch drafter (kvfetch_draft or mode 'verkv') attends its own prefix")
            return cls(rt, compressor, chunk_size, "certified", kvfetch=dict(kvfetch))
        make = lambda kind, **kw: cls(rt, compressor, chunk_size, kind, **kw)  # noqa: E731
        int8_on = _int8_ok(rt, compressor, False if triton and int8 is None else int8)
        book = _codebook(rt, compressor, chunk_size, False if triton and codebook is None else codebook)
        if int8_on:
            return make("int8")
        if book is not None:
            return make("codebook", codebook=book)
        fmt = _triton_format(rt, compressor, chunk_size, triton)
        if fmt is not None:
            return make("chunked", arena=ChunkArena(fmt, rt.num_layers, rt.device, charge=charge))
        return make("dense")

    @property
    def packed(self) -> bool:
        """Whether the prefix is kept in its own form (every kind but ``dense``)."""
        return self.kind != "dense"

    def new(self, capacity: int = 0) -> KVCache:
        """An empty draft cache (``capacity`` dense entries: the suffix, and a dense prefix)."""
        rt = self.rt
        cache = rt.new_cache(capacity)
        if self.kind == "int8":
            cache.packed = Int8Prefix.empty(rt.num_layers, rt.num_kv_heads, rt.head_dim)
        elif self.kind == "codebook":
            cache.packed = CodebookPrefix(self.codebook, rt.num_layers, rt.num_kv_heads)
        elif self.kind == "chunked":
            cache.packed = ChunkPrefix(self.arena)
        elif self.kind == "certified":
            cache.packed = CertifiedPrefix(rt.num_layers, **self.kvfetch, device=rt.device)
        return cache

    def append(self, cache: KVCache, ckvs: Sequence[CompressedKV], room: int = 0,
               full: Sequence[Tensor] | None = None) -> None:
        """:func:`~.cache.append_chunks` with this compressor (the exact suffix is dropped)."""
        append_chunks(cache, ckvs, self.compressor, room=room, full=full)

    def entries(self, ckvs: Sequence[CompressedKV]) -> list[int]:
        """Dense entries each layer of a cache gains from ``ckvs`` (0 where the prefix is packed)."""
        if self.packed or not ckvs:
            return [0] * self.rt.num_layers
        return [sum(g) for g in zip(*map(chunk_entries, ckvs))]

    def need(self, cache: KVCache, ckvs: Sequence[CompressedKV], exact: int) -> int:
        """The one sizing rule: dense entries ``cache`` must hold once ``ckvs`` are appended and
        ``exact`` entries (suffix, draft room) follow its longest layer's prefix."""
        return max(b + g for b, g in zip(cache.base, self.entries(ckvs))) + exact

    def nbytes(self, cache: KVCache | None = None, entries: int | None = None) -> int:
        """The one byte count of a draft cache's memory: its dense buffers (``entries`` of them, default
        its capacity) plus its packed prefix, unless an arena charged that on its own."""
        n = entries if entries is not None else cache.capacity
        dense = n * self.rt.kv_bytes_per_token()
        p = cache.packed if cache is not None else None
        return dense + (p.nbytes if p is not None and not type(p).arena_backed else 0)

    def copying(self, cache: KVCache, entries: int) -> int:
        """Bytes of ``cache`` that exist twice while it grows to ``entries`` dense entries and takes
        more chunks: its dense buffers where they are reallocated (``KVCache.reserve``), and one layer
        of a packed prefix (int8 and codebook prefixes grow a layer at a time)."""
        dense = cache.capacity * self.rt.kv_bytes_per_token() if entries > cache.capacity else 0
        p = cache.packed
        packed = math.ceil(p.nbytes / self.rt.num_layers) if p is not None and not type(p).arena_backed else 0
        return dense + packed

    def read_ratio(self) -> float:
        """Share of a chunk's full bytes a draft step reads for it, measured once on a random chunk:
        its stored bytes where packed, its decompressed entries (a quantizer keeps all) where dense."""
        if self._ratio is None:
            rt, c = self.rt, self.chunk_size
            probe = torch.randn(2, rt.num_layers, c, rt.num_kv_heads * rt.head_dim).to(rt.dtype)
            ckv = self.compressor.compress(probe, rt.num_kv_heads)
            if self.kind == "chunked":  # an arena slot per chunk (not probed through the shared arena)
                self._ratio = self.arena.slot_bytes / ckv.full_nbytes
            elif self.kind in ("int8", "codebook"):
                cache = self.new()
                self.append(cache, [ckv])
                self._ratio = cache.packed.nbytes / ckv.full_nbytes
            else:
                self._ratio = sum(chunk_entries(ckv)) / (rt.num_layers * c)
        return self._ratio

    def warm_up(self, max_tokens: int) -> int:
        """Compile, now, the kernel variants drafts of up to ``max_tokens`` tokens may launch (the
        ``chunked`` kind on CUDA: Triton compiles a variant on its first launch); 0 elsewhere."""
        if self.kind != "chunked" or self.rt.device.type != "cuda":
            return 0
        return warm_up(self.arena, math.ceil(max_tokens / self.chunk_size))

    def kept_per_chunk(self) -> int:
        """Dense entries the longest layer of a cache keeps per chunk (0 where packed): what ``auto``
        budgets size by (an evictor's own count where it knows it, else every token)."""
        if self.packed:
            return 0
        rt, c = self.rt, self.chunk_size
        evictor = self.compressor.evictor()
        counts = evictor.kept_counts((2, rt.num_layers, c, rt.num_kv_heads * rt.head_dim), rt.num_kv_heads) if evictor else None
        return max(counts) if counts else c

    def auto_bytes(self, requests: int, max_len: int, exact: int) -> int:
        """Bytes ``requests`` draft caches of ``max_len`` tokens take: their dense entries (kept per
        chunk plus ``exact``, in whole chunks) and their packed prefixes at :meth:`read_ratio`, plus
        what one of them holds twice while it grows (:meth:`copying`), so that the last request's
        growth is not refused when every cache is near ``max_len``."""
        c = self.chunk_size
        dense = math.ceil((math.ceil(max_len * self.kept_per_chunk() / c) + exact) / c) * c
        packed = math.ceil(max_len * self.read_ratio()) if self.packed else 0
        growing = dense + math.ceil(packed / self.rt.num_layers)
        return (requests * (dense + packed) + growing) * self.rt.kv_bytes_per_token()


def chunk_entries(ckv: CompressedKV) -> list[int]:
    """Entries each layer of ``ckv`` decompresses to: its kept positions, else every token."""
    return [int(b["pos"].shape[1]) if "pos" in b else ckv.num_tokens for b in ckv.buffers_by_layer()]


def _int8_ok(rt: Any, compressor: KVCompressor, wanted: bool | None) -> bool:
    """Whether draft caches keep an int8 prefix as codes: where the compressor stores int8 codes, on
    a CPU, and the kernel builds for this head size and dtype."""
    if wanted is False:
        return False
    if not compressor.stores_int8_codes or rt.device.type != "cpu":
        if wanted:
            raise ValueError(f"int8_draft needs a compressor that stores int8 codes on CPU, not "
                             f"{compressor.name} on {rt.device.type}")
        return False
    if (not int8_attention.available() or rt.head_dim not in int8_attention.HEAD_DIMS
            or rt.dtype not in int8_attention.DTYPES):
        if wanted:
            raise ValueError(f"int8_draft: the int8 attention kernel could not be built (see the log) or "
                             f"does not take head size {rt.head_dim} / {rt.dtype} (it takes "
                             f"{int8_attention.HEAD_DIMS} / {int8_attention.DTYPES})")
        return False
    return True


def _codebook(rt: Any, compressor: KVCompressor, chunk_size: int, wanted: bool | None) -> Codebook | None:
    """The codebook where draft caches keep TurboQuant's prefix as codes (CPU kernel), else ``None``."""
    if wanted is False:
        return None
    try:
        if rt.device.type != "cpu":
            raise ValueError(f"the codebook kernel runs on CPU, not {rt.device.type}")
        if not int8_attention.available() or rt.dtype not in int8_attention.DTYPES:
            raise ValueError(f"the int8 attention kernel could not be built (see the log) or does not take "
                             f"{rt.dtype} (it takes {int8_attention.DTYPES})")
        book = Codebook.of(describe(compressor, rt.num_kv_heads, chunk_size, rt.head_dim, rt.dtype))
    except ValueError as e:
        if wanted:
            raise ValueError(f"codebook_draft: {e}") from None
        return None
    return book if wanted or int8_attention.vnni() else None


def _triton_format(rt: Any, compressor: KVCompressor, chunk_size: int, wanted: bool | None):
    """The chunks' format where the Triton kernels read them (auto: on CUDA), else ``None``."""
    if wanted is False or (wanted is None and rt.device.type != "cuda"):
        return None
    try:
        return kernel_format(compressor, rt.num_kv_heads, chunk_size, rt.head_dim, rt.dtype)
    except ValueError as e:
        if wanted:
            raise ValueError(f"triton_draft: {e}") from None
        return None
