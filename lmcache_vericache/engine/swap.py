"""The background swap-in of a request's full prefix KV.

The full prefix KV lives between verifications in the project's :class:`~lmcache_vericache.backends.
DualTierStore` (one checksummed full-chunk format, one disk tier, one store); anything with the
:class:`Source` shape fits. Chunks are in LMCache's ``KV_2LTD`` layout ``[2, layers, tokens,
kv_heads*head_dim]``.

:class:`SwapIn` runs one round's swap on a background thread: it asks the source for the chunks and
copies each into the request's preallocated verify buffer as it arrives. The engine starts it when
the round starts (a stored prefix's first round: right after the request's set-up) and waits for it
just before verifying, so the copy hides behind drafting (and the later requests' set-ups).
On CUDA each chunk goes through a :class:`PinnedPool` buffer (pinned host memory reused across
rounds: pinning per chunk costs more than the copy) and a non-blocking host-to-device copy on the
pool's side stream; an event recorded after the last chunk is what the verify waits for (the compute
stream waits on it; the host does not).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Protocol

import torch

from ..workers import torch_serial
from .cache import KVCache

Tensor = torch.Tensor


class Handle(Protocol):
    def wait(self, i: int | None = None, timeout: float | None = None): ...  # chunk i: Tensor | None (miss)
    def cancel(self) -> None: ...


class Source(Protocol):
    def prefetch(self, keys: list[str]) -> Handle: ...


_SWAP_POOL = ThreadPoolExecutor(2, thread_name_prefix="vericache-swap", initializer=torch_serial)


class PinnedPool:
    """At most ``buffers`` host buffers (pinned where ``pin``), reused across rounds and requests,
    and the side ``stream`` the swaps copy on (CUDA, on ``device``: the device the copies write to,
    else events recorded on the stream would not cover them; ``None`` elsewhere).

    Ownership and threading: the pool owns its buffers; any thread may :meth:`take` one, which
    blocks while all are lent. :meth:`give` hands one back with the ``event`` of the copy reading
    it; the buffer is lent again only after that event completes (the copy is asynchronous)."""

    def __init__(self, buffers: int = 4, pin: bool = True, stream=None, device: torch.device | str | None = None):
        if buffers < 1:
            raise ValueError(f"buffers must be >= 1, got {buffers}")
        self.size, self.pin = buffers, pin
        self.stream = stream if stream is not None or not pin else torch.cuda.Stream(device=device)
        self._free: deque[tuple[Tensor, object]] = deque()  # (buffer, event of its last copy)
        self._made = 0
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> Tensor:
        """A buffer of at least ``nbytes`` bytes (uint8), free of any copy still reading it."""
        with self._cond:
            while not self._free and self._made >= self.size:
                self._cond.wait()
            if self._free:
                buf, event = self._free.popleft()
            else:
                self._made += 1
                buf, event = torch.empty(0, dtype=torch.uint8), None
        if event is not None:
            event.synchronize()
        if buf.numel() < nbytes:  # chunks of one engine have one size: this happens once per buffer
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return buf

    def give(self, buf: Tensor, event=None) -> None:
        with self._cond:
            self._free.append((buf, event))
            self._cond.notify()

    def stage(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """``(buffer, copy)``: ``kv`` copied into a buffer of the pool, viewed in its dtype and shape
        (the caller gives the buffer back)."""
        nbytes = kv.numel() * kv.element_size()
        buf = self.take(nbytes)
        view = buf[:nbytes].view(kv.dtype).view(kv.shape)
        view.copy_(kv)
        return buf, view


class SwapIn:
    """One round's swap of ``keys`` into ``cache`` entries ``[i*chunk, (i+1)*chunk)`` (base 0)."""

    def __init__(self, source: Source, keys: list[str], cache: KVCache, chunk_size: int,
                 pool: PinnedPool | None = None):
        self.nbytes = 0
        self.seconds = 0.0
        self.misses: list[int] = []
        self._cache, self._chunk = cache, chunk_size
        self._stream = None
        if cache.k.is_cuda:
            self._pool = pool if pool is not None else PinnedPool(1, device=cache.k.device)
            self._stream = self._pool.stream
            # The side stream must not copy before the compute stream's earlier work on these
            # buffers (the NaN poisoning, a previous verify still reading them) has run.
            self._stream.wait_stream(torch.cuda.current_stream(cache.k.device))
        self._event: torch.cuda.Event | None = None
        self._handle = source.prefetch(keys)
        self._n = len(keys)
        self._future = _SWAP_POOL.submit(self._run)

    def _run(self) -> None:
        t0 = time.perf_counter()
        for i in range(self._n):  # copy each chunk as soon as it is read, in order
            kv = self._handle.wait(i)
            if not self._cache.fits_chunk(kv, self._chunk):
                self.misses.append(i)
                continue
            if self._stream is not None:
                buf, staged = self._pool.stage(kv)
                with torch.cuda.stream(self._stream):
                    self._cache.load_2ltd(i * self._chunk, staged)  # non-blocking from pinned memory
                    done = torch.cuda.Event()
                    done.record(self._stream)
                self._pool.give(buf, done)  # lent again once this copy has read it
            else:
                self._cache.load_2ltd(i * self._chunk, kv)
            self.nbytes += kv.numel() * kv.element_size()
        if self._stream is not None:
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
            self._event.synchronize()  # so that ``done`` and ``seconds`` mean the bytes are in place
        self.seconds = time.perf_counter() - t0

    @property
    def done(self) -> bool:
        """Every chunk is in place or known missing (``wait`` will not block on I/O)."""
        return self._future.done()

    def wait(self) -> list[int]:
        """Block until every chunk is in place; returns the indices of missed chunks."""
        self._future.result()
        if self._event is not None:
            torch.cuda.current_stream(self._cache.k.device).wait_event(self._event)
        return self.misses

    def cancel(self) -> None:
        """Drop the reads not yet started and return once nothing writes into the cache any more
        (reads in flight finish; their chunks are still copied). Never raises."""
        self._handle.cancel()
        if not self._future.cancel():
            wait_futures([self._future])  # ends soon: the rest of its reads are misses; CUDA copies synced
