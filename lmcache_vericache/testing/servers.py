"""Real cache servers for tests and benchmarks, started on 127.0.0.1 on a free port and stopped by PID:

* ``redis-server``/``valkey-server`` with no persistence (``--save "" --appendonly no``); skipped,
  with the reason, when neither binary is installed (CI installs ``redis-server`` from apt);
* LMCache's own server (``python -m lmcache.v1.server 127.0.0.1 PORT cpu``);
* LMCache's MP ``lmcache server`` with this package's L2 adapter (:class:`LMCacheServer`).

The pytest fixtures (``redis_server``, ``redis_server_factory``, ``lm_server``) are re-exported by
the top-level ``tests/conftest.py``; benchmarks use the classes directly. Imports ``pytest``: needs
the ``dev`` extra.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

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


def stop_process(proc: subprocess.Popen, *, grace: float, group: bool = False) -> None:
    """SIGTERM (to the process group with ``group``), then SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    kill = os.killpg if group else os.kill
    kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


class ServerProcess:
    """A server process owned by the test that started it; ``ready`` probes one connection."""

    url_scheme = ""

    def __init__(self, cmd: list[str], port: int, timeout: float = 10.0) -> None:
        self.port = port
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}: {err[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    if self.ready(s):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{cmd[0]} on port {port} not ready after {timeout} s")

    def ready(self, s: socket.socket) -> bool:
        return True

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """Die abruptly (SIGKILL), as a crashed server would."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        stop_process(self.proc, grace=5)
        if self.proc.stderr:
            self.proc.stderr.close()


class RedisServer(ServerProcess):
    def __init__(self, binary: str, port: int | None = None) -> None:
        port = port or free_port()
        self.url = f"redis://127.0.0.1:{port}/0"
        self._dir = tempfile.mkdtemp(prefix="vericache-redis-")
        super().__init__([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                          "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning"], port)

    def ready(self, s: socket.socket) -> bool:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self._dir, ignore_errors=True)


class LMServer(ServerProcess):
    """LMCache's ``lm://`` cache server (in-memory, CPU)."""

    def __init__(self, port: int | None = None) -> None:
        port = port or free_port()
        self.url = f"lm://127.0.0.1:{port}"
        # importing lmcache takes seconds on a busy 2-core machine
        super().__init__([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"], port, timeout=120)


def _redis_binary_or_skip() -> str:
    binary = server_binary()
    if binary is None:
        pytest.skip(f"no Redis/Valkey server binary ({' or '.join(BINARIES)}) on PATH; apt-get install redis-server")
    return binary


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start as many servers as a test needs (``start(port=None)``; a given port restarts a
    killed server in place); all are stopped at teardown."""
    binary = _redis_binary_or_skip()
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
    server = RedisServer(_redis_binary_or_skip())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def lm_server() -> Iterator[LMServer]:
    """One LMCache server shared by the tests of a module (tests use distinct namespaces)."""
    server = LMServer()
    yield server
    server.stop()


# -- LMCache's MP ``lmcache server`` with this package's L2 adapter ---------------------------------

L2_SPEC = Path(__file__).parents[2] / "configs" / "lmcache-server-l2.json"  # the repository's configs/


def shipped_spec(**params: object) -> dict:
    """The shipped ``--l2-adapter`` JSON with ``adapter_params`` overridden."""
    spec = json.loads(L2_SPEC.read_text())
    spec["adapter_params"].update(params)
    return spec


class LMCacheServer:
    """``lmcache server`` with the VeriCache adapter, in its own process group; stopped by PID."""

    def __init__(self, spec: dict, log: Path, *, chunk_size: int = 256, skip_l1: bool = False) -> None:
        from lmcache_vericache.cli.lmcache_config import server_argv

        self.port, self.http_port, self.log = free_port(), free_port(), log
        argv = server_argv(spec, port=self.port, http_port=self.http_port, chunk_size=chunk_size,
                           l1_size_gb=0.25, skip_l1=skip_l1)  # fmt: skip
        argv[0] = str(Path(sys.executable).with_name("lmcache"))
        env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_DISABLE_BANNER": "1"}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self, timeout: float = 90.0) -> LMCacheServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"lmcache server exited with {self.proc.returncode}:\n{self.output()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthcheck", timeout=1):
                    return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"lmcache server not ready after {timeout} s:\n{self.output()[-3000:]}")

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=10) as r:
            return json.load(r)

    def adapter_status(self) -> dict:
        adapters = self.status()["storage_manager"]["l2_adapters"]
        return next(a for a in adapters if a.get("type") == "VeriCacheL2Adapter")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc, grace=20, group=True)  # its own session: workers go too
