"""Per-request state and statistics of the draft/verify loop, and the request's own transitions
(:meth:`Request.emit`, :meth:`Request.pick`, :meth:`Request.release`)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .cache import KVCache
from .horizon import Horizon
from .swap import SwapIn
from .verify import Sampling, host


@dataclass
class RequestStats:
    """``accepted[i]``: drafts accepted in round i (each round also emits one token of the target's
    own, so a round emits ``accepted[i] + 1`` tokens at most). Seconds are wall time of the forwards
    the request took part in (a batched forward counts for every request in it)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    prefill_s: float = 0.0  # set-up: cache allocation, prefill or prefix read, draft cache laid out
    draft_s: float = 0.0
    draft_steps: int = 0
    verify_s: float = 0.0
    swap_s: float = 0.0
    swap_wait_s: float = 0.0
    bytes_moved: int = 0
    recomputed_chunks: int = 0  # full chunks the store missed (or served damaged), recomputed from tokens
    cached_chunks: int = 0  # prompt chunks taken from the store instead of prefilled (shared prefix)
    generated_chunks: int = 0  # chunks past the prompt compressed into the draft prefix (long generations)
    ttft_s: float = 0.0  # from the start of generate() to the request's first emitted token
    compressed_bytes: int = 0
    full_prefix_bytes: int = 0
    kvfetch: dict[str, float] | None = None  # KVFetch counters (verkv mode, KVFetch drafter); see engine/kvfetch.py

    @property
    def mean_accepted(self) -> float:
        """Mean tokens emitted per round, counting the target's own token (max L+1)."""
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))

    @property
    def hidden_swap_fraction(self) -> float:
        """Share of swap time that overlapped drafting (1.0 when nothing was swapped)."""
        if self.swap_s <= 0:
            return 1.0
        return max(0.0, 1.0 - self.swap_wait_s / self.swap_s)

    @property
    def compression_ratio(self) -> float:
        return self.full_prefix_bytes / self.compressed_bytes if self.compressed_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(mean_accepted=self.mean_accepted, hidden_swap_fraction=self.hidden_swap_fraction,
                 compression_ratio=self.compression_ratio)
        return d


@dataclass
class Result:
    tokens: list[int]  # generated tokens (the prompt excluded)
    stats: RequestStats
    margins: list[float] | None = None  # reference decoding: top-1 minus top-2 logit per step


@dataclass
class Request:
    """Invariant between rounds: both caches hold the exact-or-draft KV of ``tokens[:start]`` and the
    next round feeds ``tokens[start:]`` first: the last token (the target's own), or, before the first
    round of a prompt whose prefix came from the store, the uncached prompt tail. The full cache holds
    all positions; the draft cache holds the compressed prefix (``prefix`` tokens) then positions
    ``prefix...``. In offload mode ``full`` is a pooled verify cache, held from a round's start to
    its verification only (``None`` in between)."""

    idx: int
    tokens: list[int]
    n_prompt: int
    max_new: int
    full: KVCache | None
    draft: KVCache | None = None
    prefix: int = 0
    prefix_missing: bool = False  # the full cache's prefix is not there yet (read from the store)
    queries: torch.Tensor | None = None  # the prompt's observation-window queries (scoring generated chunks)
    exact_only: bool = False  # generated KV is not compressed any more (a put failed, no queries)
    keys: list[str] = field(default_factory=list)
    restored: set[int] = field(default_factory=set)  # prefix chunks recomputed and put back into the store
    start: int = 0  # position of the first token the round feeds (the tail of a cached prompt, else pos)
    t0: float = 0.0  # arrival time (perf_counter)
    gen: torch.Generator | None = None
    horizon: Horizon | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    # current round
    limit: int = 0  # drafts wanted this round
    drafts: list[int] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    swap: SwapIn | None = None
    round_draft_s: float = 0.0  # seconds of the round's draft forwards
    round_pure_s: float = 0.0  # of them, forwards without verify rows (staggered forwards can mix)
    round_pure_drafts: int = 0  # drafts those made
    round_verify_s: float = 0.0
    round_verify_pure: bool = True  # its verify forward had no draft rows
    done: bool = False
    margins: list[float] = field(default_factory=list)

    @property
    def out(self) -> list[int]:
        return self.tokens[self.n_prompt:]

    @property
    def remaining(self) -> int:
        return self.max_new - (len(self.tokens) - self.n_prompt)

    @property
    def pos(self) -> int:
        """Position of the last token (the next one fed)."""
        return len(self.tokens) - 1

    def emit(self, new: list[int], eos_ids: set[int]) -> None:
        """Append ``new`` tokens up to the request's limit; the request is done at its limit or
        after an EOS (nothing past an EOS is emitted)."""
        if not self.stats.ttft_s:
            self.stats.ttft_s = time.perf_counter() - self.t0
        for t in new[:self.remaining]:
            self.tokens.append(t)
            if t in eos_ids:
                self.done = True
                break
        self.stats.new_tokens = len(self.out)
        if self.remaining <= 0:
            self.done = True

    def pick(self, logits: torch.Tensor, sampling: Sampling) -> int:
        """The target's own next token from ``logits``; records the top-1 minus top-2 margin."""
        logits = host(logits)  # one read of the row, then everything on the host
        top2 = logits.topk(2).values
        self.margins.append(float(top2[0] - top2[1]))
        return sampling.pick(logits, self.gen)[0]

    def release(self) -> None:
        """Free the request's KV (a finished request needs none); KVFetch counters go to its stats first."""
        if self.draft is not None:
            fetch = getattr(self.draft.packed, "stats", None)  # a KVFetch prefix's counters
            if fetch is not None:
                self.stats.kvfetch = fetch.as_dict()
            self.draft.release()  # arena slots, now and on this thread
        self.full = self.draft = None
