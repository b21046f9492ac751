"""The dual-tier store: compressed chunks at once for drafting, full chunks prefetched for
verification (docs/architecture.md#the-dual-tier-store). Knows nothing of LMCache's engine classes; the adapters map it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from ..compressors import CodecError, CompressedKV, KVCompressor, from_bytes, to_bytes
from .fullchunk import CorruptChunkError, decode_full, encode_full
from .tiers.base import CapacityTier, TierError
from .tiers.memory import LRU

logger = logging.getLogger(__name__)

Tensor = torch.Tensor

# Derived keys in the capacity tier. The compressed value is written last: its presence means
# the full value was stored before it (``contains`` relies on this).
FULL_SUFFIX, COMPRESSED_SUFFIX = "/full", "/ckv"


@dataclasses.dataclass
class StoreStats:
    puts: int = 0
    put_errors: int = 0
    compressed_hits: int = 0  # hot tier or capacity tier
    compressed_misses: int = 0
    full_hits: int = 0
    full_misses: int = 0  # includes corrupt ones
    corrupt: int = 0  # full or compressed values that failed verification
    cancelled: int = 0
    bytes_written: int = 0
    bytes_read: int = 0  # from the capacity tier


class PrefetchHandle:
    """Background reads of the full chunks of ``keys``, in order. Thread-safe.

    ``wait`` blocks the calling thread; from a coroutine use ``await wait_async(...)``, which
    never blocks the event loop. A result of ``None`` is a miss: not stored, unreadable, failed
    verification (counted in the store's stats and logged) or cancelled.
    """

    def __init__(self, keys: list[str], futures: list[Future], cancelled: threading.Event, count: Any) -> None:
        self.keys = keys
        self._futures = futures
        self._cancelled = cancelled
        self._count = count

    def __len__(self) -> int:
        return len(self._futures)

    def ready(self, i: int) -> bool:
        return self._futures[i].done()

    @property
    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self, i: int | None = None, timeout: float | None = None) -> Any:
        """Chunk ``i`` (``Tensor | None``), or with ``i=None`` the list of all chunks.
        Raises ``TimeoutError`` if not ready within ``timeout`` seconds."""
        if i is not None:
            return _result(self._futures[i], timeout)
        _, pending = wait_futures(self._futures, timeout)
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(self)} chunks not ready after {timeout} s")
        return [_result(f, 0) for f in self._futures]

    async def wait_async(self, i: int | None = None) -> Any:
        if i is not None:
            return await _wrap(self._futures[i])
        return list(await asyncio.gather(*(_wrap(f) for f in self._futures)))

    def cancel(self) -> None:
        """Drop reads not yet started; reads in flight finish but their chunks still arrive."""
        self._cancelled.set()
        self._count(cancelled=sum(f.cancel() for f in self._futures))


def _result(fut: Future, timeout: float | None) -> Tensor | None:
    try:
        return fut.result(timeout)
    except CancelledError:
        return None


async def _wrap(fut: Future) -> Tensor | None:
    try:
        return await asyncio.wrap_future(fut)
    except asyncio.CancelledError:
        if fut.cancelled():  # the read was cancelled, not the awaiting task
            return None
        raise


class DualTierStore:
    """Compressed chunks in a byte-bounded hot LRU (and the capacity tier), full chunks in the
    capacity tier, both checksummed.

    * Ownership: the store owns ``capacity`` (closes it) and copies what ``put`` is given; returned
      tensors and ``CompressedKV``\\ s belong to the caller and must be treated as read-only when
      they come from the hot tier (they are shared between callers).
    * Threading: every method is thread-safe. Full reads run in one pool of
      ``max_concurrent_reads`` threads shared by all prefetches (the bound is global); compressed
      chunks missing from the hot tier are fetched on a second pool of the same size, so the
      draft path never waits behind full-chunk reads.
    * Keys: a chunk ``key`` is stored in the capacity tier as ``key + "/full"`` and
      ``key + "/ckv"``; the compressed value is written second and is the commit marker that
      ``contains`` checks, so another process sharing the tier sees a chunk once both are stored.
    * A miss is ``None``: never stored, evicted, unreadable, or failed verification. Corrupt
      values are counted (``stats.corrupt``) and logged and never returned. Write failures raise
      :class:`TierError` after logging; what was stored before stays readable.
    """

    def __init__(
        self,
        compressor: KVCompressor,
        capacity: CapacityTier,
        *,
        num_kv_heads: int,
        hot_bytes: int = 1 << 30,
        max_concurrent_reads: int = 4,
    ) -> None:
        if num_kv_heads <= 0:
            raise ValueError(f"num_kv_heads must be > 0, got {num_kv_heads}")
        if max_concurrent_reads <= 0:
            raise ValueError(f"max_concurrent_reads must be > 0, got {max_concurrent_reads}")
        self.compressor, self.capacity, self.num_kv_heads = compressor, capacity, num_kv_heads
        self.max_concurrent_reads = max_concurrent_reads
        self._hot: LRU[CompressedKV] = LRU(hot_bytes)
        self._pool = ThreadPoolExecutor(max_concurrent_reads, thread_name_prefix="vericache-read")
        self._ckv_pool = ThreadPoolExecutor(max_concurrent_reads, thread_name_prefix="vericache-ckv")
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._closed = False

    # -- write path -----------------------------------------------------------------------------
    def put(
        self, key: str, full: Tensor, *, start: int = 0, queries: Tensor | None = None, compress: bool = True
    ) -> None:
        """Compress ``full`` (``[2, L, T, H*D]``), store full and compressed bytes in the capacity
        tier and keep the compressed chunk hot. Raises ``TierError`` (logged) if the capacity tier
        fails; the hot tier is then left unchanged.

        ``compress=False`` stores the full chunk only, for KV whose rows are not tokens (vLLM's
        CPU paged blocks as LMCache's MP server hands them over): a compressed copy of those
        bytes would serve no drafter and cost a compression per chunk."""
        self._check_open()
        if self.has_full(key) and (not compress or self.capacity.contains(key + COMPRESSED_SUFFIX)):
            # Keys name immutable content (chained prefix hashes): a committed chunk, ours or
            # another instance's, is never rewritten, so a failing rewrite cannot delete it.
            return
        full_blob = encode_full(full)
        if not compress:
            self._put_or_raise(key + FULL_SUFFIX, full_blob, key)
            self._count(puts=1, bytes_written=len(full_blob))
            return
        ckv_blob = to_bytes(self.compressor.compress(full, self.num_kv_heads, start=start, queries=queries))
        self._put_or_raise(key + FULL_SUFFIX, full_blob, key)
        try:
            self._put_or_raise(key + COMPRESSED_SUFFIX, ckv_blob, key)
        except TierError:
            self.capacity.delete(key + FULL_SUFFIX)  # all or nothing: no full chunk without its commit
            raise
        # Hot copy parsed from our own immutable bytes: never aliases the caller's tensor.
        self._hot.put(key, from_bytes(ckv_blob), len(ckv_blob))
        self._count(puts=1, bytes_written=len(full_blob) + len(ckv_blob))

    def _put_or_raise(self, tier_key: str, blob: bytes, key: str) -> None:
        try:
            self.capacity.put(tier_key, blob)
        except TierError as e:
            self._count(put_errors=1)
            logger.error("store put %r failed: %s", key, e)
            raise

    # -- draft path -----------------------------------------------------------------------------
    def get_compressed(self, key: str) -> CompressedKV | None:
        """The compressed chunk from the hot tier, else from the capacity tier (then kept hot)."""
        self._check_open()
        ckv = self._hot.get(key)
        if ckv is None:
            blob = self.capacity.get(key + COMPRESSED_SUFFIX)
            if blob is not None:
                self._count(bytes_read=len(blob))
                try:
                    ckv = from_bytes(blob)  # views into blob, which we own
                except CodecError as e:
                    self._count(corrupt=1)
                    logger.error("store: compressed chunk %r is corrupt, treated as a miss: %s", key, e)
                else:
                    self._hot.put(key, ckv, len(blob))
        self._count(**{"compressed_hits" if ckv is not None else "compressed_misses": 1})
        return ckv

    def get_compressed_prefix(self, keys: list[str]) -> list[CompressedKV]:
        """Compressed chunks of the longest available prefix of ``keys``. Chunks not hot are
        fetched from the capacity tier ``max_concurrent_reads`` at a time, on their own pool so
        drafting never queues behind full-chunk prefetches."""
        out: list[CompressedKV] = []
        for key in keys:
            ckv = self.get_compressed(key) if key in self._hot else None
            if ckv is None:
                break
            out.append(ckv)
        step = self.max_concurrent_reads
        for i in range(len(out), len(keys), step):
            for ckv in self._ckv_pool.map(self.get_compressed, keys[i : i + step]):
                if ckv is None:
                    return out
                out.append(ckv)
        return out

    def contains(self, key: str) -> bool:
        """Compressed chunk hot, or committed to the capacity tier, or a full-only chunk stored
        (a hint: a later read may miss)."""
        return (key in self._hot or self.capacity.contains(key + COMPRESSED_SUFFIX)
                or self.capacity.contains(key + FULL_SUFFIX))

    def has_full(self, key: str) -> bool:
        """The full chunk is in the capacity tier (what exact-KV consumers such as LMCache need;
        a hint: a later read may still miss)."""
        return self.capacity.contains(key + FULL_SUFFIX)

    # -- full path ------------------------------------------------------------------------------
    def get_full(self, key: str) -> Tensor | None:
        """The verified full chunk, read now (blocking)."""
        self._check_open()
        return self._read_full(key)

    def prefetch(self, keys: list[str]) -> PrefetchHandle:
        """Start background reads of the full chunks of ``keys`` and return at once."""
        self._check_open()
        cancelled = threading.Event()
        futures = [self._pool.submit(self._read_full, k, cancelled) for k in keys]
        return PrefetchHandle(list(keys), futures, cancelled, self._count)

    def _read_full(self, key: str, cancelled: threading.Event | None = None) -> Tensor | None:
        if cancelled is not None and cancelled.is_set():
            self._count(cancelled=1)
            return None
        try:
            blob = self.capacity.get(key + FULL_SUFFIX)
            if blob is None:
                self._count(full_misses=1)
                return None
            self._count(bytes_read=len(blob))
            t = decode_full(blob)
        except CorruptChunkError as e:
            self._count(corrupt=1, full_misses=1)
            logger.error("store: full chunk %r failed verification, treated as a miss: %s", key, e)
            return None
        except Exception:  # a background read must never die silently or raise into wait()
            self._count(full_misses=1)
            logger.exception("store: reading full chunk %r failed", key)
            return None
        self._count(full_hits=1)
        return t

    # -- misc -----------------------------------------------------------------------------------
    @property
    def stats(self) -> StoreStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DualTierStore is closed")

    def close(self) -> None:
        """Cancel pending reads, wait for those in flight, close the capacity tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ckv_pool.shutdown(wait=True, cancel_futures=True)
        self.capacity.close()
        self._hot.clear()

    def __enter__(self) -> DualTierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
