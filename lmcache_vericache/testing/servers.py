"""Real cache servers for tests, benchmarks and scripts, started on 127.0.0.1 on a free port and
stopped by PID:

* ``redis-server``/``valkey-server`` with no persistence (``--save "" --appendonly no``);
  :func:`redis_binary` raises :class:`ServerUnavailable`, with the reason, when neither binary is
  installed (CI installs ``redis-server`` from apt);
* a Redis/Valkey Cluster of such servers, 3 masters + 3 replicas (:class:`RedisClusterProcesses`);
* LMCache's own server (``python -m lmcache.v1.server 127.0.0.1 PORT cpu``);
* LMCache's MP ``lmcache server`` with this package's L2 adapter (:class:`LMCacheServer`).

No pytest here: the pytest fixtures that start these servers (and skip a test where one cannot
run) are in :mod:`.fixtures`.
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
from pathlib import Path

BINARIES = ("redis-server", "valkey-server")
CLIS = {"redis-server": "redis-cli", "valkey-server": "valkey-cli"}


class ServerUnavailable(RuntimeError):
    """A server this host cannot start (its binary is not installed); the message says what is
    missing. The test fixtures turn it into a skip."""


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


def redis_binary() -> str:
    """:func:`server_binary`, or :class:`ServerUnavailable` where neither binary is on PATH."""
    binary = server_binary()
    if binary is None:
        raise ServerUnavailable(
            f"no Redis/Valkey server binary ({' or '.join(BINARIES)}) on PATH; apt-get install redis-server")
    return binary


def _cluster_ports(n: int) -> list[int]:
    """``n`` free ports whose cluster bus ports (port + 10000, fixed before Redis 7) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port + 10000 > 65535 or {port - 10000, port, port + 10000} & set(ports):
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        ports.append(port)
    return ports


