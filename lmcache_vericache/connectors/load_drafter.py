"""Drafts made while a request's full prefix is still loading (the connector's load window).

vLLM runs a request only after its whole prefix is in its blocks. While the full chunks stream in,
the compressed chunks are already here: :meth:`LoadDrafter.start` drafts the continuation over them with the
target model's own weights (the runtime the ``custom_class`` proposer built in ``load_model``; no
second copy), on a background thread: the prompt's tail past the compressed prefix is prefilled
over it, then ``n`` tokens are decoded greedily. When the request runs and samples its first token,
the proposer :meth:`~LoadDrafter.take`\\ s the drafts: if the first draft equals the sampled token, the rest is
proposed to vLLM's rejection sampler, which verifies it against the now-loaded full KV.

One :class:`LoadDrafter` per vLLM engine, held by its :class:`~.worker_context.WorkerContext`:
the proposer :meth:`~LoadDrafter.attach`\\ es its runtime, the connector's loads call
:meth:`~LoadDrafter.start`. Every forward over the model holds the context's
:class:`~.model_guard.ModelGuard` (vLLM's CPU GEMMs are not safe from two threads at once), and a
draft step starts only while vLLM's own forward is not waiting: drafting fills the gaps between
vLLM's steps, such as the wait for a prefix load, and one thread drafts for every loading request
in one batched forward per step. A job stops when its load finishes (its request runs next), at
``n`` drafts, or when the proposer takes it. Without a proposer (or with a runtime that fails)
nothing is drafted and serving is unchanged. Drafts are keyed by the prompt's tokens; at most
:data:`MAX_PENDING` are kept (oldest dropped).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..compressors import CompressedKV, KVCompressor
from ..engine.cache import KVCache
from ..engine.draft_cache import DraftCaches
from ..engine.runtime import Runtime, Segment
from ..workers import torch_serial
from .draft_budget import DraftBudget
from .model_guard import ModelGuard

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
    over_budget: int = 0  # loads not drafted: their draft cache would pass the proposer's draft_cache_bytes
    draft_s: float = 0.0


class DraftJob:
    """One request's drafting; drafts grow in ``tokens`` until ``n``, the end of its load, or
    :meth:`stop`."""

    def __init__(self, req_id: str, prompt: Sequence[int], n: int, cache: KVCache, prefix: int, nbytes: int = 0):
        self.req_id, self.prompt, self.n = req_id, tuple(prompt), n
        self.tokens: list[int] = []
        self.cache: KVCache | None = cache  # dropped (its bytes given back) once drafting ends
        self.nbytes = nbytes
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


class LoadDrafter:
    """Drafts during prefix loads for one vLLM engine (see the module docstring).

    Threading: :meth:`start` runs on a load thread, :meth:`take` / :meth:`forget` /
    :meth:`count_use` on vLLM's worker thread, the drafting on this drafter's own thread (started by
    the first job, a daemon); one lock guards the jobs and counters."""

    def __init__(self, guard: ModelGuard):
        self.guard = guard
        self._rt: Runtime | None = None
        self._budget: DraftBudget | None = None
        self._caches: Callable[[KVCompressor, int], DraftCaches] | None = None
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._active: list[DraftJob] = []
        self._thread: threading.Thread | None = None
        self._jobs: OrderedDict[tuple[int, ...], DraftJob] = OrderedDict()
        self._stats = DraftStats()
        self._closed = False

    def close(self, timeout: float = 30.0) -> None:
        """Stop every job and join the drafter thread (after its current forward); idempotent."""
        with self._work:
            self._closed = True
            for job in self._active:
                job._stop.set()
            self._work.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def attach(self, rt: Runtime | None, budget: DraftBudget | None = None,
               caches: Callable[[KVCompressor, int], DraftCaches] | None = None) -> None:
        """The runtime drafts run on (the proposer's, over vLLM's module); ``None`` turns drafting off.
        ``budget``: the proposer's, which the draft caches of loads are charged to as well;
        ``caches(compressor, chunk_size)``: the proposer's draft caches of those chunks (default:
        dense ones), so a load's drafts read the bytes the proposer's do."""
        self._rt, self._budget, self._caches = rt, budget, caches

    @property
    def can_draft(self) -> bool:
        """A runtime is attached (the proposer runs in this engine)."""
        return self._rt is not None

    def stats(self) -> dict[str, Any]:
        return {**asdict(self._stats), "pending": len(self._jobs), "registered": self._rt is not None}

    def start(self, req_id: str, prompt: Sequence[int], ckvs: list[CompressedKV], compressor: KVCompressor,
              prefix: int, n: int) -> DraftJob | None:
        """Draft ``n`` tokens after ``prompt`` over the compressed chunks ``ckvs`` (its first ``prefix``
        tokens). Builds the draft cache here (the caller's thread), then hands the job to the drafter
        thread. ``None`` if no runtime is attached, nothing is left to prefill, the tail is longer
        than :data:`MAX_TAIL` (its prefill alone would hold the model for longer than a load is worth)
        or the draft cache would pass the budget (charged here, given back when drafting ends)."""
        rt, budget = self._rt, self._budget
        if rt is None or self._closed or n <= 0 or not ckvs or not 0 < len(prompt) - prefix <= MAX_TAIL:
            return None
        chunk = prefix // len(ckvs)
        caches = self._caches(compressor, chunk) if self._caches is not None else DraftCaches(rt, compressor, chunk)
        exact = len(prompt) - prefix + n + 1
        entries = caches.need(rt.new_cache(0), ckvs, exact)
        nbytes = caches.nbytes(entries=entries) if budget is not None else 0  # a packed prefix: trued up below
        if budget is not None and not budget.grow(0, nbytes):
            with self._lock:
                self._stats.over_budget += 1
            return None
        try:  # a chunk this compressor cannot read, or no memory: the charge must come back
            cache = caches.new(entries)
            caches.append(cache, ckvs, room=exact)
            if budget is not None:
                held = caches.nbytes(cache)
                budget.adjust(nbytes, held)
                nbytes = held
        except BaseException:
            if budget is not None:
                budget.give(nbytes)
            raise
        job = DraftJob(req_id, prompt, n, cache, prefix, nbytes)
        with self._work:
            if self._closed:  # closed meanwhile: the drafter thread is gone and would never end this job
                if budget is not None:
                    budget.give(nbytes)
                return None
            self._jobs[job.prompt] = job
            while len(self._jobs) > MAX_PENDING:
                self._jobs.popitem(last=False)[1]._stop.set()
            self._stats.jobs += 1
            self._active.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, args=(rt,), name="vericache-draft", daemon=True)
                self._thread.start()
                # A daemon thread still inside a forward when the interpreter finalizes is killed
                # as it takes the GIL back, inside torch's C++ frames: std::terminate ("terminate
                # called without an active exception"). Stopped and joined before that.
                atexit.register(self.close)
            self._work.notify()
        return job

    def pending(self) -> bool:
        """Some load's drafts wait for their request (a cheap check before :meth:`take`)."""
        return bool(self._jobs)

    def take(self, prompt: Sequence[int]) -> list[int] | None:
        """Stop and remove the job of ``prompt``; its drafts (``None`` if there is none)."""
        with self._lock:
            job = self._jobs.pop(tuple(prompt), None)
        return None if job is None else job.stop()

    def forget(self, req_ids: set[str]) -> None:
        """Drop the jobs of requests that ended without taking their drafts (aborted)."""
        if not req_ids or not self._jobs:
            return
        with self._lock:
            for key in [k for k, j in self._jobs.items() if j.req_id in req_ids]:
                self._jobs.pop(key)._stop.set()

    def count_use(self, matched: bool) -> None:
        with self._lock:
            if matched:
                self._stats.taken += 1
            else:
                self._stats.mismatched += 1

    def _loop(self, rt: Runtime) -> None:
        """One thread for all jobs: each step, one forward over every active job (a new job's tail
        prefill or the last draft), only while vLLM's own forward does not want the model, on one
        intra-op thread (this thread's own setting, workers.torch_serial): the load it overlaps needs a
        core too."""
        torch_serial()
        while True:
            with self._work:
                for job in [j for j in self._active if not j.active]:
                    self._active.remove(job)
                    job.cache.release()  # arena slots, if any
                    job.cache = None  # the drafts are in job.tokens: the cache's bytes go back
                    if self._budget is not None:
                        self._budget.give(job.nbytes)
                    job.done.set()
                while not self._active and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                jobs = list(self._active)
            self.guard.wait_idle()  # vLLM's steps first: drafting fills the gaps (the wait for a load)
            t0 = time.perf_counter()
            try:
                tokens = torch.tensor([t for j in jobs for t in j.next])
                positions = torch.cat([torch.arange(j.pos, j.pos + len(j.next)) for j in jobs])
                rows = torch.tensor(list(itertools.accumulate(len(j.next) for j in jobs))) - 1
                with self.guard.lock:
                    logits, _ = rt.forward(tokens, positions, [Segment(j.cache, len(j.next)) for j in jobs],
                                           rows=rows)
                picks = logits.argmax(-1).tolist()
            except Exception as e:  # drafting is an optimisation: a failure only loses the drafts
                logger.warning("vericache drafts: drafting during the load failed (%s: %s)", type(e).__name__, e)
                picks = None
            with self._work:
                self._stats.draft_s += time.perf_counter() - t0
                for j, t in zip(jobs, picks or [None] * len(jobs)):
                    if t is None:
                        j._stop.set()
                        continue
                    j.pos += len(j.next)
                    j.next = [t]
                    j.tokens.append(t)
                    self._stats.tokens += 1
                    self._stats.during_load += not j._loaded.is_set()
