"""Real Redis/Valkey servers for tests: started on 127.0.0.1 on a free port, no persistence,
stopped by PID. Skips (with the reason) when neither ``redis-server`` nor ``valkey-server`` is
installed (CI installs ``redis-server`` from apt).

Use from any test directory: ``from tests.servers import redis_server, redis_server_factory``
(or re-export them from a ``conftest.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest

BINARIES = ("redis-server", "valkey-server")


def server_binary() -> str | None:
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server``/``valkey-server`` process owned by the test that started it."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="vericache-redis-")
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._wait_ready()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis server exited with {self.proc.returncode}: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis server on port {self.port} not ready after {timeout} s")

    def kill(self) -> None:
        """Die abruptly (SIGKILL), as a crashed server would."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start as many servers as a test needs (``start(port=None)``; a given port restarts a
    killed server in place); all are stopped at teardown."""
    binary = server_binary()
    if binary is None:
        pytest.skip(f"no Redis/Valkey server binary ({' or '.join(BINARIES)}) on PATH; apt-get install redis-server")
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
    binary = server_binary()
    if binary is None:
        pytest.skip(f"no Redis/Valkey server binary ({' or '.join(BINARIES)}) on PATH; apt-get install redis-server")
    server = RedisServer(binary)
    yield server
    server.stop()
