"""Drafts made while a request's full prefix is still loading (the connector's load window).

vLLM runs a request only after its whole prefix is in its blocks. While the full chunks stream in,
the compressed chunks are already here: :func:`start` drafts the continuation over them with the
target model's own weights (the runtime the ``custom_class`` proposer built in ``load_model``; no
second copy), on a background thread: the prompt's tail past the compressed prefix is prefilled
over it, then ``n`` tokens are decoded greedily. When the request runs and samples its first token,
the proposer :func:`take`\\ s the drafts: if the first draft equals the sampled token, the rest is
proposed to vLLM's rejection sampler, which verifies it against the now-loaded full KV.

The connector and the proposer live in the same worker process and meet here: the proposer
:func:`register`\\ s its runtime, the connector calls :func:`start`. vLLM's CPU kernels (oneDNN
GEMMs) are not safe to run from two threads at once (a segfault when a draft step overlapped vLLM's
forward), so every forward over the model holds :data:`model_lock`: vLLM's own (the proposer's
forward hooks and ``compute_logits`` take it), the proposer's drafts, and each draft step here; and
a draft step starts only while vLLM's forward is not waiting (:data:`vllm_idle`). Drafting thus fills
the gaps between vLLM's steps, such as the wait for a prefix load, and one thread drafts for every
loading request in one batched forward per step. A job stops when its load finishes (its request
runs next), at ``n`` drafts, or when the proposer takes it. Without a proposer (or with a
runtime that fails) nothing is drafted and serving is unchanged. Drafts are keyed by the prompt's
tokens; at most :data:`MAX_PENDING` are kept (oldest dropped).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..backends.keys import KeySpace
from ..backends.store import DualTierStore
from ..compressors import CompressedKV, KVCompressor
from ..engine.cache import KVCache, append_chunks
from ..engine.runtime import Runtime, Segment

logger = logging.getLogger("vllm." + __name__)  # shown by vLLM's log handler
MAX_PENDING = 256
MAX_TAIL = 512  # most prompt tokens past the compressed prefix a draft job prefills


@dataclass
class DraftStats:
    jobs: int = 0
    tokens: int = 0  # tokens drafted
    during_load: int = 0  # of those, drafted before the full prefix had loaded
    taken: int = 0  # jobs whose drafts the proposer used (first draft = sampled token)
    mismatched: int = 0  # jobs whose first draft differed from the sampled token
    draft_s: float = 0.0


class DraftJob:
    """One request's drafting; drafts grow in ``tokens`` until ``n``, the end of its load, or
    :meth:`stop`."""

    def __init__(self, req_id: str, prompt: Sequence[int], n: int, cache: KVCache, prefix: int):
        self.req_id, self.prompt, self.n = req_id, tuple(prompt), n
        self.tokens: list[int] = []
        self.cache = cache
        self.next = list(self.prompt[prefix:])  # tokens of the next forward (the tail, then one draft)
        self.pos = prefix
        self._loaded = threading.Event()
        self._stop = threading.Event()
        self.done = threading.Event()

    def load_done(self) -> None:
        """The full prefix is in vLLM's blocks: drafting stops (vLLM runs the request next and the
        drafter must not compete with it for the cores)."""
        self._loaded.set()

    def stop(self) -> list[int]:
        """Stop drafting; the drafts so far."""
        self._stop.set()
        self.done.wait(30)
        return list(self.tokens)

    @property
    def active(self) -> bool:
        return len(self.tokens) < self.n and not self._stop.is_set() and not self._loaded.is_set()


@dataclass(frozen=True)
class ChunkSource:
    """The KV connector's store and key space: where the proposer reads compressed prefix chunks."""

    store: DualTierStore
    space: KeySpace
    chunk_size: int


_rt: Runtime | None = None
_source: ChunkSource | None = None
model_lock = threading.RLock()  # held by every forward over the served model's modules (re-entrant: logits)
vllm_idle = threading.Event()  # cleared while vLLM's own forward wants the model: the drafter waits
vllm_idle.set()
_lock = threading.Lock()
_work = threading.Condition(_lock)
_active: list[DraftJob] = []
_thread: threading.Thread | None = None
_jobs: OrderedDict[tuple[int, ...], DraftJob] = OrderedDict()
_stats = DraftStats()


def register(rt: Runtime | None) -> None:
    """The runtime drafts run on (the proposer's, over vLLM's module); ``None`` turns drafting off."""
    global _rt
    _rt = rt


