"""Where a request's full KV lives between verifications, and how much KV may be resident.

``resident``: every request keeps a full-size verify cache for its whole life, next to its draft
cache. The store still shares prompt prefixes between engines and hosts (puts after prefill, a
cached prefix skips prefill), but a prefix read from the store is swapped in once, in the first
round, and never again: no copy competes with drafting for the cores and the memory bus. The
fastest mode wherever the full KV fits.

``offload`` (the seeds' memory model): per request only the draft cache stays resident (compressed
prefix, then the exact KV of every later position). The full prefix lives in the store's capacity
tier; each round it is swapped into a verify buffer leased from a bounded pool shared by all
requests, the exact suffix is copied in from the draft cache, the block is verified, and the buffer
goes back to the pool. Resident KV is then ``pool + sum(draft caches)``, so more requests fit a
``kv_budget_bytes`` than with full KV. On a CPU the budget stands in for accelerator memory.

``auto``: ``resident`` unless a ``kv_budget_bytes`` is given and the requests' full + draft KV
would not fit it.

Admission: with a budget, a request is admitted (prefilled and decoded) only while the KV already
held plus its own estimate fits; the rest wait and are admitted as admitted ones finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from .cache import KVCache

FULL_KV_MODES = ("auto", "resident", "offload")


def check_residency(full_kv: str, kv_budget_bytes: int | None, verify_buffers: int | None) -> None:
    """Validate the engine's residency options (before any model work)."""
    if full_kv not in FULL_KV_MODES:
        raise ValueError(f"full_kv must be one of {FULL_KV_MODES}, got {full_kv!r}")
    for name, value in (("kv_budget_bytes", kv_budget_bytes), ("verify_buffers", verify_buffers)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")


class VerifyPool:
    """At most ``count`` full-size verify caches, made on first use and reused; single-threaded
    (the engine's loop leases and releases; a swap thread only writes into a leased cache)."""

    def __init__(self, make: Callable[[], KVCache], count: int, nbytes_each: int):
        self._make, self.count, self.nbytes_each = make, count, nbytes_each
        self._free: list[KVCache] = []
        self._made = 0

    def lease(self) -> KVCache | None:
        """A free verify cache (length 0), or ``None`` when all ``count`` are leased."""
        if self._free:
            return self._free.pop()
        if self._made < self.count:
            self._made += 1
            return self._make()
        return None

    def release(self, cache: KVCache) -> None:
        cache.n = 0
        self._free.append(cache)

    @property
    def nbytes(self) -> int:
        """Bytes the pool may hold (every buffer counted, made or not: the budget reserves them)."""
        return self.count * self.nbytes_each


def cache_nbytes(cache: KVCache | None) -> int:
    if cache is None:
        return 0
    return cache.k.nbytes + cache.v.nbytes + (cache.packed.nbytes if cache.packed is not None else 0)


class Residency:
    """The resolved mode of one ``generate()`` call, its verify pool and its admission rule.

    ``full_bytes``: bytes of one full-size cache of the largest request of the call.
    """

    def __init__(self, full_kv: str, kv_budget_bytes: int | None, verify_buffers: int | None,
                 n_requests: int, full_bytes: int, make: Callable[[], KVCache], has_store: bool):
        check_residency(full_kv, kv_budget_bytes, verify_buffers)
        self.budget = kv_budget_bytes
        if full_kv == "offload" and not has_store:
            raise ValueError("full_kv='offload' needs a store for the full KV (store='resident' has none)")
        if full_kv == "auto":
            # Resident needs a full and a draft cache per request (a draft cache is at most full size).
            # A budget below one verify cache leaves resident, one request at a time, as the only choice.
            fits = kv_budget_bytes is None or 2 * n_requests * full_bytes <= kv_budget_bytes
            small = kv_budget_bytes is not None and kv_budget_bytes < full_bytes
            full_kv = "resident" if fits or small or not has_store else "offload"
        self.mode = full_kv
        self.pool: VerifyPool | None = None
        self.waiting: deque = deque()  # offload: requests waiting for a verify cache, oldest first
        if self.offload:
            # One verifies while another swaps; more only help when rounds are short next to swaps.
            # Under a budget the default pool takes at most a quarter of it: the rest is for drafts.
            count = verify_buffers or max(2, -(-n_requests // 4))
            if kv_budget_bytes is not None:
                if kv_budget_bytes < full_bytes:
                    raise ValueError(f"kv_budget_bytes={kv_budget_bytes} cannot hold one verify buffer "
                                     f"of {full_bytes} bytes")
                count = min(count, kv_budget_bytes // full_bytes if verify_buffers
                            else max(1, kv_budget_bytes // (4 * full_bytes)))
            self.pool = VerifyPool(make, count, full_bytes)
        self._ratio: float | None = None  # largest draft / full bytes admitted: the next one's estimate

    @property
    def offload(self) -> bool:
        return self.mode == "offload"

    def held_bytes(self, requests: Iterable) -> int:
        """Resident KV of ``requests`` (their draft caches, and their full caches unless those are
        pooled) plus the whole verify pool."""
        own = sum(cache_nbytes(r.draft) + (0 if self.offload else cache_nbytes(r.full)) for r in requests)
        return own + (self.pool.nbytes if self.pool else 0)

    def admits(self, held: int, full_bytes: int, first: bool) -> bool:
        """Whether a request whose full cache takes ``full_bytes`` may start while ``held`` bytes are
        resident. The first request is always admitted (otherwise nothing could ever run)."""
        if self.budget is None or first:
            return True
        ratio = 1.0 if self._ratio is None else self._ratio
        own = full_bytes * (ratio if self.offload else 1.0 + ratio)
        return held + own <= self.budget

    def observe(self, draft: KVCache | None, full_bytes: int) -> None:
        """Learn the draft/full ratio from an admitted request (the largest seen, to stay under budget)."""
        if draft is not None and full_bytes:
            seen = cache_nbytes(draft) / full_bytes
            self._ratio = seen if self._ratio is None else max(self._ratio, seen)
