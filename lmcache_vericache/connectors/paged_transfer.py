"""Worker side of the VeriCache KV connector: chunks between the dual-tier store and vLLM's paged KV.

:class:`PagedTransfer` owns no vLLM object but the paged caches it is handed and knows nothing of
vLLM's scheduler; the connector (:mod:`.vericache_connector`) turns vLLM's hooks into its calls.

* Loads (:meth:`PagedTransfer.load`): one of ``LOAD_THREADS`` threads per request. The full chunks
  are read through the store's prefetch, once for every load in flight that needs them (requests
  sharing a prefix that load together share each read: the prefix crosses the link once), and
  written into the request's blocks through the cache's layout strategy (:mod:`.kv_layout`) and
  device IO (:mod:`.device_io`: on a GPU through a pinned pool on a load stream) from the first
  position vLLM has not computed itself (blocks before it may be shared with other requests, and
  are never written). With a drafter that can draft (:class:`~.load_drafter.LoadDrafter`, the proposer
  attached) the compressed chunks are fetched first and a draft job starts over them. The first chunk that misses, fails its digest or has the
  wrong shape ends the load: its blocks and every later one are reported by :meth:`take_errors`,
  with the request by :meth:`take_finished`, so vLLM recomputes them. A request is reported
  finished once its last write completed on the device (:class:`~.device_io.Pending`).
* Saves (:meth:`PagedTransfer.save`): a token-major gather (``KV_2LTD``) right after the forward,
  its copy to host memory (:meth:`~.device_io.DeviceIO.save`), then one writer thread waits for that
  copy and ``put``\\ s it (full + compressed) from a bounded queue; a full queue or no free host
  memory drops the save (counted: a lost save is a later miss), a failing put is counted and logged.
* Threading: ``load``/``save``/``take_*`` are called from vLLM's worker thread; counters and the
  finished/error sets are guarded by one lock.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..backends.keys import KeySpace
from ..backends.store import DualTierStore
from ..engine.cache import kv_to_2ltd
from ..workers import torch_serial
from . import paged_layout as pl
from .device_io import CpuIO, CudaIO, DeviceIO, Pending, TorchCuda
from .kv_layout import KVLayout, layout_for
from .load_drafter import DraftJob, LoadDrafter

logger = logging.getLogger("vllm." + __name__)  # shown by vLLM's log handler
Tensor = torch.Tensor
LOAD_THREADS = 8  # concurrent request loads (threads mostly wait on the store)
SAVE_QUEUE = 64


@dataclass
class LoadSpec:
    """Load chunks ``keys`` (tokens ``[stop - len(keys)*chunk, stop)``) into ``block_ids``, writing
    positions from ``start`` on (before it are vLLM's own blocks). Keys may be of any rank's space
    (the scheduler's): each rank loads the same chunks of its own."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    start: int
    stop: int
    prompt: list[int]


@dataclass
class SaveSpec:
    """Save chunks ``(key, first token)`` of one request, read from its ``block_ids`` (keys as in
    :class:`LoadSpec`)."""

    req_id: str
    chunks: list[tuple[str, int]]
    block_ids: list[int]


@dataclass
class ConnectorStats:
    """Counters of one connector instance (``connector_stats`` reads them inside vLLM)."""

    lookups: int = 0  # prompts looked up (scheduler)
    lookup_errors: int = 0  # lookups the store failed (counted as 0 hits)
    hit_tokens: int = 0  # tokens reported to vLLM as loadable (scheduler)
    loads: int = 0  # requests loaded (worker)
    loaded_chunks: int = 0
    failed_chunks: int = 0  # chunks missing / corrupt at load: vLLM recomputes them
    failed_blocks: int = 0
    load_s: float = 0.0  # summed wall time of loads
    compressed_chunks: int = 0  # compressed chunks handed to the drafter
    saved_chunks: int = 0
    save_dropped: int = 0  # saves dropped (queue full)
    save_errors: int = 0


class PagedTransfer:
    """Moves chunks between a :class:`DualTierStore` and vLLM's paged KV (see the module docstring)."""

    def __init__(self, store: DualTierStore, space: KeySpace, chunk_size: int, block_size: int,
                 layout: KVLayout, draft_tokens: int, load_timeout_s: float, stats: ConnectorStats,
                 drafter: LoadDrafter | None = None, io: DeviceIO | None = None) -> None:
        self.store, self.space, self.chunk_size, self.block_size = store, space, chunk_size, block_size
        self.drafter, self.layout, self.io = drafter, layout, io or CpuIO()
        self.draft_tokens, self.load_timeout_s, self.stats = draft_tokens, load_timeout_s, stats
        self._lock = threading.Lock()
        self._finished: dict[str, tuple[Pending, list[int]]] = {}  # req -> its last write, failed blocks
        self._errors: set[int] = set()
        self._inflight: dict[str, Future] = {}  # full-chunk reads shared by concurrent loads
        self._ckv_lock = threading.Lock()
        self._loader = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="vericache-load", initializer=torch_serial)
        self._saves: queue.Queue = queue.Queue(SAVE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="vericache-save", daemon=True)
        self._writer.start()
        # A memory capacity tier is this process's own: where vLLM runs its scheduler in another
        # process, the scheduler's store never sees what was saved here and plans every prompt chunk
        # again (8k / batch 8: 256 gathers on vLLM's thread, +2.8 s in a job's first steps), so saves
        # are checked against this store before their gather (a dict lookup).
        self._private = store.capacity.name == "memory"

    def load(self, spec: LoadSpec) -> None:
        """Start loading ``spec`` in the background (its writes wait for the compute stream's work
        so far); :meth:`take_finished` reports it when done."""
        self._loader.submit(self._load, spec, self.io.mark())

    def _load(self, spec: LoadSpec, after: object = None) -> None:
        """Compressed chunks to the drafter at once, then full chunks into the blocks as they come."""
        t0 = time.perf_counter()
        c, bs = self.chunk_size, self.block_size
        first = spec.stop - len(spec.keys) * c
        written = spec.start  # positions [start, written) are in vLLM's blocks, verified
        job, last = None, Pending()
        shape = (2, self.layout.num_layers, c, self.layout.width)
        try:
            # The compressed chunks first, alone on the link: drafting starts after their bytes
            # instead of after a share of the full chunks' too, and on a bandwidth-bound link the
            # full chunks arrive no later (the same bytes cross it either way).
            if self.draft_tokens and self.drafter is not None and self.drafter.can_draft:  # no proposer: no compressed bytes moved
                job = self._start_drafts(spec)
            chunks = self._fetch([self.space.rekey(k) for k in spec.keys])  # this rank's chunks
            blocks = torch.tensor(spec.block_ids)
            for i in range(len(spec.keys)):
                full = chunks[i].result(self.load_timeout_s)  # TimeoutError: a hung store fails the load
                lo, hi = first + i * c, first + (i + 1) * c
                if full is None or tuple(full.shape) != shape or full.dtype != self.layout.dtype:
                    # Found by the lookup, gone or unreadable now (evicted, corrupt, the tier
                    # failed: the store logged which): vLLM recomputes from here.
                    logger.warning("vericache connector: load of %s: chunk %d of %d %s; vLLM recomputes "
                                   "from token %d", spec.req_id, i + 1, len(spec.keys),
                                   "missed" if full is None else f"has shape {tuple(full.shape)}", max(lo, spec.start))
                    break
                start = max(lo, spec.start)
                last = self.io.load(full[:, :, start - lo:], after,
                                    lambda dev, start=start, hi=hi: self._write(dev, blocks, start, hi))
                written = hi
        except Exception as e:  # store down mid-load, bad layout: vLLM recomputes what is missing
            logger.warning("vericache connector: load of %s failed after %d of %d tokens (%s: %s); vLLM "
                           "recomputes the rest", spec.req_id, written - spec.start, spec.stop - spec.start,
                           type(e).__name__, e)
        failed = sorted({spec.block_ids[p // bs] for p in range(written // bs * bs, spec.stop, bs)})
        if job is not None:
            job.load_done()
        with self._lock:
            self.stats.loads += 1
            self.stats.load_s += time.perf_counter() - t0
            self.stats.loaded_chunks += -(-(written - spec.start) // c)
            if failed:
                self.stats.failed_chunks += -(-(spec.stop - written) // c)
                self.stats.failed_blocks += len(failed)
            self._finished[spec.req_id] = (last, failed)

    def _start_drafts(self, spec: LoadSpec) -> DraftJob | None:
        """A draft job over the request's compressed chunks, or ``None``. Drafting is an
        optimisation: a failure here (a compressed chunk the drafter cannot use) is logged and the
        load goes on, it must never fail the full load."""
        try:
            with self._ckv_lock:  # one at a time: loads sharing a prefix then find its chunks hot
                ckvs = self.store.get_compressed_prefix(self.space.token_keys(spec.prompt[:spec.stop]))
            if not ckvs:
                return None
            job = self.drafter.start(spec.req_id, spec.prompt, ckvs, self.store.compressor, len(ckvs) * self.chunk_size,
                               self.draft_tokens)
        except Exception as e:
            logger.warning("vericache connector: no drafts during the load of %s (%s: %s)", spec.req_id,
                           type(e).__name__, e)
            return None
        if job is not None:
            with self._lock:
                self.stats.compressed_chunks += len(ckvs)
        return job

    def _fetch(self, keys: list[str]) -> list[Future]:
        """Full chunks of ``keys`` as futures, read once for all loads in flight: requests sharing a
        prefix that load at the same time (one step's new requests) share each chunk's read, so the
        prefix crosses the link once, not once per request. Chunks are forgotten once read (a later
        load reads them again); a read that fails gives ``None`` for it and every later key."""
        mine: list[tuple[str, Future]] = []
        with self._lock:
            futures = []
            for key in keys:
                fut = self._inflight.get(key)
                if fut is None:
                    fut = self._inflight[key] = Future()
                    mine.append((key, fut))
                futures.append(fut)
        if mine:
            threading.Thread(target=self._read_chunks, args=(mine,), name="vericache-read", daemon=True).start()
        return futures

    def _read_chunks(self, todo: list[tuple[str, Future]]) -> None:
        torch_serial()
        results: list[Tensor | None] = []
        try:
            handle = self.store.prefetch([k for k, _ in todo])
            for i, (key, fut) in enumerate(todo):
                full = handle.wait(i)
                self._resolve(key, fut, full)
                results.append(full)
        except Exception as e:  # the store failed mid-read: the rest are misses
            logger.warning("vericache connector: full-chunk read failed (%s: %s)", type(e).__name__, e)
        finally:
            for key, fut in todo[len(results):]:
                self._resolve(key, fut, None)

    def _resolve(self, key: str, fut: Future, value: Tensor | None) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]
        if not fut.done():
            fut.set_result(value)

    def _write(self, full: Tensor, blocks: Tensor, lo: int, hi: int) -> None:
        """Write ``full`` (``KV_2LTD`` of positions ``[lo, hi)``, on the cache's device) into every
        layer's paged cache."""
        slots = pl.slots_for(blocks, lo, hi, self.block_size)
        layers, t = full.shape[1], full.shape[2]
        k, v = full.view(2, layers, t, self.layout.kv_heads, self.layout.head_size).transpose(2, 3)
        self.layout.scatter(slots, k, v)

    def save(self, specs: list[SaveSpec]) -> None:
        """Copy each chunk of ``specs`` out of the paged cache token-major now (its blocks may be
        reused after this step) and queue its ``put``; a full queue drops it (counted)."""
        c = self.chunk_size
        for spec in specs:
            blocks = torch.tensor(spec.block_ids)
            for key, lo in spec.chunks:
                if self._private and self.store.has_full(self.space.rekey(key)):
                    continue  # stored: the scheduler's own memory store could not tell
                slots = pl.slots_for(blocks, lo, lo + c, self.block_size)
                copy = self.io.save(lambda slots=slots: kv_to_2ltd(*self.layout.gather(slots)))
                try:
                    if copy is None:
                        raise queue.Full
                    self._saves.put_nowait((self.space.rekey(key), copy, lo))
                except queue.Full:
                    self.stats.save_dropped += 1
                    if copy is not None:
                        copy.drop()  # no wait on vLLM's thread: the slab comes back after its copy

    def _write_loop(self) -> None:
        torch_serial()
        while True:
            item = self._saves.get()
            if item is None:
                return
            key, copy, lo = item
            try:
                self.store.put(key, copy.result(), start=lo)  # result(): after the device copy completed
                self.stats.saved_chunks += 1
            except Exception as e:  # TierError, a dead server: the chunk is a later miss
                self.stats.save_errors += 1
                logger.warning("vericache connector: save failed (%s: %s)", type(e).__name__, e)
            finally:
                copy.release()
                self._saves.task_done()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until queued saves are written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._saves.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)


    def take_finished(self) -> set[str]:
        """Requests whose load ended, and whose writes completed on the device, since the last call
        (successfully or not); their failed blocks go to :meth:`take_errors` now."""
        with self._lock:
            done = {rid for rid, (last, _) in self._finished.items() if last.ready()}
            for rid in done:
                self._errors.update(self._finished.pop(rid)[1])
        return done

    def take_errors(self) -> set[int]:
        """Blocks that failed to load since the last call."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        """Flush, stop the writer and the loader. Never blocks for good: a writer stuck in a store
        (a dead server) with a full queue is left behind, a daemon thread, after a warning."""
        self.flush()
        try:
            self._saves.put(None, timeout=10)
        except queue.Full:
            logger.warning("vericache connector: the save writer did not take its stop in 10 s (a store stuck in a put); closing without it")
        self._writer.join(10)
        self._loader.shutdown(wait=True, cancel_futures=True)


def build_transfer(kv_caches: dict[str, torch.Tensor], isas: Callable[[list[str]], list[str | None]],
                   store: DualTierStore, space: KeySpace, *, num_kv_heads: int, chunk_size: int, block_size: int,
                   draft_tokens: int, load_timeout_s: float, pinned_pool_bytes: int, stats: ConnectorStats,
                   drafter: LoadDrafter | None = None) -> PagedTransfer:
    """The worker's transfer over vLLM's registered caches (``register_kv_caches``' argument), with no
    vLLM import: layers sorted by their index, the layout strategy chosen for their device
    (``isas(names)``: the CPU backend's per-layer ISA), the head count checked against the model's,
    and the device IO (on CUDA a pinned pool of ``pinned_pool_bytes`` in slabs of one chunk)."""
    def layer_index(name: str) -> int:
        found = re.findall(r"\d+", name)
        return int(found[0]) if found else 0

    names = sorted(kv_caches, key=layer_index)  # this rank's layers (its PP stage's), in order
    layout = layout_for([kv_caches[n] for n in names], lambda: isas(names))
    if layout.kv_heads != num_kv_heads:
        raise ValueError(f"VeriCacheConnector: the KV cache has {layout.kv_heads} heads per rank, the model "
                         f"config {num_kv_heads}")
    io: DeviceIO = CpuIO()
    if layout.device.type != "cpu":
        chunk_bytes = 2 * layout.num_layers * chunk_size * layout.width * layout.dtype.itemsize
        io = CudaIO(TorchCuda(layout.device), chunk_bytes, pinned_pool_bytes, load_timeout_s)
    return PagedTransfer(store, space, chunk_size, block_size, layout, draft_tokens, load_timeout_s, stats,
                         drafter=drafter, io=io)
