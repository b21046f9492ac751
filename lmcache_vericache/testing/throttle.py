"""A bandwidth-limited TCP link on 127.0.0.1: a proxy in front of a real server (Redis, ``lm://``).

``ThrottledLink(target_port, rate_bytes_per_s)`` listens on a free port and forwards every
connection to ``127.0.0.1:target_port``; the bytes of all connections together, in each direction,
pass a token bucket of ``rate`` bytes/s (a shared link, not a per-connection limit). ``rate`` can be
changed while it runs; :meth:`cut` drops every connection and refuses new ones (a link that dies).
Used by ``benchmarks/remote_prefix.py`` and the connector's end-to-end tests to put a remote store
behind a slow network.
"""

from __future__ import annotations

import socket
import threading
import time

from .servers import free_port

_PIECE = 64 << 10  # bytes forwarded per bucket draw


class _Bucket:
    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        """Block until ``n`` bytes may pass (a shared schedule: concurrent takers queue up)."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
            wait = self._next - now
        if wait > 0:
            time.sleep(wait)


class ThrottledLink:
    """TCP proxy ``127.0.0.1:port -> 127.0.0.1:target_port`` at ``rate`` bytes/s per direction."""

    def __init__(self, target_port: int, rate: float, port: int | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        self.target_port, self.port = target_port, port or free_port()
        self._buckets = (_Bucket(rate), _Bucket(rate))  # to the server, to the client
        self.bytes = [0, 0]
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._open = True
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._accepter = threading.Thread(target=self._accept, name="throttle-accept", daemon=True)
        self._accepter.start()

    @property
    def rate(self) -> float:
        return self._buckets[0].rate

    @rate.setter
    def rate(self, value: float) -> None:
        for b in self._buckets:
            b.rate = value

    def url(self, scheme: str = "redis") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while self._open:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if not self._open:
                client.close()
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)  # the timeout is for the connect: an idle connection stays open
            with self._lock:
                self._socks |= {client, upstream}
            for src, dst, d in ((client, upstream, 0), (upstream, client, 1)):
                threading.Thread(target=self._pump, args=(src, dst, d), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: int) -> None:
        try:
            while True:
                data = src.recv(_PIECE)
                if not data:
                    break
                self._buckets[direction].take(len(data))
                self.bytes[direction] += len(data)  # before sending: a reader that has them sees them counted
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        """Drop every connection and stop accepting (the link dies)."""
        self._open = False
        self._server.close()
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.cut()

    def __enter__(self) -> ThrottledLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