class RedisClusterProcesses:
    """A local Redis/Valkey Cluster on 127.0.0.1: ``masters`` masters with ``replicas`` replicas each,
    one ``redis-server --cluster-enabled yes`` process per node, joined by ``redis-cli --cluster create``.

    Nodes run without persistence but keep their ``nodes-PORT.conf`` in a private temp directory, so
    :meth:`restart` brings a killed node back with its cluster identity (a master that was failed
    over rejoins as a replica of its promoted replica). Server settings beyond the defaults:

    * ``cluster-node-timeout`` (``node_timeout_ms``, 1 s): a dead master is failed over in ~2 s;
    * ``cluster-require-full-coverage no``: the masters that are alive keep serving their slots
      while a dead master's slots are down (the recommended setting for a cache);
    * ``cluster-replica-validity-factor 0``: a replica may take over however long its master has
      been gone (a test may hold a failover back with :meth:`hold_failovers`).

    ``startup_urls`` (``redis://127.0.0.1:PORT`` of every master) and ``url`` (comma-joined, the
    ``redis_cluster_urls`` value) locate the cluster. Everything is stopped by PID in :meth:`stop`.
    """

    def __init__(self, binary: str, cli: str, *, masters: int = 3, replicas: int = 1,
                 node_timeout_ms: int = 1000, timeout: float = 30.0) -> None:
        self.binary, self.cli, self.node_timeout_ms = binary, cli, node_timeout_ms
        self.replicas = replicas
        self._dir = tempfile.mkdtemp(prefix="vericache-cluster-")
        self.procs: dict[int, subprocess.Popen] = {}
        self._clients: dict[int, object] = {}
        self.ports = _cluster_ports(masters * (1 + replicas))
        try:
            for port in self.ports:
                self._spawn(port)
            for port in self.ports:
                self._wait_ping(port, timeout)
            addrs = [f"127.0.0.1:{p}" for p in self.ports]
            out = subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", str(replicas),
                                  "--cluster-yes"], capture_output=True, text=True, timeout=timeout)
            if out.returncode != 0:
                raise RuntimeError(f"{cli} --cluster create failed ({out.returncode}): {out.stdout[-2000:]}"
                                   f"{out.stderr[-2000:]}")
            self.wait_ok(timeout)
            self.wait_replicas_linked(timeout)
        except BaseException:
            self.stop()
            raise

    # -- processes ----------------------------------------------------------------------------------
    def _spawn(self, port: int) -> None:
        cmd = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
               "--cluster-config-file", os.path.join(self._dir, f"nodes-{port}.conf"),
               "--cluster-node-timeout", str(self.node_timeout_ms),
               "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0",
               "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0", "--dir", self._dir,
               "--daemonize", "no",
               "--loglevel", "warning", "--logfile", os.path.join(self._dir, f"redis-{port}.log")]
        self.procs[port] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _wait_ping(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[port].poll() is not None:
                raise RuntimeError(f"{self.binary} on port {port} exited with {self.procs[port].returncode}: "
                                   f"{self.log(port)[-2000:]}")
            try:
                if self.client(port).ping():
                    return
            except OSError:
                pass
            except Exception:  # redis.ConnectionError while it starts
                pass
            time.sleep(0.02)
        raise RuntimeError(f"{self.binary} on port {port} not ready after {timeout} s")

    def log(self, port: int) -> str:
        try:
            return Path(self._dir, f"redis-{port}.log").read_text(errors="replace")
        except OSError:
            return ""

    def alive(self, port: int) -> bool:
        return port in self.procs and self.procs[port].poll() is None

    def pid(self, port: int) -> int:
        return self.procs[port].pid

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port``, as a crashed host would (no failover is triggered here: the
        other nodes notice after ``cluster-node-timeout``)."""
        proc = self.procs[port]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def restart(self, port: int, timeout: float = 10.0) -> None:
        """Start the killed node on ``port`` again with its ``nodes-PORT.conf`` (its data is gone)."""
        if self.alive(port):
            raise RuntimeError(f"node {port} is running")
        self._spawn(port)
        self._wait_ping(port, timeout)

    def stop(self) -> None:
        for client in self._clients.values():
            client.close()  # type: ignore[attr-defined]
        for proc in self.procs.values():
            stop_process(proc, grace=5)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- cluster state --------------------------------------------------------------------------------
    def client(self, port: int):
        """A plain (non-cluster) client of one node, for admin commands; ``CLUSTER INFO`` and
        ``CLUSTER NODES`` replies are left raw (bytes, as the server wrote them)."""
        import redis

        if port not in self._clients:
            r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=1)
            for command in ("CLUSTER INFO", "CLUSTER NODES"):
                r.response_callbacks.pop(command, None)
            self._clients[port] = r
        return self._clients[port]

    @property
    def startup_urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{p}" for p in self.masters()]

    @property
    def url(self) -> str:
        return ",".join(self.startup_urls)

    def nodes(self) -> list[dict]:
        """``{"port", "pid", "role" ("master"/"replica"), "master" (port of its master or None),
        "alive", "slots" (count)}`` of every node, as a live node sees the cluster."""
        for port in self.procs:
            if not self.alive(port):
                continue
            try:
                raw = self.client(port).execute_command("CLUSTER NODES")
            except Exception:
                continue
            lines = [line.split() for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines()]
            ids = {f[0]: int(f[1].split("@")[0].rsplit(":", 1)[1]) for f in lines}
            out = []
            for f in lines:
                p = ids[f[0]]
                slots = sum(int(r.split("-")[-1]) - int(r.split("-")[0]) + 1 for r in f[8:] if not r.startswith("["))
                out.append({"port": p, "pid": self.procs[p].pid if p in self.procs else None,
                            "role": "master" if "master" in f[2] else "replica",
                            "master": ids.get(f[3]), "alive": self.alive(p), "slots": slots})
            return sorted(out, key=lambda n: n["port"])
        raise RuntimeError("no live cluster node answers CLUSTER NODES")

    def masters(self) -> list[int]:
        """Ports of the masters that own slots (a dead one too, until its replica takes over)."""
        return [n["port"] for n in self.nodes() if n["role"] == "master" and n["slots"]]

    def owner(self, slot: int) -> int:
        """Port of the master that owns hash slot ``slot``, as a live node sees it."""
        live = next(p for p in self.procs if self.alive(p))
        for first, last, master, *_ in self.client(live).execute_command("CLUSTER SLOTS"):
            if int(first) <= slot <= int(last):
                return int(master[1])
        raise KeyError(f"slot {slot} is not assigned")

    def replicas_of(self, port: int) -> list[int]:
        return [n["port"] for n in self.nodes() if n["master"] == port]

    def _slots_owners(self, port: int) -> dict[int, int]:
        """``{first slot: owner port}`` of every slot range, as the node on ``port`` sees it."""
        return {int(r[0]): int(r[2][1]) for r in self.client(port).execute_command("CLUSTER SLOTS")}

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok``, agrees on the slot owners, and every
        slot is owned by a live master (so after a kill this waits for the failover)."""
        deadline, why = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            try:
                live = [p for p in self.procs if self.alive(p)]
                infos = [self.client(p).execute_command("CLUSTER INFO") for p in live]
                views = [self._slots_owners(p) for p in live]
                covered = sum(int(r[1]) - int(r[0]) + 1
                              for r in self.client(live[0]).execute_command("CLUSTER SLOTS"))
                if all(b"cluster_state:ok" in i for i in infos) and all(v == views[0] for v in views) \
                        and covered == 16384 and all(self.alive(o) for o in views[0].values()):
                    return
                states = [i.split(b"\r\n")[0].decode() for i in infos]
                why = f"states {states}, owners {sorted(set(views[0].values()))}"
            except Exception as e:
                why = repr(e)
            time.sleep(0.05)
        raise TimeoutError(f"cluster not ok after {timeout} s: {why}")

    def wait_replicas_linked(self, timeout: float = 30.0) -> None:
        """Until every slot-owning master has its replicas in the cluster's view (gossip spreads the
        roles after ``--cluster create``: a replica may still show as a slotless master) and every
        live replica has a live link to its master (initial sync done)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = self.nodes()
            infos = [self.client(n["port"]).info("replication") for n in nodes if n["role"] == "replica" and n["alive"]]
            owners = [n["port"] for n in nodes if n["role"] == "master" and n["slots"]]
            if (all(len([r for r in nodes if r["master"] == m]) >= self.replicas for m in owners)
                    and all(i.get("master_link_status") == "up" for i in infos)):
                return
            time.sleep(0.05)
        raise TimeoutError(f"replicas not linked to their masters after {timeout} s")

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """Until every live replica has applied everything its master has written so far (writes
        reach replicas asynchronously: do this before killing a master whose data must survive)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            behind = []
            for n in self.nodes():
                if n["role"] != "master" or not n["alive"]:
                    continue
                info = self.client(n["port"]).info("replication")
                target = info["master_repl_offset"]
                for r in self.replicas_of(n["port"]):
                    if self.alive(r) and self.client(r).info("replication").get("slave_repl_offset", -1) < target:
                        behind.append(r)
            if not behind:
                return
            time.sleep(0.02)
        raise TimeoutError(f"replicas {behind} still behind their masters after {timeout} s")

    def hold_failovers(self, hold: bool = True) -> None:
        """``cluster-replica-no-failover`` on every live node: while held, a dead master's slots stay
        down (its replica does not take over); releasing lets the replica take over on its own."""
        for port in self.procs:
            if self.alive(port):
                self.client(port).config_set("cluster-replica-no-failover", "yes" if hold else "no")


def cluster_binaries() -> tuple[str, str]:
    """The server binary and its ``*-cli`` (which creates the cluster), the arguments of
    :class:`RedisClusterProcesses`; :class:`ServerUnavailable` where either is missing."""
    binary = redis_binary()
    cli = shutil.which(CLIS[Path(binary).name])
    if cli is None:
        raise ServerUnavailable(f"{CLIS[Path(binary).name]} not on PATH (needed to create a Redis Cluster)")
    return binary, cli


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
