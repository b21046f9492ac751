"""A draft cache's compressed prefix kept as its stored chunks, attended by the Triton kernels.

On a GPU a draft step is bound by the bytes it reads. A draft cache whose prefix is the
decompressed chunks reads the model dtype's 2 bytes per element; kept as stored (int8, int4, KIVI,
TurboQuant: :mod:`..compressors.formats`) it reads 1/2 byte or less, dequantized in registers by
:mod:`.triton_attention`. The kernels take one pool of chunk slots per layer and a chunk table per
request (like vLLM's block table), so every request of a step attends in one call per layer:

* :class:`ChunkArena` holds one format's chunks for all of an engine's (or a proposer's) draft
  caches: a chunk put once occupies slot ``s`` of every layer's :class:`~.triton_attention.ChunkPool`.
* :class:`ChunkPrefix` is one draft cache's prefix: its chunks' slots, in token order. It is a
  :class:`~.cache.KVCache`'s ``packed`` prefix; the cache's dense buffers then hold only the exact
  suffix, merged with the kernel's output by log-sum-exp (:mod:`.runtime`).

Contract of :class:`ChunkArena`:

* **Ownership:** the arena belongs to the engine or proposer that made it. Prefixes hold slots by
  reference count: a stored chunk never changes, so a cloned prefix shares its slots; a slot is
  free again when the last prefix holding it is released or garbage-collected.
* **Bytes:** the device memory it holds is its capacity. It grows by a quarter (at least 8 slots;
  only what is asked for where the quarter is refused) when a put finds no free slot, the growth
  charged first to ``charge(old_bytes, new_bytes)`` (the proposer's
  :class:`~..connectors.draft_budget.DraftBudget`, which admits it while old and new fit together:
  the copy needs both, and CUDA's caching allocator keeps the old blocks), and never shrinks:
  freed slots are reused, so the proposer's budget keeps its capacity charged. Under a budget an
  arena therefore reaches about half of it (old + new at the last growth).
* **Input:** a chunk's buffers are checked against the format before they are copied (a shared
  store's chunk of another size would make the kernel read out of bounds).
* **Threading:** one thread (the engine's, or vLLM's worker thread in ``propose``); owners release a
  dropped prefix explicitly (:meth:`ChunkPrefix.release`), the finalizer is the fallback.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from ..compressors import CompressedKV, KVCompressor
from ..compressors.formats import KVFormat, Side, describe
from . import triton_attention
from .triton_attention import ChunkPool

Tensor = torch.Tensor
_serials = itertools.count()  # prefix identities for the table cache (never reused, unlike id())


def kernel_format(compressor: KVCompressor, heads: int, chunk_size: int, head_dim: int, dtype: torch.dtype) -> KVFormat:
    """The format of ``compressor``'s chunks if the Triton kernels read it here; ``ValueError``
    saying why not (Triton absent, a method without a kernel format, a head size or code width the
    kernels do not take)."""
    if not triton_attention.available():
        raise ValueError("the Triton kernels need triton and a CUDA device (or TRITON_INTERPRET=1)")
    fmt = describe(compressor, heads, chunk_size, head_dim, dtype)
    triton_attention.check_format(fmt)
    return fmt


def _on(side: Side, device: torch.device) -> Side:
    move = {name: getattr(side, name).to(device) for name in ("codebook", "rotation") if getattr(side, name) is not None}
    return dataclasses.replace(side, **move)


class ChunkArena:
    """Chunks of format ``fmt`` for ``layers`` layers on ``device`` (see the module docstring)."""

    def __init__(self, fmt: KVFormat, layers: int, device: torch.device | str,
                 charge: Callable[[int, int], bool] | None = None):
        self.device = torch.device(device)
        # The codebook and rotation (TurboQuant) on the device once, not copied from the host per call.
        self.fmt = dataclasses.replace(fmt, k=_on(fmt.k, self.device), v=_on(fmt.v, self.device))
        self.pools = [ChunkPool.empty(self.fmt, 0, self.device) for _ in range(layers)]  # the kernels read pool.fmt
        self.refs: list[int] = []
        self._free: list[int] = []  # popped from the end (new slots lowest first)
        self._charge = charge
        self._table: tuple[tuple, tuple[Tensor, Tensor]] | None = None  # the last chunk table built

    @property
    def capacity(self) -> int:
        return len(self.refs)

    @property
    def slot_bytes(self) -> int:
        """Bytes one chunk takes (all layers, K and V)."""
        return sum(p.slot_bytes for p in self.pools)

    @property
    def nbytes(self) -> int:
        return self.capacity * self.slot_bytes

    def ensure(self, n: int) -> bool:
        """Room for ``n`` more chunks: grows (charged first) where fewer slots are free. ``False``
        where the charge is refused (nothing changed)."""
        short = n - len(self._free)
        if short <= 0:
            return True
        cap = self.capacity
        new = cap + max(short, cap // 4, 8)
        if self._charge is not None and not self._charge(cap * self.slot_bytes, new * self.slot_bytes):
            new = cap + short  # the quarter refused: just what is asked for
            if not self._charge(cap * self.slot_bytes, new * self.slot_bytes):
                return False
        for pool in self.pools:
            pool.grow(new)
        self.refs += [0] * (new - cap)
        self._free = list(range(new - 1, cap - 1, -1)) + self._free
        return True

    def put(self, ckv: CompressedKV) -> int:
        """Copy chunk ``ckv`` into a free slot of every layer; returns the slot, held once.
        ``ValueError`` for a chunk not of this format (nothing held), ``MemoryError`` where the
        arena cannot grow (:meth:`ensure` first to know before)."""
        fmt = self.fmt
        got = (ckv.method, ckv.num_kv_heads, ckv.num_tokens, ckv.head_dim, ckv.num_layers)
        want = (fmt.method, fmt.heads, fmt.tokens, fmt.head_dim, len(self.pools))
        if got != want:
            raise ValueError(f"chunk (method, heads, tokens, head_dim, layers) {got} is not this arena's {want}")
        if not self.ensure(1):
            raise MemoryError(f"the draft budget refused {self.slot_bytes} more bytes for a chunk slot")
        slot = self._free[-1]
        for layer, pool in enumerate(self.pools):
            pool.write(slot, fmt.buffers(ckv, layer), f"layer {layer} of a {ckv.method} chunk")
        self._free.pop()
        self.refs[slot] = 1
        return slot

    def hold(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.refs[s] += 1

    def release(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.refs[s] -= 1
            if self.refs[s] == 0:
                self._free.append(s)

    def table(self, prefixes: Sequence[ChunkPrefix | None]) -> tuple[Tensor, Tensor]:
        """Chunk table (int32 ``[B, max_chunks]``) and prefix lengths (int32 ``[B]``) of ``prefixes``
        on the device (``None``: no prefix). A forward asks once per layer with the same prefixes:
        the last table is kept."""
        key = tuple((p.serial, len(p.slots)) if p is not None else (-1, 0) for p in prefixes)
        if self._table is None or self._table[0] != key:
            width = max([1] + [len(p.slots) for p in prefixes if p is not None])
            table = torch.zeros(len(prefixes), width, dtype=torch.int32)
            for j, p in enumerate(prefixes):
                if p is not None and p.slots:
                    table[j, :len(p.slots)] = torch.tensor(p.slots, dtype=torch.int32)
            lengths = torch.tensor([p.length(0) if p is not None else 0 for p in prefixes], dtype=torch.int32)
            self._table = key, (table.to(self.device, non_blocking=True), lengths.to(self.device, non_blocking=True))
        return self._table[1]


class ChunkPrefix:
    """One draft cache's prefix: the slots of its chunks in ``arena``, in token order."""

    takes_suffix: ClassVar[bool] = False  # the DraftPrefix protocol (engine/draft_cache.py)
    batched: ClassVar[bool] = True
    arena_backed: ClassVar[bool] = True

    def __init__(self, arena: ChunkArena, slots: Sequence[int] = ()):
        self.arena, self.slots = arena, list(slots)
        self.serial = next(_serials)
        arena.hold(self.slots)
        # The slots come back when this prefix goes, however it goes (a dropped draft cache).
        self._release = weakref.finalize(self, arena.release, self.slots)

    def append(self, ckvs: Sequence[CompressedKV]) -> None:
        """Put ``ckvs`` (the next chunks, in order) into the arena and onto this prefix: all of them,
        or none (a chunk refused by :meth:`ChunkArena.put` gives back the slots of those before it)."""
        if not self.arena.ensure(len(ckvs)):
            raise MemoryError(f"the draft budget refused {len(ckvs)} chunk slots")
        put: list[int] = []
        try:
            for ckv in ckvs:
                put.append(self.arena.put(ckv))
        except BaseException:
            self.arena.release(put)
            raise
        self.slots += put

    def extend(self, ckvs: Sequence[CompressedKV], compressor: object = None, full: object = None) -> None:
        self.append(ckvs)

    @staticmethod
    def attention(jobs: list, scale: float, suffixes: list | None = None) -> list[tuple[Tensor, Tensor]]:
        return attention(jobs, scale)

    def release(self) -> None:
        """Give the slots back now (also done when the prefix is garbage-collected); the prefix is
        then empty and may take chunks again."""
        self._release()
        self.slots = []
        self._release = weakref.finalize(self, self.arena.release, self.slots)

    def length(self, layer: int) -> int:
        return len(self.slots) * self.arena.fmt.tokens

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.arena.slot_bytes

    def clone(self) -> ChunkPrefix:
        """Another prefix over the same slots (held once more: chunks never change)."""
        return ChunkPrefix(self.arena, self.slots)


