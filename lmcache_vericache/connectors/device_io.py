"""How chunks cross between host memory and the device of vLLM's paged KV, and in what order.

:class:`DeviceIO` is the ordering contract :class:`~.paged_transfer.PagedTransfer` relies on:

* :meth:`~DeviceIO.mark`, on vLLM's worker thread when a load is started: a marker of the work
  enqueued so far on the compute stream (the last users of the blocks the load will write).
* :meth:`~DeviceIO.load`, on a load thread: ``write`` (the scatter into the blocks) runs on the
  device only after the marked work, on the chunk copied to the device; the returned
  :class:`Pending` is ``ready()`` only once that write has completed there, so a request reported
  finished (``get_finished``) never runs over half-written blocks. ``full`` may be reused once
  ``load`` returns.
* :meth:`~DeviceIO.save`, on vLLM's worker thread right after the forward: ``gather`` runs after the
  forward's writes; the :class:`HostCopy` it returns holds the chunk in host memory once
  :meth:`HostCopy.result` returns (the writer thread waits there before ``put``), until
  :meth:`HostCopy.release`. ``None``: no host memory free now (the caller drops the save).

:class:`CpuIO` (vLLM's CPU backend) does everything synchronously on the calling thread.
:class:`CudaIO` copies through a bounded pinned host pool (the package's one
:class:`~lmcache_vericache.engine.pinned_pool.PinnedPool`) on its own load and
save streams, with an event per copy; it reaches the device only through :class:`StreamOps`
(:class:`TorchCuda` on a GPU; tests drive it with a recording fake).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..engine.pinned_pool import PinnedPool

Tensor = torch.Tensor


class StreamOps(ABC):
    """The stream, event and copy primitives :class:`CudaIO` uses; thread-safe as CUDA's are."""

    @abstractmethod
    def new_stream(self) -> Any: ...

    @abstractmethod
    def current_stream(self) -> Any: ...

    @abstractmethod
    def use(self, stream: Any) -> contextlib.AbstractContextManager: ...

    @abstractmethod
    def record(self, stream: Any) -> Any:
        """A new event recorded on ``stream``."""

    @abstractmethod
    def wait(self, stream: Any, event: Any) -> None:
        """Later work on ``stream`` waits for ``event`` (on the device; the host does not block)."""

    @abstractmethod
    def query(self, event: Any) -> bool: ...

    @abstractmethod
    def synchronize(self, event: Any) -> None: ...

    @abstractmethod
    def pinned(self, nbytes: int) -> Tensor:
        """A page-locked host buffer of ``nbytes`` (uint8)."""

    @abstractmethod
    def h2d(self, host: Tensor) -> Tensor:
        """A device copy of pinned ``host``, non-blocking on the current stream."""

    @abstractmethod
    def d2h(self, host: Tensor, dev: Tensor) -> None:
        """Copy ``dev`` into pinned ``host``, non-blocking on the current stream."""

    @abstractmethod
    def keep(self, dev: Tensor, stream: Any) -> None:
        """``dev`` (allocated on another stream) is not reused before the work enqueued on ``stream``
        so far completed, although the caller drops it now (the caching allocator's stream use)."""


