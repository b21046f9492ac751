"""The bytes the proposer's draft caches may hold, and where those bytes come from on a GPU.

:class:`DraftBudget` contract:

* **Who owns the bytes:** the proposer (:class:`~.proposer.CompressedKVProposer`). Every byte of a
  draft cache's buffers (its K/V, dense: the decompressed prefix chunks, the exact suffix and the
  room for the draft tokens) is charged before the buffer is allocated (:meth:`DraftBudget.grow`)
  and given back when the proposer drops the cache (:meth:`DraftBudget.give`): a request that
  finished or was preempted. Prefixes kept as stored chunks (``triton_draft``) live in an arena
  whose capacity is charged as it grows (old and new together, while it is copied) and stays
  charged: its freed slots are reused, never returned (:mod:`..engine.chunk_prefix`). ``held`` never exceeds ``limit``, counting the old buffer beside the
  new one while a growing cache is copied. Transient tensors (a chunk being compressed or
  decompressed, on the host) are not charged.
* **The load-window drafter** (:mod:`.drafts`) builds draft caches too, one per loading request;
  the proposer hands it this budget with its runtime. It charges a cache when a load's drafting
  starts (none is started where it would pass ``limit``) and gives the bytes back when drafting
  ends (the load finished, the drafts were taken or forgotten), dropping the cache then.
* **Threading:** charges come from vLLM's worker thread (``propose``) and the connector's load
  threads (:meth:`~.drafts.LoadDrafter.start`), give-backs from the worker thread and the drafter's
  thread: one lock guards ``held``.
* **GPU:** :meth:`DraftBudget.reserve_device` holds ``limit`` bytes on the device from the proposer's
  ``load_model`` until the first draft cache is charged (:meth:`DraftBudget.grow`), just before it
  is allocated (why vLLM then leaves those bytes out of its KV cache: :meth:`DraftBudget.reserve_device`). On a CPU nothing is reserved: vLLM's CPU worker sizes its KV cache
  from ``VLLM_CPU_KVCACHE_SPACE``, not from free memory, so only the accounting applies.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

from ..compressors import CompressedKV, KVCompressor
from ..engine.cache import KVCache
from ..engine.runtime import Runtime

Tensor = torch.Tensor

# "auto" on a GPU takes at most this share of the memory vLLM may use (gpu_memory_utilization x the
# device's memory): a dense draft cache per request could otherwise claim as much as vLLM's own KV
# and leave it none. Requests past it are not drafted (output unchanged).
AUTO_DEVICE_SHARE = 0.1


class DraftBudget:
    """Bytes the draft caches may hold (``limit``) and hold now (``held``); see the module docstring."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.held = 0
        self._lock = threading.Lock()
        self._reserved: Tensor | None = None

    def grow(self, old: int, new: int) -> bool:
        """Replace a buffer of ``old`` bytes by one of ``new`` (``old = 0``: a new cache). Both exist
        while the old one is copied, so the growth is admitted only if ``held + new <= limit``;
        ``False`` charges nothing. An admitted charge frees the device reservation: the caller
        allocates next."""
        with self._lock:
            if self.held + new > self.limit:
                return False
            self.held += new - old
            self._reserved = None
            return True

    def grow_cache(self, cache: KVCache, charged: int, need: int, unit: int) -> int | None:
        """Grow ``cache`` (``charged`` bytes now) to hold ``need`` entries, in whole ``unit``\ s, if the
        budget admits it; the bytes it is charged now, or ``None`` (the cache unchanged)."""
        if need <= cache.capacity:
            return charged
        entries = -(-need // unit) * unit
        layers, heads, _, head_dim = cache.k.shape
        nbytes = entries * 2 * layers * heads * head_dim * cache.k.element_size()  # K and V of every layer
        if not self.grow(charged, nbytes):
            return None
        cache.reserve(entries, exact=True)
        return nbytes

    def give(self, nbytes: int) -> None:
        """A dropped cache's bytes come back."""
        with self._lock:
            self.held -= nbytes

    def reserve_device(self, device: torch.device | str,
                       allocate: Callable[..., Tensor] = torch.empty) -> None:
        """On CUDA, hold ``limit`` bytes of ``device`` in one allocation (``allocate`` as ``torch.empty``).

        Why this takes the bytes out of vLLM's KV cache (vLLM 0.32, ``v1/worker``): the proposer's
        ``load_model`` runs inside ``GPUModelRunner.load_model``'s ``DeviceMemoryProfiler`` (its
        ``model_memory_usage``: the weights plus what the drafter keeps), and
        ``Worker.determine_available_memory`` sizes the KV cache from the device's free memory
        that ``memory_profiling`` measures after ``profile_run`` (``requested_memory -
        non_kv_cache_memory``, the consumption counted from the worker's start-up snapshot), so an
        allocation alive until then is left out of the KV cache. It is released when the first
        draft cache is charged (:meth:`grow`), not carved into draft caches (that would need a
        sub-allocator for caches that grow by reallocation): charges happen in ``propose``, which
        vLLM calls only for scheduled steps, after ``initialize_from_config`` allocated its KV
        cache (``profile_run``'s ``_dummy_run`` calls no ``custom_class`` proposer). The freed
        bytes then stay free for the draft caches, which the accounting keeps within them (less
        the caching allocator's rounding and fragmentation)."""
        device = torch.device(device)
        if device.type == "cuda" and self.limit and self._reserved is None:
            self._reserved = allocate(self.limit, dtype=torch.uint8, device=device)

    @property
    def reserved(self) -> int:
        """Bytes held on the device now (0 once released, or where nothing was reserved)."""
        return 0 if self._reserved is None else self._reserved.numel()


def kept_counts(compressor: KVCompressor, chunk_size: int, rt: Runtime) -> list[int]:
    """Entries each layer of a dense draft cache (of ``rt``'s model) keeps of one ``chunk_size``-token
    chunk, by the compressor's own accounting (its evictor's ``kept_counts``); every token for a
    quantizer, and where the count depends on the data (the bound)."""
    evictor, layers, heads = compressor.evictor(), rt.num_layers, rt.num_kv_heads
    counts = evictor.kept_counts((2, layers, chunk_size, heads * rt.head_dim), heads) if evictor else None
    return list(counts) if counts else [chunk_size] * layers


def chunk_entries(ckv: CompressedKV) -> list[int]:
    """Entries each layer of the chunk ``ckv`` decompresses to: its kept positions, else every token."""
    return [int(b["pos"].shape[1]) if "pos" in b else ckv.num_tokens for b in ckv.buffers_by_layer()]


def device_cap(device: torch.device, utilization: float, total: int | None = None) -> int | None:
    """The most bytes ``"auto"`` may take on ``device``: :data:`AUTO_DEVICE_SHARE` of the
    ``utilization`` share of its memory (``total``: the device's, read when not given); ``None`` off
    CUDA (no reservation there)."""
    if torch.device(device).type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory if total is None else total
    return int(AUTO_DEVICE_SHARE * utilization * total)


def auto_bytes(max_num_seqs: int, max_model_len: int, kept: list[int], chunk_size: int, exact: int,
               bytes_per_token: int, cap: int | None = None) -> int:
    """``draft_cache_bytes: "auto"``: ``max_num_seqs`` draft caches of a ``max_model_len``-token
    request. A cache's buffers are as long as its longest layer, so a request counts that layer's
    share of each chunk (``max(kept) / chunk_size``, :func:`kept_counts` of the proposer's own
    ``compressor`` and ``chunk_size``, also where a KV connector's store supplies the chunks) of
    its tokens, plus ``exact`` dense entries (the open chunk, the window, the draft room), rounded
    up to whole chunks as the proposer grows caches. For a quantizer (every entry kept) this is as
    much as vLLM's own KV at full concurrency: set a byte count, or draft with an evicting method.
    At most ``cap`` (:func:`device_cap` on a GPU)."""
    entries = math.ceil(max_model_len * max(kept) / chunk_size) + exact
    need = max_num_seqs * math.ceil(entries / chunk_size) * chunk_size * bytes_per_token
    return need if cap is None else min(need, cap)