def attend(q: Tensor, prefixes: Sequence[ChunkPrefix | None], layer: int, scale: float,
           suffix: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Attention of query rows ``q [B, Hkv, M, D]`` over each request's prefix (``None``: none),
    all of one arena: ``(out [B, Hkv, M, D] float32, lse [B, Hkv, M])``, lse ``-inf`` without a prefix;
    with ``suffix`` (``(out, lse)`` of the same rows over the exact entries), attention over both,
    merged in the kernels' reduce launch."""
    arena = next(p.arena for p in prefixes if p is not None)
    if any(p is not None and p.arena is not arena for p in prefixes):
        raise ValueError("prefixes of one attention call must share one arena")
    table, lengths = arena.table(prefixes)
    return triton_attention.attention(q, arena.pools[layer], table, lengths, scale, check=False, suffix=suffix)


def attention(jobs: list[tuple[Tensor, ChunkPrefix, int]], scale: float) -> list[tuple[Tensor, Tensor]]:
    """Per job ``(rows [Hkv, m, D], prefix, layer)`` its prefix part ``(out [Hkv, m, D], lse [Hkv, m])``
    for :func:`~.runtime.attend`'s merge: one kernel call per arena and layer for every job."""
    res: list[tuple[Tensor, Tensor] | None] = [None] * len(jobs)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (_, prefix, layer) in enumerate(jobs):
        groups.setdefault((id(prefix.arena), layer), []).append(i)
    for (_, layer), idx in groups.items():
        m = max(jobs[i][0].shape[1] for i in idx)
        q = torch.stack([torch.nn.functional.pad(jobs[i][0], (0, 0, 0, m - jobs[i][0].shape[1])) for i in idx])
        out, lse = attend(q, [jobs[i][1] for i in idx], layer, scale)
        for j, i in enumerate(idx):
            rows = jobs[i][0].shape[1]
            res[i] = out[j, :, :rows], lse[j, :, :rows]
    return res  # type: ignore[return-value]


def warm_up(arena: ChunkArena, max_chunks: int, rows: Sequence[int] = (1, 32, 64)) -> int:
    """Launch once every kernel variant a draft over ``arena`` can need, so that Triton compiles them
    here (the proposer's ``load_model``) rather than inside a vLLM step: one per split count
    :func:`~.triton_attention.default_splits` may choose (powers of 2 up to ``max_chunks``, the
    widest table) and per row block (``rows``: a draft step's GQA group, and the load drafter's
    longer blocks), each with and without a suffix (the reduce kernel's variants: the batched
    runtime merges the exact suffix there). Returns the decode kernel's variants launched."""
    fmt, dev = arena.fmt, arena.device
    pool = ChunkPool.empty(fmt, 1, dev)
    splits = [1 << i for i in range(max(1, max_chunks).bit_length())]
    lengths = torch.zeros(1, dtype=torch.int32, device=dev)
    for m in rows:
        q = torch.zeros(1, fmt.heads, m, fmt.head_dim, dtype=fmt.dtype, device=dev)
        for s in splits:
            table = torch.zeros(1, s, dtype=torch.int32, device=dev)
            for suffix in (None, (q.float(), torch.zeros(q.shape[:3], device=dev))):
                triton_attention.attention(q, pool, table, lengths, 1.0, splits=s, check=False, suffix=suffix)
    return len(rows) * len(splits)
