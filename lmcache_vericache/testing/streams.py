"""A recording fake of :class:`~lmcache_vericache.connectors.device_io.StreamOps` for tests of
stream and event ordering on a machine without a GPU: the "device" is the CPU, every operation is
logged as ``(op, stream, detail)``, and events complete only when the test says so (or when the host
synchronizes on one), so "used before the device finished" cannot pass by luck."""

from __future__ import annotations

import contextlib
import threading

import torch

from ..connectors.device_io import StreamOps


class Event:
    def __init__(self, name: str) -> None:
        self.name, self.done = name, False


class FakeStreams(StreamOps):
    """Records every operation as ``(op, stream, detail)``; the "device" is the CPU."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.events: list[Event] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._n = 0

    def note(self, op: str, detail: str = "") -> None:
        with self._lock:
            self.log.append((op, self.current_stream(), detail))

    def new_stream(self) -> str:
        self._n += 1
        return f"side{self._n}"

    def current_stream(self) -> str:
        return getattr(self._local, "stream", "compute")

    @contextlib.contextmanager
    def use(self, stream: str):
        prev, self._local.stream = self.current_stream(), stream
        try:
            yield
        finally:
            self._local.stream = prev

    def record(self, stream: str) -> Event:
        with self._lock:
            ev = Event(f"e{len(self.events)}")
            self.events.append(ev)
            self.log.append(("record", stream, ev.name))
        return ev

    def wait(self, stream: str, event: Event) -> None:
        self.note("wait", event.name)

    def query(self, event: Event) -> bool:
        return event.done

    def synchronize(self, event: Event) -> None:
        self.note("sync", event.name)
        event.done = True

    def complete(self) -> None:
        for ev in self.events:
            ev.done = True

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def h2d(self, host: torch.Tensor) -> torch.Tensor:
        self.note("h2d")
        return host.clone()

    def d2h(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        self.note("d2h")
        host.copy_(dev)

    def keep(self, dev: torch.Tensor, stream: str) -> None:
        self.note("keep", stream)

    def ops(self, *names: str) -> list[tuple[str, str, str]]:
        return [e for e in self.log if e[0] in names]
