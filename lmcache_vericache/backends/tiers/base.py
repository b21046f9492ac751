"""The capacity-tier contract shared by memory, disk and remote tiers."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import ClassVar

Blob = bytes | bytearray


class TierError(RuntimeError):
    """A tier could not store a value (disk full, server unreachable, value too large, closed)."""


class CapacityTier(ABC):
    """A flat ``str -> bytes`` store for full and compressed chunks.

    Contract every tier keeps:

    * **Thread-safety**: every method may be called concurrently from any thread. No method needs
      or touches an event loop; async callers run them in a thread pool.
    * **Values are opaque**: integrity is checked by the readers (the chunk formats carry digests),
      so a tier never interprets or repairs a value.
    * ``put`` is atomic: a concurrent or later ``get`` sees the old value, the new one or a miss,
      never a partial value, including when the write fails half way. On failure it raises
      :class:`TierError` whose message names the tier, the key and the cause; nothing stored
      earlier is lost. ``put`` does not keep a reference to a mutable ``data``.
    * ``get`` returns a bytes-like object the caller owns (a ``bytearray`` where the tier can fill
      one without an extra copy), or ``None`` for a **miss**: never stored, evicted, deleted, or the
      tier is unreachable or failed to read (logged, rate limited). It never raises for I/O.
    * ``contains`` is a cheap existence check, ``False`` when unreachable; ``True`` may still be
      followed by a miss (eviction, another writer).
    * ``delete`` is idempotent and silent when the key is absent or the tier unreachable.
    * ``close`` is idempotent; ``put`` after ``close`` raises :class:`TierError`, reads miss.
    * ``io_errors`` counts the reads, checks and deletes that failed for I/O (each also a miss or a
      ``False``), so a caller can tell a failing tier from an empty one.
    """

    name: ClassVar[str]
    _errors: ErrorLog | None = None  # tiers that can fail for I/O log and count through one

    @property
    def io_errors(self) -> int:
        """Reads, existence checks and deletes that failed for I/O since the tier was built."""
        return 0 if self._errors is None else self._errors.count

    @abstractmethod
    def put(self, key: str, data: Blob) -> None: ...

    def put_many(self, items: list[tuple[str, Blob]]) -> None:
        """Store several values in order (a remote tier sends them in one round trip). Raises
        :class:`TierError` if any failed; values before the failed one may be stored."""
        for key, data in items:
            self.put(key, data)

    @abstractmethod
    def get(self, key: str) -> Blob | None: ...

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> CapacityTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ErrorLog:
    """Logs read-side failures at ERROR at most once per ``interval`` seconds, counting the rest,
    so a dead server turns into a few log lines instead of one per chunk."""

    def __init__(self, logger: logging.Logger, interval: float = 5.0) -> None:
        self._logger, self._interval = logger, interval
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._suppressed = 0
        self.count = 0

    def __call__(self, msg: str, *args: object) -> None:
        with self._lock:
            self.count += 1
            now = time.monotonic()
            if now - self._last < self._interval:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            msg += f" ({suppressed} similar errors suppressed)"
        self._logger.error(msg, *args)


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"tier keys are non-empty str, got {key!r}")



def _userinfo(url: str) -> tuple[str, str, str, str] | None:
    """``(scheme, user, password, rest)`` of a URL with a password; splits like ``urlsplit`` (the netloc
    ends at the first ``/?#``, the user info at its last ``@``) but never raises."""
    scheme, sep, rest = url.partition("://")
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    userinfo, at, host = rest[:end].rpartition("@")
    user, colon, password = userinfo.partition(":")
    return (scheme, user, password, host + rest[end:]) if sep and at and colon else None


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (``redis://user:***@host:6379/0``), for every
    message, log line and repr that shows a URL; a URL without a password is returned as is."""
    parts = _userinfo(url)
    return url if parts is None else f"{parts[0]}://{parts[1]}:***@{parts[3]}"


def scrub(text: object, url: str) -> str:
    """``str(text)`` (e.g. a client library's exception) with the password of ``url`` replaced by ``***``."""
    parts, text = _userinfo(url), str(text)
    return text.replace(parts[2], "***") if parts and parts[2] else text
