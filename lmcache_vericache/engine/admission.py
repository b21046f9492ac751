"""Admission: which requests of a call get caches now, and their set-up (prefill or the store's prefix).

A ``generate()`` call is a :class:`Batch`. Requests are set up in order while the call's
:class:`~.residency.Residency` admits them under ``kv_budget_bytes`` (the first always); the rest
wait for finished ones. A request whose prompt equals one set up since the last decode step copies
that one's caches instead of prefilling again (a *twin*: nothing decoded in between, so the caches
are the same), except a full cache whose stored prefix is still to be swapped in (its swap may be
writing it): that one's length and poisoned prefix are taken instead. Single-threaded: the engine's
loop calls it between forwards (a swap it starts writes only its own request's full cache).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .. import metrics as M
from ..backends import DualTierStore
from ..backends.keys import KeySpace
from .cache import poison_prefix
from .config import EngineConfig
from .prefill import Prefiller
from .request import Request
from .residency import Residency
from .runtime import Runtime
from .verify import Sampling

Tensor = torch.Tensor
Prompts = Sequence[int] | Tensor | Sequence[Sequence[int]]


@dataclass
class Batch:
    """One call's prompts and what every request of it shares. Request ``i`` samples with seed
    ``seed + i``; ``t0`` is the call's start (time to first token counts from it)."""

    prompts: list[list[int]]
    max_new: int
    sampling: Sampling
    seed: int = 0
    t0: float = field(default_factory=time.perf_counter)
    pending: list[int] = field(default_factory=list)  # indices not admitted yet, in order

    @classmethod
    def of(cls, prompts: Prompts, max_new: int, vocab: int, sampling: Sampling, seed: int) -> Batch:
        """Validated prompts (token ids below ``vocab``) and ``max_new``; every prompt pending."""
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new!r}")
        if isinstance(prompts, Tensor):
            prompts = prompts.tolist()
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        batch = [prompts] if isinstance(prompts[0], int) else [list(p) for p in prompts]
        for i, p in enumerate(batch):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if not all(isinstance(t, int) and 0 <= t < vocab for t in p):
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        return cls(batch, max_new, sampling, seed, pending=list(range(len(batch))))


class Admission:
    """Sets up one engine's requests. ``draft`` requests get a draft cache and count in the
    engine's metrics; reference requests (``draft=False``) get the full cache only."""

    def __init__(self, rt: Runtime, config: EngineConfig, prefiller: Prefiller, key_space: KeySpace,
                 store: DualTierStore | None, eos_ids: set[int], verkv: bool):
        self.rt, self.config, self.prefiller, self.key_space = rt, config, prefiller, key_space
        self.store, self.eos_ids, self.verkv = store, eos_ids, verkv

    def residency(self, batch: Batch, full_kv: str) -> Residency:
        """The call's residency, sized for its largest request."""
        cap = max(self.config.capacity(len(ids), batch.max_new) for ids in batch.prompts)
        return Residency(full_kv, self.config.kv_budget_bytes, self.config.verify_buffers, len(batch.prompts),
                         cap * self.rt.kv_bytes_per_token(), lambda: self.rt.new_cache(cap), self.store is not None)

    def admit(self, batch: Batch, running: list[Request], res: Residency,
              on_setup: Callable[[Request], None] | None = None) -> list[Request]:
        """Set up pending requests, in order, while the budget admits them next to ``running`` (one
        at least when nothing runs). Requests done at set-up (one token, or EOS) are released.
        ``on_setup(r)`` runs right after each live request's set-up, before the next one's (the engine
        starts its first round there: a stored prefix's swap then runs beside the later set-ups)."""
        new: list[Request] = []
        twins: dict[tuple[int, ...], tuple[Request, Tensor | None]] = {}
        while batch.pending:
            live = [r for r in running + new if not r.done]
            full_bytes = (self.config.capacity(len(batch.prompts[batch.pending[0]]), batch.max_new)
                          * self.rt.kv_bytes_per_token())
            if not res.admits(res.held_bytes(live), full_bytes, first=not live):
                break
            r = self.setup(batch, batch.pending[0], res, twins, draft=True)
            if r is None:  # offload: every verify buffer is in a round; prefill needs one
                break
            batch.pending.pop(0)
            res.observe(r.draft, full_bytes)
            new.append(r)
            if on_setup is not None and not r.done:
                on_setup(r)
        for r in new:
            if r.done:
                r.release()
        return new

    def setup(self, batch: Batch, i: int, res: Residency, twins: dict, *, draft: bool,
              stored_prefix: bool = False) -> Request | None:
        """Caches of request ``i`` (``None``: offload and no verify cache free for its prefill).
        ``twins``: requests set up since the last decode step, by prompt. ``stored_prefix``
        (reference requests): the leading full chunks the store holds are read, not prefilled."""
        ids = batch.prompts[i]
        # Set-up time (``prefill_s``) includes the cache's allocation: a zeroed 8k cache of SmolLM2 is
        # 190 MB, 0.1-0.25 s to fault in, a cost of admitting the request, not of decoding it.
        t0 = time.perf_counter()
        twin, logits = twins.get(tuple(ids), (None, None))
        # A twin's full cache (none kept in offload or verkv) is copied only when it is whole: one whose
        # prefix is still to be swapped in (its swap may be writing it now) gives its length and
        # poisoned prefix instead.
        held = twin.full if twin is not None else None
        arriving = held is not None and twin.prefix_missing
        if res.offload:  # the verify cache goes back to the pool below
            full = res.pool.lease()
        else:
            full = held.clone() if held is not None and not arriving else self.rt.new_cache(
                self.config.capacity(len(ids), batch.max_new))
        if full is None:
            return None
        if arriving:
            full.n = twin.prefix
            poison_prefix(full, twin.prefix)
        r = Request(i, list(ids), len(ids), batch.max_new, full, gen=torch.Generator().manual_seed(batch.seed + i),
                    t0=batch.t0)
        r.stats.prompt_tokens = len(ids)
        if twin is not None:
            r.draft = twin.draft.clone() if twin.draft is not None else None
            r.prefix, r.keys, r.prefix_missing = twin.prefix, list(twin.keys), twin.prefix_missing
            r.queries = twin.queries
            for name in ("compressed_bytes", "full_prefix_bytes", "cached_chunks", "bytes_moved"):
                setattr(r.stats, name, getattr(twin.stats, name))
        else:
            keys = self.key_space.token_keys(r.tokens) if self.store is not None and (draft or stored_prefix) else []
            logits = self.prefiller.setup(r, keys, draft)
            twins[tuple(ids)] = (r, logits)
        r.stats.prefill_s = time.perf_counter() - t0
        if logits is not None:
            r.emit([r.pick(logits, batch.sampling)], self.eos_ids)
        r.start = r.pos if logits is not None else r.prefix
        if res.offload:  # the full KV now lives in the store and the draft cache's exact suffix
            res.pool.release(r.full)
            r.full = None
        if draft and self.verkv:  # never verified: KVFetch reads full chunks of its own
            r.full = None
        if draft:
            M.ENGINE_REQUESTS.inc()
            M.ENGINE_CACHED.inc(r.stats.cached_chunks)
            M.ENGINE_EMITTED.inc(r.stats.new_tokens)
        return r
