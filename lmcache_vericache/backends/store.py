"""The dual-tier store: compressed chunks at once for drafting, full chunks prefetched for
verification (docs/architecture.md#the-dual-tier-store). Knows nothing of LMCache's engine classes; the adapters map it.
Its prefetch handle is in :mod:`.prefetch`, the authentication of stored values in :mod:`.mac`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import threading
import weakref
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .. import compressors
from .. import metrics as M
from ..compressors import CodecError, CompressedKV, KVCompressor, from_bytes, to_bytes
from ..workers import torch_serial
from . import mac
from .fullchunk import Buffer, CorruptChunkError, decode_full, encode_full
from .prefetch import MISSED, PrefetchHandle
from .tiers.base import CapacityTier, TierError
from .tiers.memory import LRU, MemoryTier

# What a compressed chunk's buffer costs in the hot tier beside its bytes: the tensor view, its
# name and dict slot (measured: about 0.9 KiB of RSS per view on CPython 3.11, torch 2.x).
HOT_BYTES_PER_BUFFER = 1024

logger = logging.getLogger(__name__)

Tensor = torch.Tensor

# Derived keys in the capacity tier. The compressed value is written last: its presence means
# the full value was stored before it (``contains`` relies on this). With a MAC key a store uses
# ``mac.MAC_SUFFIXES`` instead.
FULL_SUFFIX, COMPRESSED_SUFFIX = "/full", "/ckv"


class InvalidChunkError(ValueError):
    """A value that parsed but cannot be used: its metadata does not match the store (another
    method, parameters or head count) or it fails the compressor's own validation."""


class UnauthenticatedChunkError(InvalidChunkError):
    """A value whose MAC does not verify: written without the store's key, or tampered with."""


