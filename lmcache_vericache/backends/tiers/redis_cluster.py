"""A shared Redis Cluster or Valkey cluster (one value per key, RESP ``SET``/``GET`` routed by slot)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import redis as redis_py
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.exceptions import ClusterDownError, MaxConnectionsError, RedisClusterException, SlotNotCoveredError
from redis.retry import Retry

from .base import Blob, CapacityTier, ErrorLog, TierError, check_key, redact, scrub

logger = logging.getLogger(__name__)

# A node is "down" after these: it refused or dropped the connection, timed out, or the cluster
# says its slots are not served. Other errors (OOM, a wrong type) fail the call, not the node.
_NODE_DOWN = (redis_py.ConnectionError, redis_py.TimeoutError, ClusterDownError, RedisClusterException, OSError)
_IO_ERRORS = (redis_py.RedisError, RedisClusterException, OSError)
_UNCOVERED = "<slot not covered>"  # breaker key of slots the client's slot map has no node for
# One retry, after redis-py has re-read the slot map from a live node: a failover costs no miss, a
# dead node two connection attempts per down_interval. redis-py < 6 counts cluster retries apart.
_RETRY_ONCE = ({"retry": Retry(NoBackoff(), 1)} if int(redis_py.__version__.split(".")[0]) >= 6
               else {"cluster_error_retry_attempts": 1})


def split_urls(urls: str | Sequence[str]) -> list[str]:
    """Startup node URLs from a comma-separated string or a sequence (blanks dropped)."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    return [u.strip() for u in items if u and u.strip()]


