"""The throttled link in front of a real Redis server: bytes pass unchanged at the set rate, and a
cut link fails its clients (what the connector's fault tests and remote_prefix benchmark rely on)."""

from __future__ import annotations

import socket
import time

import pytest
import redis

from lmcache_vericache.testing.throttle import ThrottledLink


def test_link_passes_bytes_at_its_rate_and_cut_fails_clients(redis_server):
    value = bytes(range(256)) * (16 << 10)  # 4 MiB
    redis.Redis(port=redis_server.port).set("k", value)
    with ThrottledLink(redis_server.port, rate=8 << 20) as link:
        client = redis.Redis(port=link.port, socket_timeout=10)
        t = time.perf_counter()
        assert client.get("k") == value
        dt = time.perf_counter() - t
        assert 0.4 < dt < 2.0, dt  # 4 MiB at 8 MiB/s: 0.5 s
        assert link.bytes[1] >= len(value)
        link.rate = 64 << 20
        t = time.perf_counter()
        assert client.get("k") == value
        assert time.perf_counter() - t < dt / 2
        link.cut()
        with pytest.raises(redis.exceptions.ConnectionError):
            client.get("k")


def test_an_idle_connection_stays_open(redis_server):
    """A slow link is not a lossy one: a connection idle for longer than the proxy's connect timeout
    (5 s) still carries the next command (the proxy once dropped it, so a pooled client's next
    lookup could race a reset)."""
    with ThrottledLink(redis_server.port, rate=8 << 20) as link:
        with socket.create_connection(("127.0.0.1", link.port), timeout=10) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(16) == b"+PONG\r\n"
            time.sleep(5.5)
            s.sendall(b"PING\r\n")
            assert s.recv(16) == b"+PONG\r\n"
