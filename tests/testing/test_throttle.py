"""The throttled link in front of a real Redis server: bytes pass unchanged at the set rate, and a
cut link fails its clients (what the connector's fault tests and remote_prefix benchmark rely on)."""

from __future__ import annotations

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