@dataclasses.dataclass
class StoreStats:
    puts: int = 0
    put_errors: int = 0
    compressed_hits: int = 0  # hot tier or capacity tier
    compressed_misses: int = 0
    full_hits: int = 0
    full_misses: int = 0  # includes corrupt ones
    corrupt: int = 0  # full or compressed values that failed verification (then deleted)
    unauthenticated: int = 0  # values whose MAC did not verify (written without the key; kept)
    invalid: int = 0  # compressed values that parsed but do not match the store or fail validation
    cancelled: int = 0
    bytes_written: int = 0
    bytes_read: int = 0  # from the capacity tier
    tier_errors: int = 0  # capacity-tier reads / checks that failed for I/O (misses, not absences)


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
    * A miss is ``None``: never stored, evicted, unreadable, or failed verification. Corrupt,
      unauthenticated and invalid values are counted (``stats``), logged and never returned; the
      next ``put`` of the key rewrites them (corrupt and invalid ones are deleted from the capacity
      tier at once, see ``_reject``). Write failures raise :class:`TierError` after logging; what
      was stored before stays readable.
    * Integrity: every value carries a BLAKE3 digest (accidents). With ``mac_key`` every value also
      carries a keyed BLAKE3 tag over the tier key and the value (tampering, :mod:`.mac`): a value written
      without the key, or moved to another key, is rejected. Compressed values read from the tier
      must match the store's compressor, parameters and head count and pass
      ``compressors.validate``; full values must be ``[2, L, T, heads*D]`` (unless read as not KV,
      ``kv=False``: values stored full-only that are not KV, checked for the rest). One exception: a full
      chunk this store wrote into a plain :class:`MemoryTier` (no MAC) and still there, unchanged, is
      immutable ``bytes`` in this process: its digest is not computed again on every read (~47 ms
      of a core per 8k SmolLM2 prefix, taken from the drafting it runs beside); its framing, length
      and shape still are. "Unchanged" relies on the contract above: nobody writes through the
      tensors ``get_full`` returns (they view the tier's bytes; every reader in this package copies
      them out). A value anyone else put there is checked in full.
    * Closing: reads not yet started are cancelled; ``PrefetchHandle.wait`` then returns misses.
    """

    def __init__(
        self,
        compressor: KVCompressor,
        capacity: CapacityTier,
        *,
        num_kv_heads: int,
        hot_bytes: int = 1 << 30,
        max_concurrent_reads: int = 4,
        mac_key: bytes | None = None,
    ) -> None:
        if num_kv_heads <= 0:
            raise ValueError(f"num_kv_heads must be > 0, got {num_kv_heads}")
        if max_concurrent_reads <= 0:
            raise ValueError(f"max_concurrent_reads must be > 0, got {max_concurrent_reads}")
        self.compressor, self.capacity, self.num_kv_heads = compressor, capacity, num_kv_heads
        self.max_concurrent_reads = max_concurrent_reads
        self._hot: LRU[CompressedKV] = LRU(hot_bytes)
        self._pool = ThreadPoolExecutor(max_concurrent_reads, thread_name_prefix="vericache-read",
                                        initializer=torch_serial)
        self._ckv_pool = ThreadPoolExecutor(max_concurrent_reads, thread_name_prefix="vericache-ckv",
                                            initializer=torch_serial)
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._closed = False
        self._futures: weakref.WeakSet[Future] = weakref.WeakSet()
        self._rejected: LRU[bool] = LRU(1 << 16)  # keys whose values failed the MAC (bounded)
        self._mac_key = None if mac_key is None else mac.derive_key(mac_key)
        # The token tagging this store's own writes into the in-process tier (None: every read
        # checked). The plain MemoryTier only: a subclass's put / get may do more (fault injection,
        # metrics) and must see every call.
        self._writer = object() if type(capacity) is MemoryTier and mac_key is None else None
        self._full_sfx, self._ckv_sfx = mac.MAC_SUFFIXES if mac_key is not None else (FULL_SUFFIX, COMPRESSED_SUFFIX)
        self._bind_metrics(getattr(capacity, "name", type(capacity).__name__))

    def _bind_metrics(self, tier: str) -> None:
        """Prometheus children of this store's tier, bound once (``_count`` feeds them with the stats)."""
        self._prom = {
            "compressed_misses": M.STORE_MISSES.labels(tier, "compressed"),
            "full_hits": M.STORE_HITS.labels(tier, "full"), "full_misses": M.STORE_MISSES.labels(tier, "full"),
            **{k: M.STORE_REJECTED.labels(tier, k) for k in ("corrupt", "unauthenticated", "invalid")},
            "cancelled": M.STORE_CANCELLED.labels(tier), "puts": M.STORE_PUTS.labels(tier),
            "put_errors": M.STORE_PUT_ERRORS.labels(tier), "bytes_read": M.STORE_BYTES_READ.labels(tier),
            "bytes_written": M.STORE_BYTES_WRITTEN.labels(tier),
        }  # compressed_hits: counted by path in get_compressed
        self._prom_ckv_hit = {True: M.STORE_HITS.labels(tier, "compressed_hot"),
                              False: M.STORE_HITS.labels(tier, "compressed_tier")}
        self._prom_full_s, self._prom_put_s = M.STORE_FULL_READ_SECONDS.labels(tier), M.STORE_PUT_SECONDS.labels(tier)
        self._prom_queued = M.STORE_PREFETCH.labels(tier, "queued")
        self._prom_reading = M.STORE_PREFETCH.labels(tier, "reading")

    # -- write path -----------------------------------------------------------------------------
    def put(
        self, key: str, full: Tensor, *, start: int = 0, queries: Tensor | None = None, compress: bool = True,
        replace: bool = False,
    ) -> None:
        """Compress ``full`` (``[2, L, T, H*D]``), store full and compressed bytes in the capacity
        tier and keep the compressed chunk hot. Raises ``TierError`` (logged) if the capacity tier
        fails; the hot tier is then left unchanged.

        ``compress=False`` stores the full chunk only, for KV whose rows are not tokens (vLLM's
        CPU paged blocks as LMCache's MP server hands them over, where the L2 adapter does not
        untile them): a compressed copy of those bytes would serve no drafter. It also stores values that
        are not KV at all (any tensor, e.g. an object's raw bytes as 1-D ``uint8``), checksummed like
        a full chunk; read those with ``kv=False``. ``replace=True`` rewrites a committed value:
        for a caller that found it unusable and recomputed the exact KV."""
        self._check_open()
        if not replace and self.has_full(key) and (not compress or self.capacity.contains(key + self._ckv_sfx)) \
                and key not in self._rejected:
            # Keys name immutable content (chained prefix hashes): a committed chunk, ours or
            # another instance's, is never rewritten, so a failing rewrite cannot delete it.
            # (A value found corrupt or invalid is deleted on read, so it is rewritten here.)
            return
        with self._prom_put_s.time():
            self._put(key, full, start, queries, compress)

    def _put(self, key: str, full: Tensor, start: int, queries: Tensor | None, compress: bool) -> None:
        full_blob = encode_full(full)
        if not compress:
            self._put_or_raise([(key + self._full_sfx, full_blob)], key)
            self._rejected.pop(key)
            self._count(puts=1, bytes_written=len(full_blob))
            return
        ckv_blob = to_bytes(self.compressor.compress(full, self.num_kv_heads, start=start, queries=queries))
        # One round trip on remote tiers; the compressed value (the commit marker) goes second.
        try:
            self._put_or_raise([(key + self._full_sfx, full_blob), (key + self._ckv_sfx, ckv_blob)], key)
        except TierError:
            self.capacity.delete(key + self._full_sfx)  # all or nothing: no full chunk without its commit
            raise
        self._keep_hot(key, ckv_blob)
        self._rejected.pop(key)
        self._count(puts=1, bytes_written=len(full_blob) + len(ckv_blob))

    def _keep_hot(self, key: str, blob: Buffer) -> CompressedKV:
        """Keep a hot copy of the compressed chunk ``blob`` (never aliasing a caller's buffer), counted
        at the memory it holds: its own anonymous mapping, unmapped when the entry is evicted and its
        last view dropped (a heap block of this size would stay in the allocator after eviction, and
        the process would grow past the bound with churn), plus each buffer's tensor object."""
        n = len(blob)
        value = mmap.mmap(-1, max(n, 1))
        value[:n] = blob
        ckv = from_bytes(memoryview(value)[:n])
        held = -(-n // mmap.PAGESIZE) * mmap.PAGESIZE + len(ckv.buffers) * HOT_BYTES_PER_BUFFER
        self._hot.put(key, ckv, held)
        return ckv

    def _put_or_raise(self, items: list[tuple[str, bytes]], key: str) -> None:
        if self._mac_key is not None:
            items = [(k, mac.seal(self._mac_key, k, blob)) for k, blob in items]
        try:
            if self._writer is not None:
                for k, blob in items:
                    self.capacity.put_own(k, blob, self._writer)
            else:
                self.capacity.put_many(items)
        except TierError as e:
            self._count(put_errors=1)
            logger.error("store put %r failed: %s", key, e)
            raise

    # -- integrity --------------------------------------------------------------------------------
    def _read(self, tier_key: str) -> tuple[Buffer | None, bool]:
        """The value at ``tier_key`` with its MAC checked and stripped (``None`` for a miss), and
        whether it is this store's own unchanged write into the in-process tier (see the class
        docstring). Raises :class:`InvalidChunkError` for a value whose tag does not verify."""
        if self._writer is not None:  # the plain memory tier, no MAC
            return self.capacity.get_own(tier_key, self._writer)
        blob = self.capacity.get(tier_key)
        if blob is None or self._mac_key is None:
            return blob, False
        body = mac.unseal(self._mac_key, tier_key, blob)
        if body is None:
            raise UnauthenticatedChunkError("MAC does not verify (written without this store's key, or tampered with)")
        return body, False

    def _reject(self, key: str, what: str, err: Exception) -> None:
        """Count and log a bad value. Corrupt and invalid values are garbage under any key, so they
        are deleted (with the chunk's commit marker) and the next put rewrites them. A value that
        fails the MAC may be a good value of a host with another key: it is not deleted, but this
        store stops reporting it (``has_full``) and overwrites it on the next put."""
        if isinstance(err, UnauthenticatedChunkError):
            self._count(unauthenticated=1)
            self._rejected.put(key, True, 1)
            logger.error("store: %s chunk %r failed its MAC, treated as a miss: %s", what, key, err)
            return
        kind = "invalid" if isinstance(err, InvalidChunkError) else "corrupt"
        self._count(**{kind: 1})
        logger.error("store: %s chunk %r is %s, deleted and treated as a miss: %s", what, key, kind, err)
        for sfx in ((self._full_sfx, self._ckv_sfx) if what == "full" else (self._ckv_sfx,)):
            self.capacity.delete(key + sfx)

    def _check_compressed(self, ckv: CompressedKV) -> None:
        ours = self.compressor
        if ckv.method != ours.name or ckv.params != ours.params() or ckv.num_kv_heads != self.num_kv_heads:
            raise InvalidChunkError(
                f"chunk is {ckv.method} {ckv.params} with {ckv.num_kv_heads} heads; the store uses "
                f"{ours.name} {ours.params()} with {self.num_kv_heads}")
        try:
            compressors.validate(ckv)
        except CodecError as e:
            raise InvalidChunkError(str(e)) from None

    def _check_full(self, t: Tensor) -> None:
        if t.dim() != 4 or t.shape[0] != 2 or t.shape[3] % self.num_kv_heads or not t.is_floating_point():
            raise InvalidChunkError(f"full chunk {t.dtype} {tuple(t.shape)} is not [2, L, T, {self.num_kv_heads}*D]")

    # -- draft path -----------------------------------------------------------------------------
    def get_compressed(self, key: str) -> CompressedKV | None:
        """The compressed chunk from the hot tier, else from the capacity tier (validated, then kept hot)."""
        self._check_open()
        ckv = self._hot.get(key)
        hot = ckv is not None
        if ckv is None:
            try:
                blob, _ = self._read(key + self._ckv_sfx)
                if blob is not None:
                    self._count(bytes_read=len(blob))
                    self._check_compressed(from_bytes(blob))
                    ckv = self._keep_hot(key, blob)
            except (CodecError, InvalidChunkError) as e:
                ckv = None
                self._reject(key, "compressed", e)
        self._count(**{"compressed_hits" if ckv is not None else "compressed_misses": 1})
        if ckv is not None:
            self._prom_ckv_hit[hot].inc()
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
        return (key in self._hot or self.capacity.contains(key + self._ckv_sfx)
                or self.capacity.contains(key + self._full_sfx))

    def has_full(self, key: str) -> bool:
        """The full chunk is in the capacity tier (what exact-KV consumers such as LMCache need;
        a hint: a later read may still miss)."""
        return key not in self._rejected and self.capacity.contains(key + self._full_sfx)

    # -- full path ------------------------------------------------------------------------------
    def get_full(self, key: str, *, kv: bool = True) -> Tensor | None:
        """The verified full chunk, read now (blocking). ``kv=False`` reads a value stored full-only
        that is not KV: framing, length and digest are checked, the ``[2, L, T, H*D]`` shape is not."""
        self._check_open()
        return self._read_full(key, kv)

    def prefetch(self, keys: list[str], *, window: int | None = None,
                 not_kv: Collection[str] = ()) -> PrefetchHandle:
        """Start background reads of the full chunks of ``keys`` and return at once. At most
        ``window`` (default ``4 * max_concurrent_reads``) chunks are read ahead of the consumer.
        Keys in ``not_kv`` are read as ``get_full(key, kv=False)`` reads them."""
        self._check_open()
        window = window or 4 * self.max_concurrent_reads
        submit = self._submit_read
        if not_kv:
            plain = frozenset(not_kv)

            def submit(key: str) -> Future:
                return self._submit_read(key, key not in plain)

        return PrefetchHandle(list(keys), submit, window, self._count)

    def _submit_read(self, key: str, kv: bool = True) -> Future:
        self._prom_queued.inc()
        try:
            fut = self._pool.submit(self._prefetch_read, key, kv)
        except RuntimeError:  # the pool is shut down: the store closed
            self._prom_queued.dec()
            return MISSED
        fut.add_done_callback(self._dequeue_cancelled)
        self._futures.add(fut)
        return fut

    def _dequeue_cancelled(self, fut: Future) -> None:
        if fut.cancelled():  # never ran: still counted as queued
            self._prom_queued.dec()

    def _prefetch_read(self, key: str, kv: bool) -> Tensor | None:
        self._prom_queued.dec()
        self._prom_reading.inc()
        try:
            return self._read_full(key, kv)
        finally:
            self._prom_reading.dec()

    def _read_full(self, key: str, kv: bool = True) -> Tensor | None:
        with self._prom_full_s.time():
            return self._read_full_timed(key, kv)

    def _read_full_timed(self, key: str, kv: bool) -> Tensor | None:
        try:
            blob, own = self._read(key + self._full_sfx)
            if blob is None:
                self._count(full_misses=1)
                return None
            self._count(bytes_read=len(blob))
            t = decode_full(blob, check_digest=not own)
            if kv:
                self._check_full(t)
        except (CorruptChunkError, InvalidChunkError) as e:
            self._count(full_misses=1)
            self._reject(key, "full", e)
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
            return dataclasses.replace(self._stats, tier_errors=self.capacity.io_errors)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)
                if d and (c := self._prom.get(name)) is not None:
                    c.inc(d)

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
        # Futures cancelled by the shutdown are never "notified": concurrent.futures.wait would
        # block on them forever. Notify them, so every handle's wait() returns misses.
        for fut in list(self._futures):
            if fut.cancelled():
                with contextlib.suppress(RuntimeError):  # already notified
                    fut.set_running_or_notify_cancel()
        self.capacity.close()
        self._hot.clear()

    def __enter__(self) -> DualTierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
