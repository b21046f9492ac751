"""A shared Redis or Valkey server (one value per key, RESP ``SET``/``GET``)."""

from __future__ import annotations

import logging

import redis as redis_py
from redis.backoff import NoBackoff
from redis.retry import Retry

from .base import Blob, CapacityTier, ErrorLog, TierError, check_key, redact, scrub

logger = logging.getLogger(__name__)


class RedisTier(CapacityTier):
    """Values in a Redis/Valkey server at ``url`` (``redis://[user:password@]host:port/db``), under
    ``prefix``. Messages, logs and the repr show the URL with its password as ``***``.

    Several processes and hosts may share one server: that is the remote prefix-cache case.
    A ``SET`` is atomic, so readers never see partial values. A lost or refused connection makes
    reads misses (logged, rate limited) and puts raise :class:`TierError`; each call reconnects,
    so the tier recovers by itself when the server comes back.

    Built on redis-py rather than LMCache's ``RedisConnector`` (``lmcache.v1.storage_backend.
    connector.redis_connector``): that connector only moves LMCache ``MemoryObj``\\ s keyed by
    ``CacheEngineKey`` and needs a ``LocalCPUBackend`` (engine config, model metadata, a pinned
    allocator) plus an asyncio loop to run at all, while this tier stores self-describing,
    variable-length byte strings under plain string keys. It also stores each chunk as two keys
    (metadata, then bytes) written and read in two round trips and copies every value twice on
    get; one ``SET``/``GET`` per value is atomic and one round trip.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "vericache:",
        socket_timeout: float = 5.0,
        connect_timeout: float = 1.0,
        max_connections: int = 32,
    ) -> None:
        try:
            self._client = redis_py.Redis.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout,
                retry=Retry(NoBackoff(), 0),  # a dead server must cost one refused connect, not retries
                max_connections=max_connections,
            )
        except ValueError as e:
            raise TierError(f"redis tier: bad url {redact(url)!r}: {scrub(e, url)}") from None
        self.url, self.prefix = url, prefix  # url keeps the password: never put it in a message
        self._shown = redact(url)
        self._errors = ErrorLog(logger)
        self._closed = False
        try:
            self._client.ping()
        except (redis_py.RedisError, OSError) as e:
            self._client.close()
            raise TierError(f"redis tier: cannot reach {self._shown}: {scrub(e, self.url)}") from e

    def __repr__(self) -> str:
        return f"RedisTier({self._shown!r}, prefix={self.prefix!r})"

    def _key(self, key: str) -> str:
        check_key(key)
        return self.prefix + key

    def put(self, key: str, data: Blob) -> None:
        k = self._key(key)
        if self._closed:
            raise TierError(f"redis tier {self._shown}: put {key!r} after close")
        try:
            self._client.set(k, data)
        except (redis_py.RedisError, OSError) as e:
            raise TierError(
                f"redis tier {self._shown}: SET {key!r} ({len(data)} bytes) failed: {scrub(e, self.url)}"
            ) from e

    def put_many(self, items: list[tuple[str, Blob]]) -> None:
        """One round trip (a non-transactional pipeline: the server applies the SETs in order)."""
        if self._closed:
            raise TierError(f"redis tier {self._shown}: put after close")
        keys = [self._key(k) for k, _ in items]
        try:
            pipe = self._client.pipeline(transaction=False)
            for k, (_, data) in zip(keys, items):
                pipe.set(k, data)
            pipe.execute()
        except (redis_py.RedisError, OSError) as e:
            raise TierError(f"redis tier {self._shown}: SET of {[k for k, _ in items]} failed: "
                            f"{scrub(e, self.url)}") from e

    def get(self, key: str) -> bytes | None:
        k = self._key(key)
        if self._closed:
            return None
        try:
            return self._client.get(k)  # type: ignore[return-value]
        except (redis_py.RedisError, OSError) as e:
            self._errors("redis tier %s: GET %r failed: %s", self._shown, key, scrub(e, self.url))
            return None

    def contains(self, key: str) -> bool:
        k = self._key(key)
        if self._closed:
            return False
        try:
            return bool(self._client.exists(k))
        except (redis_py.RedisError, OSError) as e:
            self._errors("redis tier %s: EXISTS %r failed: %s", self._shown, key, scrub(e, self.url))
            return False

    def delete(self, key: str) -> None:
        k = self._key(key)
        try:
            self._client.delete(k)
        except (redis_py.RedisError, OSError) as e:
            self._errors("redis tier %s: DEL %r failed: %s", self._shown, key, scrub(e, self.url))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()
