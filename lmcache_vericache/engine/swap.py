"""The background swap-in of a request's full prefix KV.

The full prefix KV lives between verifications in the project's :class:`~lmcache_vericache.backends.
DualTierStore` (one checksummed full-chunk format, one disk tier, one store); anything with the
:class:`Source` shape fits. Chunks are in LMCache's ``KV_2LTD`` layout ``[2, layers, tokens,
kv_heads*head_dim]``.

:class:`SwapIn` runs one round's swap on a background thread: it asks the source for the chunks and
copies each into the request's preallocated verify buffer as it arrives. The engine starts it when
the round starts (a stored prefix's first round: right after the request's set-up) and waits for it
just before verifying, so the copy hides behind drafting (and the later requests' set-ups).
On CUDA each chunk goes through a slab of the one pinned pool (:class:`Staging`: pinned host memory
reused across rounds) and a non-blocking host-to-device copy on its side stream; an event recorded after the last chunk is what the verify waits for (the compute
stream waits on it; the host does not).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..workers import torch_serial
from .cache import KVCache
from .pinned_pool import PinnedPool

Tensor = torch.Tensor


class Handle(Protocol):
    def wait(self, i: int | None = None, timeout: float | None = None): ...  # chunk i: Tensor | None (miss)
    def cancel(self) -> None: ...


class Source(Protocol):
    def prefetch(self, keys: list[str]) -> Handle: ...


_SWAP_POOL = ThreadPoolExecutor(2, thread_name_prefix="vericache-swap", initializer=torch_serial)


@dataclass
class Staging:
    """What the swaps of a CUDA engine copy through: slabs of the one pinned pool (:mod:`.pinned_pool`)
    and the side ``stream`` the copies run on (on the device they write to, else events recorded on
    it would not cover them)."""

    pool: PinnedPool
    stream: Any

    @classmethod
    def on(cls, device: torch.device | str, slab_bytes: int, slabs: int = 4) -> Staging:
        return cls(PinnedPool(slab_bytes, slabs), torch.cuda.Stream(device=device))


class SwapIn:
    """One round's swap of ``keys`` into ``cache`` entries ``[i*chunk, (i+1)*chunk)`` (base 0)."""

    def __init__(self, source: Source, keys: list[str], cache: KVCache, chunk_size: int,
                 staging: Staging | None = None):
        self.nbytes = 0
        self.seconds = 0.0
        self.misses: list[int] = []
        self._cache, self._chunk = cache, chunk_size
        self._stream = None
        if cache.k.is_cuda:
            k = cache.k  # [layers, heads, entries, head_dim]: a chunk is 2 x layers x chunk_size x heads x head_dim
            chunk_bytes = 2 * k.shape[0] * chunk_size * k.shape[1] * k.shape[3] * k.element_size()
            self._staging = staging or Staging.on(k.device, chunk_bytes, slabs=1)
            self._stream = self._staging.stream
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
                slab, staged = self._staging.pool.stage(kv)
                done = None
                try:
                    with torch.cuda.stream(self._stream):
                        # The chunk crosses whole and contiguous from the pinned slab (non-blocking);
                        # load_2ltd's transposed write then runs on the device. Handing it the slab's
                        # view would make torch stage a pageable contiguous copy on the host first.
                        dev = staged.to(self._cache.k.device, non_blocking=True)
                        self._cache.load_2ltd(i * self._chunk, dev)
                finally:  # also on an error: the slab is lent again once what was enqueued has read it
                    with torch.cuda.stream(self._stream):
                        done = torch.cuda.Event()
                        done.record(self._stream)
                    self._staging.pool.release(slab, after=done)
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
