"""The one pool of pinned host memory that chunks cross between host and device through: the engine's
swap-ins (:mod:`.swap`) and the vLLM connector's loads and saves (:mod:`~..connectors.device_io`).

:class:`PinnedPool` contract:

* **Ownership:** the pool owns one host buffer of ``slabs`` x ``slab_bytes`` (page-locked on CUDA:
  pinning per chunk costs more than the copy). A caller :meth:`~PinnedPool.acquire`\\ s a slab, copies
  through a :meth:`~PinnedPool.view` of it and :meth:`~PinnedPool.release`\\ s it with the event of the
  last asynchronous device copy that reads or writes it.
* **Reuse:** a slab released with an event is lent again only once ``ready(event)`` holds; released
  without one, at once. Events do not notify, so a waiting :meth:`~PinnedPool.acquire` polls them
  (every millisecond) while any are pending.
* **Threading:** any thread may acquire and release (one condition variable guards the free list).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

Tensor = torch.Tensor


def pinned(nbytes: int) -> Tensor:
    """``nbytes`` of page-locked host memory (uint8)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """``slabs`` equal slabs of one pinned host buffer (the module docstring). ``alloc`` makes the
    buffer and ``ready`` tells a completed event (CUDA's by default; tests pass their own)."""

    def __init__(self, slab_bytes: int, slabs: int, alloc: Callable[[int], Tensor] = pinned,
                 ready: Callable[[Any], bool] = lambda event: bool(event.query())) -> None:
        if slabs < 1 or slab_bytes < 1:
            raise ValueError(f"a pinned pool needs >= 1 slab of >= 1 byte, got {slabs} x {slab_bytes}")
        self.slab_bytes, self.slabs, self._ready = slab_bytes, slabs, ready
        self._buffer = alloc(slab_bytes * slabs)
        self._free = list(range(slabs))
        self._after: list[tuple[int, Any]] = []  # (slab, event): free once the event completed
        self._cond = threading.Condition()

    def acquire(self, timeout: float | None = None) -> int | None:
        """A free slab, waiting up to ``timeout`` seconds (``None``: as long as it takes); ``None`` if
        none came."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                done = [(s, e) for s, e in self._after if self._ready(e)]
                for item in done:
                    self._after.remove(item)
                    self._free.append(item[0])
                if self._free:
                    return self._free.pop()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                wait = 0.001 if self._after else left
                self._cond.wait(wait if left is None or wait is None else min(wait, left))

    def release(self, slab: int, after: Any = None) -> None:
        """Give ``slab`` back, lent again once ``after`` (an event) completed."""
        with self._cond:
            if after is None:
                self._free.append(slab)
            else:
                self._after.append((slab, after))
            self._cond.notify()

    def view(self, slab: int, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """Slab ``slab`` seen as a ``shape`` tensor of ``dtype`` (``ValueError`` where it does not fit)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.slab_bytes:
            raise ValueError(f"pinned pool: a {nbytes}-byte chunk does not fit a {self.slab_bytes}-byte slab")
        start = slab * self.slab_bytes
        return self._buffer[start:start + nbytes].view(dtype).view(shape)

    def stage(self, src: Tensor, timeout: float | None = None) -> tuple[int, Tensor]:
        """``(slab, copy)``: ``src`` copied into a slab (the caller releases it). ``TimeoutError``
        when no slab came within ``timeout``."""
        slab = self.acquire(timeout)
        if slab is None:
            raise TimeoutError(f"no pinned slab free within {timeout} s")
        try:
            host = self.view(slab, src.shape, src.dtype)
            host.copy_(src)
        except BaseException:
            self.release(slab)
            raise
        return slab, host
