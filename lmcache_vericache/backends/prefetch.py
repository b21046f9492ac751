"""The handle over a store's background reads of full chunks (:meth:`~.store.DualTierStore.prefetch`).

The handle owns no thread: reads run on whatever pool ``submit`` uses. It hands each chunk out
once and keeps no reference to it afterwards. Thread-safe; ``wait_async`` serves coroutines.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

import torch

Tensor = torch.Tensor

# A read that will never run (cancelled, or the store closed): a miss, ready at once.
MISSED: Future = Future()
MISSED.set_result(None)


class PrefetchHandle:
    """Background reads of the full chunks of ``keys``, in order. Thread-safe.

    Reads run at most ``window`` chunks ahead of the lowest chunk not yet handed out, so a handle
    over many keys holds a bounded number of chunks (backpressure: a consumer that stops waiting
    stops the reads). Each chunk is handed out once: after ``wait(i)`` returns it the handle keeps
    no reference (waiting for it again raises ``RuntimeError``).

    ``wait`` blocks the calling thread; from a coroutine use ``await wait_async(...)``, which
    never blocks the event loop. A result of ``None`` is a miss: not stored, unreadable, failed
    verification (counted in the store's stats and logged), cancelled, or the store closed.

    ``submit(key)`` starts the read of one chunk and returns its future (:data:`MISSED` where it
    cannot start); ``count(cancelled=n)`` is told how many reads ``cancel`` dropped.
    """

    def __init__(
        self, keys: list[str], submit: Callable[[str], Future], window: int, count: Callable[..., None]
    ) -> None:
        self.keys = keys
        self._submit, self._window, self._count = submit, window, count
        self._futures: list[Future | None] = [None] * len(keys)
        self._taken = [False] * len(keys)
        self._lock = threading.Lock()
        self._cancelled = False
        self._advance()

    def __len__(self) -> int:
        return len(self.keys)

    def _advance(self, upto: int = 0) -> None:
        """Submit reads up to ``window`` past the first chunk not handed out (and at least to ``upto``)."""
        with self._lock:
            if self._cancelled:
                return
            first = next((j for j, t in enumerate(self._taken) if not t), len(self.keys))
            for j in range(min(len(self.keys), max(first + self._window, upto + 1))):
                if self._futures[j] is None:
                    self._futures[j] = self._submit(self.keys[j])

    def _future(self, i: int) -> Future:
        if self._taken[i]:
            raise RuntimeError(f"chunk {i} was already handed out")
        self._advance(i)
        with self._lock:
            fut = self._futures[i]
        return fut if fut is not None else MISSED  # None only once cancelled

    def _take(self, i: int, value: Tensor | None) -> Tensor | None:
        with self._lock:
            self._taken[i], self._futures[i] = True, MISSED
        self._advance()
        return value

    def ready(self, i: int) -> bool:
        fut = self._futures[i]
        return self._taken[i] or (fut is not None and fut.done()) or self._cancelled

    @property
    def done(self) -> bool:
        return all(self.ready(i) for i in range(len(self)))

    def wait(self, i: int | None = None, timeout: float | None = None) -> Any:
        """Chunk ``i`` (``Tensor | None``), or with ``i=None`` the list of all chunks.
        Raises ``TimeoutError`` if not ready within ``timeout`` seconds."""
        if i is not None:
            return self._take(i, _result(self._future(i), timeout))
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for j in range(len(self)):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out.append(self._take(j, _result(self._future(j), left)))
            except TimeoutError:
                raise TimeoutError(f"{len(self) - j} of {len(self)} chunks not ready after {timeout} s") from None
        return out

    async def wait_async(self, i: int | None = None) -> Any:
        if i is not None:
            return self._take(i, await _wrap(self._future(i)))
        return [await self.wait_async(j) for j in range(len(self))]

    def cancel(self) -> None:
        """Drop reads not yet started; reads in flight finish but their chunks still arrive."""
        with self._lock:
            self._cancelled = True
            pending = [f for f in self._futures if f is not None and f is not MISSED]
            unsubmitted = sum(f is None for f in self._futures)
        self._count(cancelled=sum(f.cancel() for f in pending) + unsubmitted)


def _result(fut: Future, timeout: float | None) -> Tensor | None:
    try:
        return fut.result(timeout)
    except CancelledError:
        return None


async def _wrap(fut: Future) -> Tensor | None:
    try:
        return await asyncio.wrap_future(fut)
    except asyncio.CancelledError:
        if fut.cancelled():  # the read was cancelled, not the awaiting task
            return None
        raise
