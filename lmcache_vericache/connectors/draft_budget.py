"""The bytes the proposer's draft caches may hold, and where those bytes come from on a GPU.

:class:`DraftBudget` contract:

* **Who owns the bytes:** the proposer (:class:`~.proposer.CompressedKVProposer`). Every byte of a
  draft cache's buffers (its K/V: a dense prefix, the exact suffix and the room for the draft
  tokens; an int8 or codebook prefix by its expected size, trued up once laid out,
  :meth:`DraftBudget.adjust`) is charged before the buffer is allocated (:meth:`DraftBudget.grow`)
  and given back when the proposer drops the cache (:meth:`DraftBudget.give`): a request that
  finished or was preempted. Prefixes kept as stored chunks (``triton_draft``) live in an arena
  whose capacity is charged as it grows (old and new together, while it is copied) and stays
  charged: its freed slots are reused, never returned (:mod:`..engine.chunk_prefix`). ``held`` never exceeds ``limit``, counting the old buffer beside the
  new one while a growing cache is copied. Transient tensors (a chunk being compressed or
  decompressed, on the host) are not charged.
* **The load-window drafter** (:mod:`.load_drafter`) builds draft caches too, one per loading request;
  the proposer hands it this budget with its runtime. It charges a cache when a load's drafting
  starts (none is started where it would pass ``limit``) and gives the bytes back when drafting
  ends (the load finished, the drafts were taken or forgotten), dropping the cache then.
* **Threading:** charges come from vLLM's worker thread (``propose``) and the connector's load
  threads (:meth:`~.load_drafter.LoadDrafter.start`), give-backs from the worker thread and the drafter's
  thread: one lock guards ``held``.
* **The budget only accounts.** Where the bytes come from on a GPU is :class:`DeviceHold`'s: it holds
  ``limit`` bytes on the device from the proposer's ``load_model`` until the first draft cache is
  charged, just before it is allocated (why vLLM then leaves those bytes out of its KV cache:
  :meth:`DeviceHold.take`). On a CPU nothing is held: vLLM's CPU worker sizes its KV cache from
  ``VLLM_CPU_KVCACHE_SPACE``, not from free memory, so only the accounting applies.
* **Sizes** come from :class:`~..engine.draft_cache.DraftCaches` (its ``need``, ``nbytes`` and
  ``auto_bytes``): one rule sizes a draft cache and one counts its bytes, for every kind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

Tensor = torch.Tensor

# "auto" on a GPU takes at most this share of the memory vLLM may use (gpu_memory_utilization x the
# device's memory): a dense draft cache per request could otherwise claim as much as vLLM's own KV
# and leave it none. Requests past it are not drafted (output unchanged).
AUTO_DEVICE_SHARE = 0.1


class DraftBudget:
    """Bytes the draft caches may hold (``limit``) and hold now (``held``); see the module docstring.
    ``on_charge``: called (outside the lock) after each admitted growth, before the caller allocates
    (a :class:`DeviceHold` releases its bytes there)."""

    def __init__(self, limit: int, on_charge: Callable[[], None] | None = None):
        self.limit = int(limit)
        self.held = 0
        self._lock = threading.Lock()
        self.on_charge = on_charge

    def grow(self, old: int, new: int, copying: int | None = None) -> bool:
        """Replace a buffer of ``old`` bytes by one of ``new`` (``old = 0``: a new cache). ``copying``
        of the old bytes (default all of them) exist beside the new ones while they are copied, so
        the growth is admitted only if ``held - old + new + copying <= limit``; ``False`` charges
        nothing."""
        copying = old if copying is None else copying
        with self._lock:
            if self.held - old + new + copying > self.limit:
                return False
            self.held += new - old
        if self.on_charge is not None:
            self.on_charge()
        return True

    def adjust(self, old: int, new: int) -> None:
        """A charge replaced by what was allocated (an estimate trued up); never refused."""
        with self._lock:
            self.held += new - old

    def give(self, nbytes: int) -> None:
        """A dropped cache's bytes come back."""
        with self._lock:
            self.held -= nbytes


class DeviceHold:
    """``nbytes`` held on a CUDA device from :meth:`take` until :meth:`release` (the first charge)."""

    def __init__(self, nbytes: int, allocate: Callable[..., Tensor] = torch.empty):
        self.nbytes, self._allocate = int(nbytes), allocate
        self._held: Tensor | None = None

    def take(self, device: torch.device | str) -> None:
        """On CUDA, hold the bytes in one allocation (once; nothing elsewhere).

        Why this takes the bytes out of vLLM's KV cache (vLLM 0.32, ``v1/worker``): the proposer's
        ``load_model`` runs inside ``GPUModelRunner.load_model``'s ``DeviceMemoryProfiler`` (its
        ``model_memory_usage``: the weights plus what the drafter keeps), and
        ``Worker.determine_available_memory`` sizes the KV cache from the device's free memory
        that ``memory_profiling`` measures after ``profile_run``, so an allocation alive until then
        is left out of the KV cache. It is released when the first draft cache is charged, not
        carved into draft caches (that would need a sub-allocator for caches that grow by
        reallocation): charges happen in ``propose``, which vLLM calls only for scheduled steps,
        after it allocated its KV cache. The freed bytes then stay free for the draft caches, which
        the accounting keeps within them (less the caching allocator's rounding and fragmentation)."""
        device = torch.device(device)
        if device.type == "cuda" and self.nbytes and self._held is None:
            self._held = self._allocate(self.nbytes, dtype=torch.uint8, device=device)

    def release(self) -> None:
        self._held = None

    @property
    def held(self) -> int:
        """Bytes held on the device now (0 once released, or where nothing was taken)."""
        return 0 if self._held is None else self._held.numel()


def device_cap(device: torch.device, utilization: float, total: int | None = None) -> int | None:
    """The most bytes ``"auto"`` may take on ``device``: :data:`AUTO_DEVICE_SHARE` of the
    ``utilization`` share of its memory (``total``: the device's, read when not given); ``None`` off
    CUDA (no reservation there)."""
    if torch.device(device).type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory if total is None else total
    return int(AUTO_DEVICE_SHARE * utilization * total)
