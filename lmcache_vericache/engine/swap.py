"""Chunk keys of a prompt and the background swap-in of its full prefix KV.

The full prefix KV lives between verifications in the project's :class:`~lmcache_vericache.backends.
DualTierStore` (one checksummed full-chunk format, one disk tier, one store); anything with the
:class:`Source` shape fits. Chunks are in LMCache's ``KV_2LTD`` layout ``[2, layers, tokens,
kv_heads*head_dim]``.

:class:`SwapIn` runs one round's swap on a background thread: it asks the source for the chunks and
copies each into the request's preallocated verify buffer as it arrives. The engine starts it when
the round's drafting starts and waits for it just before verifying, so the copy hides behind drafting.
On CUDA the copy goes through pinned host memory on a side stream; the waiting side makes the compute
stream wait for it.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Protocol

import numpy as np
import torch

from .runtime import KVCache

Tensor = torch.Tensor


class Handle(Protocol):
    def wait(self, i: int | None = None, timeout: float | None = None): ...  # chunk i: Tensor | None (miss)
    def cancel(self) -> None: ...


class Source(Protocol):
    def prefetch(self, keys: list[str]) -> Handle: ...


def chunk_keys(tokens: list[int], chunk_size: int, salt: str = "") -> list[str]:
    """Chained prefix hashes (LMCache style): chunk i's key depends on every token before its end."""
    keys, h = [], salt.encode()
    for s in range(0, len(tokens) - chunk_size + 1, chunk_size):
        h = hashlib.sha256(h + np.asarray(tokens[s:s + chunk_size], dtype=np.int64).tobytes()).digest()
        keys.append(h.hex()[:32])
    return keys


@torch.inference_mode()
def model_fingerprint(model: torch.nn.Module) -> str:
    """Identity of a model's weights and shape, equal in every process that loads the same model.
    Chunk keys are salted with it: KV of one model must never verify another's drafts. The config
    alone names the architecture, not the weights, so the first values of every tensor join it."""
    cfg = model.config
    h = hashlib.sha256(json.dumps({k: str(getattr(cfg, k, None)) for k in (
        "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "rope_theta", "rope_scaling", "rms_norm_eps")}, sort_keys=True).encode())
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().reshape(-1)[:16].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


_SWAP_POOL = ThreadPoolExecutor(2, thread_name_prefix="vericache-swap")


class SwapIn:
    """One round's swap of ``keys`` into ``cache`` entries ``[i*chunk, (i+1)*chunk)`` (base 0)."""

    def __init__(self, source: Source, keys: list[str], cache: KVCache, chunk_size: int):
        self.nbytes = 0
        self.seconds = 0.0
        self.misses: list[int] = []
        self._cache, self._chunk = cache, chunk_size
        layers, heads, _, d = cache.k.shape
        self._shape = (2, layers, chunk_size, heads * d)
        self._stream = None
        if cache.k.is_cuda:
            self._stream = torch.cuda.Stream(device=cache.k.device)
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
            if kv is None or tuple(kv.shape) != self._shape or kv.dtype != self._cache.k.dtype:
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

    @property
    def done(self) -> bool:
        """Every chunk is in place or known missing (``wait`` will not block on I/O)."""
        return self._future.done()

    def wait(self) -> list[int]:
        """Block until every chunk is in place; returns the indices of missed chunks."""
        self._future.result()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return self.misses

    def cancel(self) -> None:
        """Drop the reads not yet started and return once nothing writes into the cache any more
        (reads in flight finish; their chunks are still copied). Never raises."""
        self._handle.cancel()
        if not self._future.cancel():
            wait_futures([self._future])  # ends soon: the rest of its reads are misses; CUDA copies synced
