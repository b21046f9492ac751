"""Where the full prefix KV lives between verifications, and the background swap-in.

A *source* is anything with ``put(key, kv)`` (optional) and ``prefetch(keys) -> handle`` whose
``handle.wait()`` returns one ``Tensor | None`` per key (``None`` = miss) and ``handle.cancel()``.
The dual-tier store's ``PrefetchHandle`` (``wait(i=None, timeout=None)``) fits as is. Chunks are in
LMCache's ``KV_2LTD`` layout ``[2, layers, tokens, kv_heads*head_dim]``.

:class:`SwapIn` runs one round's swap on a background thread: it asks the source for the chunks and
copies each into the request's preallocated verify buffer as it arrives. The engine starts it when
the round's drafting starts and waits for it just before verifying, so the copy hides behind drafting.
On CUDA the copy goes through pinned host memory on a side stream; the waiting side makes the compute
stream wait for it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from .runtime import KVCache

Tensor = torch.Tensor


class Handle(Protocol):
    def wait(self) -> list[Tensor | None]: ...
    def cancel(self) -> None: ...


class Source(Protocol):
    def prefetch(self, keys: list[str]) -> Handle: ...


def chunk_keys(tokens: list[int], chunk_size: int, salt: str = "") -> list[str]:
    """Chained prefix hashes (LMCache style): chunk i's key depends on every token before it end."""
    keys, h = [], salt.encode()
    for s in range(0, len(tokens) - chunk_size + 1, chunk_size):
        h = hashlib.sha256(h + np.asarray(tokens[s:s + chunk_size], dtype=np.int64).tobytes()).digest()
        keys.append(h.hex()[:32])
    return keys


class _Ready:
    """A handle whose results are already known (memory) or computed by a future (file)."""

    def __init__(self, results: list[Tensor | None] | Future):
        self._r = results

    def wait(self, i: int | None = None, timeout: float | None = None):
        r = self._r.result(timeout) if isinstance(self._r, Future) else self._r
        return r if i is None else r[i]

    def cancel(self) -> None:
        if isinstance(self._r, Future):
            self._r.cancel()


class MemorySource:
    """Full chunks in host memory (a dict), as a CPU tier would hold them."""

    def __init__(self) -> None:
        self.chunks: dict[str, Tensor] = {}

    def put(self, key: str, kv: Tensor) -> None:
        self.chunks.setdefault(key, kv.detach().to("cpu", copy=True).contiguous())

    def prefetch(self, keys: list[str]) -> _Ready:
        return _Ready([self.chunks.get(k) for k in keys])


class FileSource:
    """One file per full chunk: a 16-byte header (crc32, dtype, shape) and the raw bytes. Written
    atomically; a missing, truncated or corrupt file reads as a miss (verification must never see
    wrong KV)."""

    _DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

    def __init__(self, root: str | os.PathLike, threads: int = 2):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vericache-file")

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.kv"

    def put(self, key: str, kv: Tensor) -> None:
        path = self._path(key)
        if path.exists():
            return
        kv = kv.detach().cpu().contiguous()
        raw = kv.view(torch.uint8).numpy().tobytes() if kv.dtype != torch.bfloat16 else kv.view(torch.int16).numpy().tobytes()
        head = np.array([zlib.crc32(raw), self._DTYPES[kv.dtype], *kv.shape], dtype=np.uint32)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(head.tobytes())
            f.write(raw)
        os.replace(tmp, path)

    def _read(self, key: str) -> Tensor | None:
        try:
            data = self._path(key).read_bytes()
        except OSError:
            return None
        if len(data) < 24:
            return None
        head = np.frombuffer(data[:24], dtype=np.uint32)
        crc, code, shape = int(head[0]), int(head[1]), tuple(int(s) for s in head[2:6])
        dtype = next((d for d, c in self._DTYPES.items() if c == code), None)
        body = data[24:]
        if dtype is None or zlib.crc32(body) != crc:
            return None
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if len(body) != n:
            return None
        return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).view(shape)

    def prefetch(self, keys: list[str]) -> _Ready:
        return _Ready(self._pool.submit(lambda: [self._read(k) for k in keys]))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_SWAP_POOL = ThreadPoolExecutor(2, thread_name_prefix="vericache-swap")


class SwapIn:
    """One round's swap of ``keys`` into ``cache`` entries ``[i*chunk, (i+1)*chunk)`` (base 0)."""

    def __init__(self, source: Any, keys: list[str], cache: KVCache, chunk_size: int):
        self.nbytes = 0
        self.seconds = 0.0
        self.misses: list[int] = []
        self._cache, self._chunk = cache, chunk_size
        self._stream = torch.cuda.Stream() if cache.k.is_cuda else None
        self._event: torch.cuda.Event | None = None
        self._handle = source.prefetch(keys)
        self._n = len(keys)
        self._future = _SWAP_POOL.submit(self._run)

    def _run(self) -> None:
        t0 = time.perf_counter()
        results = self._handle.wait()
        for i, kv in enumerate(results):
            if kv is None or kv.shape[2] != self._chunk or kv.dtype != self._cache.k.dtype:
                self.misses.append(i)
                continue
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._cache.load_2ltd(i * self._chunk, kv.pin_memory() if not kv.is_pinned() else kv)
            else:
                self._cache.load_2ltd(i * self._chunk, kv)
            self.nbytes += kv.numel() * kv.element_size()
        if self._stream is not None:
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
            self._event.synchronize()
        self.seconds = time.perf_counter() - t0

    def wait(self) -> list[int]:
        """Block until every chunk is in place; returns the indices of missed chunks."""
        self._future.result()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return self.misses

    def cancel(self) -> None:
        self._handle.cancel()
        self._future.cancel()
