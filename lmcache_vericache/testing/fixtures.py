"""The pytest fixtures that start real servers (:mod:`.servers`) for a test and stop them at its
teardown; a test whose server cannot run here (no binary) is skipped with the reason. Imported by
the top-level ``tests/conftest.py``; the only module of this package that imports pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from .servers import (
    LMServer,
    RedisClusterProcesses,
    RedisServer,
    ServerUnavailable,
    cluster_binaries,
    redis_binary,
)

T = TypeVar("T")


def _or_skip(find: Callable[[], T]) -> T:
    try:
        return find()
    except ServerUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start as many servers as a test needs (``start(port=None)``; a given port restarts a
    killed server in place); all are stopped at teardown."""
    binary = _or_skip(redis_binary)
    started: list[RedisServer] = []

    def start(port: int | None = None) -> RedisServer:
        started.append(RedisServer(binary, port))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One server shared by the tests of a module (tests use distinct key prefixes)."""
    server = RedisServer(_or_skip(redis_binary))
    yield server
    server.stop()


def _cluster() -> Iterator[RedisClusterProcesses]:
    cluster = RedisClusterProcesses(*_or_skip(cluster_binaries))
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster() -> Iterator[RedisClusterProcesses]:
    """A fresh local cluster, 3 masters + 3 replicas, for one test (it may kill and restart nodes);
    all processes are stopped at teardown."""
    yield from _cluster()


@pytest.fixture(scope="module")
def shared_redis_cluster() -> Iterator[RedisClusterProcesses]:
    """One cluster shared by the tests of a module that leave its nodes alone (tests use distinct
    key prefixes)."""
    yield from _cluster()


@pytest.fixture(scope="module")
def lm_server() -> Iterator[LMServer]:
    """One LMCache server shared by the tests of a module (tests use distinct namespaces)."""
    server = LMServer()
    yield server
    server.stop()