class TorchCuda(StreamOps):
    """:class:`StreamOps` of ``torch.cuda`` on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def pinned(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def h2d(self, host: Tensor) -> Tensor:
        return host.to(self.device, non_blocking=True)

    def d2h(self, host: Tensor, dev: Tensor) -> None:
        host.copy_(dev, non_blocking=True)

    def keep(self, dev: Tensor, stream: Any) -> None:
        dev.record_stream(stream)


class Pending:
    """Device work in flight: ``ready()`` once it completed (``event`` ``None``: already done)."""

    def __init__(self, ops: StreamOps | None = None, event: Any = None) -> None:
        self._ops, self._event = ops, event

    def ready(self) -> bool:
        return self._event is None or self._ops.query(self._event)  # type: ignore[union-attr]


class HostCopy:
    """A saved chunk on its way to host memory (see :class:`DeviceIO`)."""

    def __init__(self, host: Tensor, wait: Callable[[], None] = lambda: None,
                 release: Callable[[], None] = lambda: None, drop: Callable[[], None] | None = None) -> None:
        self._host, self._wait, self._release = host, wait, release
        self._drop = drop

    def result(self) -> Tensor:
        """The chunk in host memory, after its copy completed (blocks until then)."""
        self._wait()
        self._wait = lambda: None
        return self._host

    def release(self) -> None:
        """Hand the host memory back (after ``put`` copied it). Waits for the copy first: the slab
        must outlive it."""
        self.result()
        self._release()

    def drop(self) -> None:
        """Hand the host memory back unread, without waiting on the calling thread (vLLM's, when a
        save is dropped): it is lent again once the copy completed."""
        if self._drop is None:
            self.release()
        else:
            self._drop()


class DeviceIO(ABC):
    """Host <-> device ordering for the connector's loads and saves (module docstring)."""

    def mark(self) -> Any:
        return None

    @abstractmethod
    def load(self, full: Tensor, after: Any, write: Callable[[Tensor], None]) -> Pending: ...

    @abstractmethod
    def save(self, gather: Callable[[], Tensor]) -> HostCopy | None: ...


class CpuIO(DeviceIO):
    """vLLM's CPU backend: the cache is host memory; every call completes before it returns."""

    def load(self, full: Tensor, after: Any, write: Callable[[Tensor], None]) -> Pending:
        write(full)
        return Pending()

    def save(self, gather: Callable[[], Tensor]) -> HostCopy | None:
        return HostCopy(gather())  # gather copies: the blocks may be reused after this step


class CudaIO(DeviceIO):
    """Loads and saves on their own streams through a pinned pool of ``pool_bytes`` in slabs of one
    chunk (``chunk_bytes``); a load waits up to ``wait_s`` for a slab, a save never waits."""

    def __init__(self, ops: StreamOps, chunk_bytes: int, pool_bytes: int, wait_s: float) -> None:
        slabs = pool_bytes // chunk_bytes
        if slabs < 1:
            raise ValueError(f"pinned_pool_bytes = {pool_bytes} holds no chunk of this rank ({chunk_bytes} "
                             "bytes): raise it or lower chunk_size")
        self.ops, self.wait_s = ops, wait_s
        self.pool = PinnedPool(chunk_bytes, slabs, alloc=ops.pinned, ready=ops.query)
        self.load_stream, self.save_stream = ops.new_stream(), ops.new_stream()

    @contextlib.contextmanager
    def _on(self, stream: Any, after: Any) -> Iterator[None]:
        with self.ops.use(stream):
            if after is not None:
                self.ops.wait(stream, after)
            yield

    def mark(self) -> Any:
        return self.ops.record(self.ops.current_stream())

    def load(self, full: Tensor, after: Any, write: Callable[[Tensor], None]) -> Pending:
        slab, host = self.pool.stage(full, self.wait_s)
        try:
            with self._on(self.load_stream, after):
                write(self.ops.h2d(host))  # the device copy lives on the load stream until written
                event = self.ops.record(self.load_stream)
        except BaseException:
            self._free_after(slab, self.load_stream)
            raise
        self.pool.release(slab, after=event)
        return Pending(self.ops, event)

    def _free_after(self, slab: int, stream: Any) -> None:
        """A failed copy's slab: free once what was enqueued on ``stream`` completed (an upload may
        have been enqueued before the error), never at once."""
        try:
            self.pool.release(slab, after=self.ops.record(stream))
        except BaseException:  # no event to wait for (the device failed): the slab stays out
            pass

    def save(self, gather: Callable[[], Tensor]) -> HostCopy | None:
        slab = self.pool.acquire(0)
        if slab is None:
            return None
        try:
            dev = gather()  # on the compute stream, after the forward
            with self._on(self.save_stream, self.mark()):
                host = self.pool.view(slab, dev.shape, dev.dtype)
                self.ops.d2h(host, dev)
                self.ops.keep(dev, self.save_stream)  # the gathered chunk freed once copied, not once put
                event = self.ops.record(self.save_stream)
        except BaseException:
            self._free_after(slab, self.save_stream)
            raise
        return HostCopy(host, lambda: self.ops.synchronize(event), lambda: self.pool.release(slab),
                        drop=lambda: self.pool.release(slab, after=event))