class RedisClusterTier(CapacityTier):
    """Values in a Redis Cluster / Valkey cluster reached through one or more startup nodes
    ``urls`` (``redis://[user:password@]host:port``, comma-separated or a list; ``rediss://`` for
    TLS; all with the same scheme and credentials), under ``prefix``. Any live node is enough to
    start: the client reads the slot map from it and then talks to each slot's master directly.
    Messages, logs and the repr show the URLs with passwords as ``***``.

    Keys: ``prefix + key``, except that the part of ``key`` before its last ``/`` is wrapped in a
    hash tag (``vericache:{<id>-<hash>}/full``), so the values of one chunk (its full bytes and its
    compressed copy, ``/full`` and ``/ckv``) live in one slot, on one master. Chunks still spread
    evenly over the masters; what the tag buys is fate sharing: a dead master takes out a third of
    the chunks (of three masters) instead of the five ninths that would lose one part or the
    other, and a replica that takes over has a chunk's commit (written after the full bytes, on the
    same replication stream) only if it has the full bytes too. A ``prefix`` with ``{`` or ``}``
    is refused: its tag would put every key in one slot.

    Failures are per node: when the master of a key's slot refuses the connection, times out or
    its slots are down, reads of that node's slots are misses (logged, rate limited) and puts to
    them raise :class:`TierError`, while the other masters keep serving. The client then leaves the
    node alone for ``down_interval`` seconds (misses and errors cost no network round trip) and
    lets one call probe it; each failed call also re-reads the slot map from a live node (redis-py
    does that on every connection error), so when a replica has taken over, the probe is served by
    it and the tier is whole again without a restart. A call retries once after such a refresh, so
    the first call after a failover already succeeds.

    For a cache, run the servers with ``cluster-require-full-coverage no``: with the default
    ``yes`` every node refuses every key (``CLUSTERDOWN``) from the moment a master is marked
    failed until its replica has taken over, which here is a short spell of misses on all keys.
    """

    name = "redis_cluster"

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        prefix: str = "vericache:",
        socket_timeout: float = 5.0,
        connect_timeout: float = 1.0,
        max_connections: int = 32,
        down_interval: float = 1.0,
    ) -> None:
        self.urls = split_urls(urls)  # keep the password: never put them in a message
        self._shown = ",".join(map(redact, self.urls)) or repr(urls)
        self.prefix, self.down_interval = prefix, down_interval
        if "{" in prefix or "}" in prefix:
            raise TierError(f"redis_cluster tier: prefix {prefix!r} must not contain '{{' or '}}' "
                            "(a hash tag in it would put every key in one slot)")
        if not self.urls:
            raise TierError("redis_cluster tier: no startup node URL given")
        first = self.urls[0]
        nodes: list[ClusterNode] = []
        try:
            common = None
            for url in self.urls:
                opts = parse_url(url)
                if "path" in opts:
                    raise ValueError(f"{redact(url)!r}: a cluster is reached over TCP, not a unix socket")
                if opts.pop("db", 0) not in (0, None):
                    raise ValueError(f"{redact(url)!r}: a cluster has only database 0")
                host, port = opts.pop("host", None), int(opts.pop("port", 6379))
                if not host:
                    raise ValueError(f"{redact(url)!r}: no host")
                if common is None:
                    common = opts
                elif opts != common:
                    raise ValueError("startup nodes must share the scheme, user, password and options")
                else:
                    nodes.append(ClusterNode(host, port))
        except ValueError as e:
            raise TierError(f"redis_cluster tier: bad url in {self._shown!r}: {scrub(e, first)}") from None
        try:
            self._client = RedisCluster(
                url=first,  # credentials and TLS of the first URL apply to every node
                startup_nodes=nodes,
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout,
                max_connections=max_connections,
                **_RETRY_ONCE,  # type: ignore[arg-type]
                # A slot without a live master must be a miss, not a client that cannot start.
                require_full_coverage=False,
            )
        except _IO_ERRORS as e:
            raise TierError(f"redis_cluster tier: cannot reach {self._shown}: {scrub(e, first)}") from e
        self._errors = ErrorLog(logger)
        self._lock = threading.Lock()
        self._down: dict[str, float] = {}  # node name -> monotonic time before which it is left alone
        self._closed = False

    def __repr__(self) -> str:
        return f"RedisClusterTier({self._shown!r}, prefix={self.prefix!r})"

    def _key(self, key: str) -> str:
        check_key(key)
        head, slash, tail = key.rpartition("/")
        return f"{self.prefix}{{{head}}}/{tail}" if head and slash else self.prefix + key

    def keyslot(self, key: str) -> int:
        """The hash slot of ``key`` (as stored: prefixed and tagged)."""
        return self._client.keyslot(self._key(key))

    # -- per-node breaker ----------------------------------------------------------------------------
    def _route(self, k: str) -> str | None:
        """Name of the master that owns ``k``'s slot, or ``None`` when it is down and not due for
        a probe. Raises what the topology refresh of an uncovered slot raises."""
        try:
            node = self._client.get_node_from_key(k).name
        except SlotNotCoveredError:
            node = _UNCOVERED
        if self._down:
            with self._lock:
                until = self._down.get(node)
                now = time.monotonic()
                if until is not None:
                    if now < until:
                        return None
                    self._down[node] = now + self.down_interval  # this call probes; the others skip
        if node == _UNCOVERED:  # redis-py only refreshes its slot map after a failed command
            self._client.nodes_manager.initialize()
            node = self._client.get_node_from_key(k).name
        return node

    def _failed(self, node: str | None, e: Exception) -> None:
        if node is not None and isinstance(e, _NODE_DOWN) and not isinstance(e, MaxConnectionsError):
            with self._lock:
                self._down[node] = time.monotonic() + self.down_interval

    def _served(self, node: str) -> None:
        if node in self._down:
            with self._lock:
                self._down.pop(node, None)

    def _skipped(self, op: str, key: str, k: str) -> str:
        return (f"redis_cluster tier {self._shown}: {op} {key!r} skipped: the master of slot "
                f"{self._client.keyslot(k)} is down (probed again every {self.down_interval:g} s)")

    # -- CapacityTier ----------------------------------------------------------------------------------
    def put(self, key: str, data: Blob) -> None:
        k = self._key(key)
        if self._closed:
            raise TierError(f"redis_cluster tier {self._shown}: put {key!r} after close")
        node = _UNCOVERED
        try:
            node = self._route(k)  # type: ignore[assignment]
            if node is None:
                raise TierError(self._skipped("SET", key, k))
            self._client.set(k, data)
        except _IO_ERRORS as e:
            self._failed(node, e)
            raise TierError(f"redis_cluster tier {self._shown}: SET {key!r} ({len(data)} bytes) failed: "
                            f"{scrub(e, self.urls[0])}") from e
        self._served(node)

    def get(self, key: str) -> bytes | None:
        k = self._key(key)
        if self._closed:
            return None
        node = _UNCOVERED
        try:
            node = self._route(k)  # type: ignore[assignment]
            if node is None:
                self._errors("%s", self._skipped("GET", key, k))
                return None
            value = self._client.get(k)
        except _IO_ERRORS as e:
            self._failed(node, e)
            self._errors("redis_cluster tier %s: GET %r failed: %s", self._shown, key, scrub(e, self.urls[0]))
            return None
        self._served(node)
        return value  # type: ignore[return-value]

    def contains(self, key: str) -> bool:
        k = self._key(key)
        if self._closed:
            return False
        node = _UNCOVERED
        try:
            node = self._route(k)  # type: ignore[assignment]
            if node is None:
                self._errors("%s", self._skipped("EXISTS", key, k))
                return False
            found = bool(self._client.exists(k))
        except _IO_ERRORS as e:
            self._failed(node, e)
            self._errors("redis_cluster tier %s: EXISTS %r failed: %s", self._shown, key, scrub(e, self.urls[0]))
            return False
        self._served(node)
        return found

    def delete(self, key: str) -> None:
        k = self._key(key)
        if self._closed:
            return
        node = _UNCOVERED
        try:
            node = self._route(k)  # type: ignore[assignment]
            if node is None:
                self._errors("%s", self._skipped("DEL", key, k))
                return
            self._client.delete(k)
        except _IO_ERRORS as e:
            self._failed(node, e)
            self._errors("redis_cluster tier %s: DEL %r failed: %s", self._shown, key, scrub(e, self.urls[0]))
            return
        self._served(node)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()