def register_source(source: ChunkSource | None) -> None:
    """The connector's store (worker side), for the proposer's draft caches."""
    global _source
    _source = source


def can_draft() -> bool:
    """A drafter is registered (the proposer runs in this process)."""
    return _rt is not None


def chunk_source() -> ChunkSource | None:
    return _source


def stats() -> dict[str, Any]:
    return {**asdict(_stats), "pending": len(_jobs), "registered": _rt is not None}


def start(req_id: str, prompt: Sequence[int], ckvs: list[CompressedKV], compressor: KVCompressor,
          prefix: int, n: int) -> DraftJob | None:
    """Draft ``n`` tokens after ``prompt`` over the compressed chunks ``ckvs`` (its first ``prefix``
    tokens). Builds the draft cache here (the caller's thread), then hands the job to the drafter
    thread, which runs every active job in one batched forward per step. ``None`` if no drafter is
    registered, nothing is left to prefill, or the tail is longer than :data:`MAX_TAIL` (its
    prefill alone would hold the model for longer than a load is worth)."""
    global _thread
    rt = _rt
    if rt is None or n <= 0 or not ckvs or not 0 < len(prompt) - prefix <= MAX_TAIL:
        return None
    cache = rt.new_cache(8)
    append_chunks(cache, ckvs, compressor, room=len(prompt) - prefix + n + 1)
    job = DraftJob(req_id, prompt, n, cache, prefix)
    with _work:
        _jobs[job.prompt] = job
        while len(_jobs) > MAX_PENDING:
            _jobs.popitem(last=False)[1]._stop.set()
        _stats.jobs += 1
        _active.append(job)
        if _thread is None:
            _thread = threading.Thread(target=_drafter, args=(rt,), name="vericache-draft", daemon=True)
            _thread.start()
        _work.notify()
    return job


def pending() -> bool:
    """Some load's drafts wait for their request (a cheap check before :func:`take`)."""
    return bool(_jobs)


def take(prompt: Sequence[int]) -> list[int] | None:
    """Stop and remove the job of ``prompt``; its drafts (``None`` if there is none)."""
    with _lock:
        job = _jobs.pop(tuple(prompt), None)
    return None if job is None else job.stop()


def forget(req_ids: set[str]) -> None:
    """Drop the jobs of requests that ended without taking their drafts (aborted)."""
    if not req_ids or not _jobs:
        return
    with _lock:
        for key in [k for k, j in _jobs.items() if j.req_id in req_ids]:
            _jobs.pop(key)._stop.set()


def count_use(matched: bool) -> None:
    with _lock:
        if matched:
            _stats.taken += 1
        else:
            _stats.mismatched += 1


def _drafter(rt: Runtime) -> None:
    """One thread for all jobs: each step, one forward over every active job (a new job's tail
    prefill or the last draft), only while vLLM's own forward does not want the model, on one
    intra-op thread (this thread's setting): the load it overlaps needs a core too."""
    torch.set_num_threads(1)
    while True:
        with _work:
            for job in [j for j in _active if not j.active]:
                _active.remove(job)
                job.done.set()
            while not _active:
                _work.wait()
            jobs = list(_active)
        vllm_idle.wait()  # vLLM's steps first: drafting fills the gaps (the wait for a load)
        t0 = time.perf_counter()
        try:
            tokens = torch.tensor([t for j in jobs for t in j.next])
            positions = torch.cat([torch.arange(j.pos, j.pos + len(j.next)) for j in jobs])
            rows = torch.tensor(list(itertools.accumulate(len(j.next) for j in jobs))) - 1
            with model_lock:
                logits, _ = rt.forward(tokens, positions, [Segment(j.cache, len(j.next)) for j in jobs], rows=rows)
            picks = logits.argmax(-1).tolist()
        except Exception as e:  # drafting is an optimisation: a failure only loses the drafts
            logger.warning("vericache drafts: drafting during the load failed (%s: %s)", type(e).__name__, e)
            picks = None
        with _work:
            _stats.draft_s += time.perf_counter() - t0
            for j, t in zip(jobs, picks or [None] * len(jobs)):
                if t is None:
                    j._stop.set()
                    continue
                j.pos += len(j.next)
                j.next = [t]
                j.tokens.append(t)
                _stats.tokens += 1
                _stats.during_load += not j._loaded.is_set()
