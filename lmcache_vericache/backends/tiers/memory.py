"""In-process memory: a byte-bounded LRU (also the store's hot tier for compressed chunks)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

from .base import Blob, CapacityTier, TierError, check_key

V = TypeVar("V")


class LRU(Generic[V]):
    """Thread-safe map bounded by the sum of its values' byte sizes, evicting least recently used.

    Values are kept by reference (the caller hands over ownership). A value larger than the bound
    is refused: ``put`` returns ``False`` and leaves the map unchanged.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0

    def get(self, key: str) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: str, value: V, nbytes: int) -> bool:
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            while self._items and self._bytes + nbytes > self.max_bytes:
                _, (_, n) = self._items.popitem(last=False)
                self._bytes -= n
                self.evictions += 1
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            return True

    def pop(self, key: str) -> V | None:
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return None
            self._bytes -= item[1]
            return item[0]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


class MemoryTier(CapacityTier):
    """Capacity tier in this process's memory, bounded by ``max_bytes`` (LRU). Not shared between
    processes and lost on exit; useful for tests, benchmarks and single-process serving.

    Each value remembers who wrote it: :meth:`put_own` tags it with the writer's token and
    :meth:`get_own` tells that writer whether the value is still the one it wrote (immutable
    ``bytes`` in this process, so it needs no re-check of its checksum); a value put since by anyone
    else (:meth:`put`, another token) is not its own."""

    name = "memory"

    def __init__(self, max_bytes: int) -> None:
        self._lru: LRU[tuple[bytes, object]] = LRU(max_bytes)
        self._closed = False

    def put(self, key: str, data: Blob) -> None:
        self.put_own(key, data, None)

    def put_own(self, key: str, data: Blob, writer: object) -> None:
        """``put``, the value tagged with ``writer`` (any object the writer keeps; ``None``: nobody's)."""
        check_key(key)
        if self._closed:
            raise TierError(f"memory tier: put {key!r} after close")
        value = data if isinstance(data, bytes) else bytes(data)  # never alias a mutable buffer
        if not self._lru.put(key, (value, writer), len(value)):
            raise TierError(
                f"memory tier: value for {key!r} is {len(value)} bytes, larger than the tier ({self._lru.max_bytes})"
            )

    def get(self, key: str) -> bytes | None:
        return self.get_own(key, None)[0]

    def get_own(self, key: str, writer: object) -> tuple[bytes | None, bool]:
        """The value at ``key`` and whether ``writer`` (not ``None``) put it with :meth:`put_own`."""
        item = self._lru.get(key)
        if item is None:
            return None, False
        return item[0], writer is not None and item[1] is writer

    def contains(self, key: str) -> bool:
        return key in self._lru

    def delete(self, key: str) -> None:
        self._lru.pop(key)

    def close(self) -> None:
        self._closed = True
        self._lru.clear()

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes
