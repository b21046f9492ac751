"""One round of a request: draft -> swap -> verify -> commit, and the forward steps that carry rounds.

A round starts in :meth:`Rounds.start` (its draft limit from the horizon; offload: a place in the
verify-cache queue; resident with a prefix read from the store: the swap). Each :meth:`Rounds.step`
is one forward over a flat batch of :class:`Feed`\\ s: requests still drafting feed their last
draft (or, first, the round's start tokens) over the draft cache; requests done drafting feed
``tokens[start:] + drafts`` over the full cache once their swap is in. :meth:`Rounds.verify`
accepts a prefix of the drafts, commits the exact KV of the accepted tokens to both caches and
starts the next round. Scheduling changes speed, never tokens: each request's tokens depend only
on its own caches.

Single-threaded (the engine's loop); a swap runs on its own thread and writes only into its
request's full cache, which nothing reads before :meth:`~.swap.SwapIn.wait`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import metrics as M
from ..backends import DualTierStore
from .cache import KVCache
from .horizon import Horizon
from .ngram import NgramProposer
from .prefill import Prefiller
from .request import Request
from .residency import Residency
from .runtime import Runtime, Segment
from .swap import Staging, SwapIn
from .verify import Sampling, accept, host

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


@dataclass
class Feed:
    """One request's part of a step: ``verify`` (its block over the full cache) or a draft step;
    its logits start at row ``row``; ``guesses``: the tokens checked (drafts, or n-gram proposals)."""

    request: Request
    verify: bool
    row: int
    guesses: list[int]


@dataclass
class VerifiedRound:
    """A round verified in a lock-step forward, for the batch's horizon."""

    request: Request
    drafted: int
    accepted: int
    draft_step_s: float
    swap_s: float
    draft_s: float  # the round's draft forwards


@dataclass
class StepInputs:
    """The flat batch of one forward: tokens, positions, one segment per feed, logits rows wanted."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def add(self, cache: KVCache, feed: list[int], pos: int, first_row: int) -> int:
        """Append ``feed`` at ``pos`` over ``cache``, logits wanted from ``feed[first_row]`` on;
        returns the first of those rows."""
        start, row = len(self.tokens), len(self.rows)
        self.tokens += feed
        self.positions += range(pos, pos + len(feed))
        self.segments.append(Segment(cache, len(feed)))
        self.rows += range(start + first_row, start + len(feed))
        return row


class Rounds:
    """The rounds of one ``generate()`` call. ``batch_horizon``: lock step (one horizon for the
    batch, learning from every round verified in a forward); ``None``: each request has its own."""

    def __init__(self, rt: Runtime, prefiller: Prefiller, store: DualTierStore | None, *, chunk_size: int,
                 query_window: int, eos_ids: set[int], ngram: NgramProposer | None, verkv: bool,
                 sampling: Sampling, res: Residency, batch_horizon: Horizon | None,
                 on_round: Callable[[Request], None] | None, swap_staging: Staging | None = None):
        self.rt, self.prefiller, self.store = rt, prefiller, store
        self.chunk_size, self.query_window, self.eos_ids = chunk_size, query_window, eos_ids
        self.ngram, self.verkv, self.sampling, self.res = ngram, verkv, sampling, res
        self.batch_horizon, self.on_round, self.swap_staging = batch_horizon, on_round, swap_staging
        self._verified: list[VerifiedRound] = []

    # -- a round starts -----------------------------------------------------------------------------
    def start(self, r: Request) -> None:
        r.drafts, r.qs, r.round_draft_s, r.round_pure_s, r.round_pure_drafts = [], [], 0.0, 0.0, 0
        r.limit = self.limit(r)
        if self.verkv:  # every token comes from the (certified) drafter
            return
        if self.res.offload:  # a verify cache when its turn comes (first come, first served)
            self.res.waiting.append(r)
        elif r.prefix_missing:  # resident: a prefix read from the store is swapped in once
            r.swap = SwapIn(self.store, r.keys, r.full, self.chunk_size, self.swap_staging)

    def limit(self, r: Request, L: int | None = None) -> int:
        """Drafts of ``r``'s round: ``L`` (default its horizon's), capped by the tokens it still may
        emit (a verified round also emits the target's own token; verkv rounds emit only drafts)."""
        return max(0, min(r.horizon.L if L is None else L, r.remaining - (not self.verkv)))

    def draft_while_swapping(self, r: Request) -> None:
        """A cached prompt's first round (its stored prefix arriving by the swap). A tail of several
        tokens drafts only while the exact prefix is still arriving: once it is in, verifying the
        tail at once gives the first token soonest. A tail of one token (the benchmarks' stored
        prompts) keeps its L once the prefix is in: there the swap ends within the first draft steps
        (which it slows), and rounds cut to 1-3 drafts measured drafting too slow to beat plain
        decoding (8k / batch 8, TurboQuant: 1.12x against 1.26x). While the prefix is not in, the
        verify would wait for it anyway, so with the full KV resident and an auto horizon the round
        drafts on past its L (up to ``max_len`` and the tokens left; an EOS ends it): drafts that
        cost the verify nothing where the store is slow (a disk, a network). Not while the horizon
        has chosen plain decoding (a request admitted mid-run would hold the batch in drafting), and
        not in offload, whose horizon floors L by the swap time."""
        if not (r.prefix_missing and r.swap is not None):  # not a cached prompt's first round
            return
        if r.swap.done:
            if r.start < r.pos:
                r.limit = min(r.limit, len(r.drafts))
        elif (r.horizon.draft_len == "auto" and r.horizon.L > 0 and not self.res.offload
              and not (r.drafts and r.drafts[-1] in self.eos_ids)):  # L = 0: the batch decodes plainly
            r.limit = max(r.limit, min(len(r.drafts) + 1, self.limit(r, r.horizon.max_len)))

    def lease_waiting(self) -> None:
        """Offload: hand free verify caches to the requests waiting longest. Each gets the exact
        suffix copied in from its draft cache and starts swapping its full prefix from the store."""
        res = self.res
        while res.waiting:
            r = res.waiting[0]
            if r.done:
                res.waiting.popleft()
                continue
            full = res.pool.lease()
            if full is None:
                return
            res.waiting.popleft()
            n = r.start - r.prefix  # positions [prefix, start) are exact in the draft cache
            if n:
                k, v = r.draft.suffix(0, n)
                full.k[:, :, r.prefix:r.start], full.v[:, :, r.prefix:r.start] = k, v
            full.n, r.full = r.start, full
            if r.prefix:
                r.swap = SwapIn(self.store, r.keys, full, self.chunk_size, self.swap_staging)

    # -- one forward --------------------------------------------------------------------------------
    def step(self, drafting: list[Request], verifying: list[Request]) -> None:
        """One forward: a draft step for ``drafting``, the verify block of ``verifying``."""
        for r in verifying:
            self._finish_swap(r)
        inputs, feeds = StepInputs(), []
        for r in drafting:
            # First step of a round feeds tokens[start:] (one token, or a cached prompt's tail).
            base, pos = ([r.drafts[-1]], r.pos + len(r.drafts)) if r.drafts else (r.tokens[r.start:], r.start)
            proposed = (self.ngram.propose(r.tokens + r.drafts, r.limit - len(r.drafts) - 1)
                        if self.ngram is not None else [])
            feeds.append(Feed(r, False, inputs.add(r.draft, base + proposed, pos, len(base) - 1), proposed))
        for r in verifying:
            row = inputs.add(r.full, r.tokens[r.start:] + r.drafts, r.start, r.pos - r.start)
            feeds.append(Feed(r, True, row, r.drafts))
        t0 = time.perf_counter()
        logits, _ = self.rt.forward(torch.tensor(inputs.tokens), torch.tensor(inputs.positions), inputs.segments,
                                    rows=torch.tensor(inputs.rows))
        # One read to the host per forward: every row's argmax (greedy) or the logits (sampling,
        # whose generators live on the host). It waits for the forward, so it is inside the timing.
        picks = host(logits.argmax(-1)).tolist() if self.sampling.greedy else None
        if picks is None:
            logits = host(logits)
        dt = time.perf_counter() - t0
        # Staggered, one forward can carry draft rows of some requests and verify rows of others: its
        # time is no sample of either kind's cost (the horizons'), only of the rounds' seconds.
        pure = not (drafting and verifying)
        for f in feeds:
            span = slice(f.row, f.row + len(f.guesses) + 1)
            r, rows, top = f.request, logits[span], picks[span] if picks is not None else None
            if f.verify:
                r.stats.verify_s += dt
                r.round_verify_s, r.round_verify_pure = dt, pure
                self.verify(r, rows, top)
            else:
                r.stats.draft_s += dt
                r.round_draft_s += dt
                r.stats.draft_steps += 1
                had = len(r.drafts)
                self._take_drafts(r, f.guesses, rows, top)
                if pure:
                    r.round_pure_s += dt
                    r.round_pure_drafts += len(r.drafts) - had
        if self._verified:  # lock step: the batch's horizon learns from every round of this forward
            done, self._verified = self._verified, []
            steps = [v.draft_step_s for v in done if v.drafted > 0]  # capped last rounds may not draft
            self.batch_horizon.update_rounds([(v.drafted, v.accepted) for v in done],
                                             sum(steps) / len(steps) if steps else 0.0,
                                             max(v.swap_s for v in done), dt, max(v.draft_s for v in done) + dt)
            for v in done:  # their next rounds started with the L from before this update
                if not v.request.done:
                    v.request.limit = self.limit(v.request)

    def cancel(self, requests: list[Request]) -> None:
        """Stop every swap in flight (an error left them): no thread keeps writing into the caches."""
        self._verified = []
        for r in requests:
            if r.swap is not None:
                r.swap.cancel()
                r.swap = None

    def _take_drafts(self, r: Request, proposed: list[int], logits: Tensor, top: list[int] | None) -> None:
        """``top``: the rows' argmax (greedy), read to the host with the forward's."""
        sampling = self.sampling
        if proposed:
            # Stacked proposer: the drafter checks the n-gram guesses like a verifier (one-hot proposal
            # distribution), so the drafts it passes on still follow its own distribution q.
            onehot = [torch.nn.functional.one_hot(torch.tensor(t), logits.shape[-1]).float() for t in proposed]
            k, nxt = _accept(proposed, None if sampling.greedy else onehot, logits, sampling, r.gen, top)
            new = proposed[:k] + [nxt]
            qs = [sampling.probs(logits[i]) for i in range(k + 1)] if not sampling.greedy else []
            r.draft.n -= len(proposed) - k  # drop the KV of rejected guesses
        else:
            nxt, q = (top[-1], None) if top is not None else sampling.pick(logits[-1], r.gen)
            new, qs = [nxt], [q] if q is not None else []
        room = r.limit - len(r.drafts)
        new, qs = new[:room], qs[:room]
        for j, t in enumerate(new):
            r.drafts.append(t)
            if qs:
                r.qs.append(qs[j])
            if t in self.eos_ids:  # nothing after an EOS can be emitted: verify now
                r.limit = len(r.drafts)
                break

    def _finish_swap(self, r: Request) -> None:
        if r.swap is None:
            return
        t0 = time.perf_counter()
        misses = r.swap.wait()
        wait_s = time.perf_counter() - t0
        r.stats.swap_wait_s += wait_s
        r.stats.swap_s += r.swap.seconds
        M.ENGINE_SWAP_WAIT.observe(wait_s)
        M.ENGINE_SWAP_SECONDS.inc(r.swap.seconds)
        M.ENGINE_RECOMPUTED.inc(len(misses))
        r.stats.bytes_moved += r.swap.nbytes
        if misses:
            logger.warning("request %d: %d of %d full prefix chunks missed in the store (chunks %s); "
                           "recomputing their exact KV from the tokens", r.idx, len(misses), len(r.keys), misses)
        for i in misses:  # never verify against wrong KV: recompute the chunk from its tokens
            self.prefiller.recompute_chunk(r, i)
            r.stats.recomputed_chunks += 1
        r.prefix_missing = False

    # -- a round ends -------------------------------------------------------------------------------
    def verify(self, r: Request, logits: Tensor, top: list[int] | None = None) -> None:
        """Accept a prefix of the drafts from the verify block's ``logits`` (``top``: their argmax,
        greedy), commit, start the next round."""
        t = r.pos
        k, nxt = _accept(r.drafts, r.qs if not self.sampling.greedy else None, logits, self.sampling, r.gen, top)
        # Commit the exact KV of the fed tokens that were accepted: tokens[start:] and drafts[:k].
        r.full.n = t + k + 1
        r.draft.n = t - r.prefix + k + 1
        r.draft.write_suffix(r.start - r.prefix, *r.full.suffix(r.start, t + k + 1))
        drafted = len(r.drafts)
        # the horizon's cost samples come from pure forwards only (0: none this round); lock step's are all pure
        step_s = r.round_pure_s / r.round_pure_drafts if r.round_pure_drafts else 0.0
        swap_s = r.swap.seconds if r.swap is not None else 0.0
        if self.batch_horizon is not None:
            self._verified.append(VerifiedRound(r, drafted, k, step_s, swap_s, r.round_draft_s))
        else:
            r.horizon.update(drafted, k, step_s, swap_s, r.round_verify_s if r.round_verify_pure else 0.0,
                             r.round_draft_s + r.round_verify_s)
        r.swap = None
        self._commit(r, r.drafts[:k] + [nxt], k)
        if not r.done:
            self.prefiller.compress_generated(r, self.query_window, self.res.offload)
        if self.on_round is not None:
            self.on_round(r)
        if self.res.offload:  # the committed exact KV is in the draft cache's suffix now
            self.res.pool.release(r.full)
            r.full = None
        self._next(r)

    def commit_unverified(self, r: Request) -> None:
        """verkv mode: emit the round's drafts as they are (certified attention, no verification).
        The last draft's KV is not in the draft cache yet: the next round feeds it (``start = pos``)."""
        self._commit(r, r.drafts, max(0, len(r.drafts) - 1))  # a round of L emits L (not L + 1)
        if self.on_round is not None:
            self.on_round(r)
        self._next(r)

    def _next(self, r: Request) -> None:
        if r.done:
            r.release()
        else:
            self.start(r)

    def _commit(self, r: Request, tokens: list[int], accepted: int) -> None:
        """Record a finished round (stats, metrics) and emit its ``tokens``; the next feed starts at
        the last of them."""
        r.stats.rounds += 1
        r.stats.accepted.append(accepted)
        r.stats.drafted.append(len(r.drafts))
        emitted = r.stats.new_tokens
        r.emit(tokens, self.eos_ids)
        r.start = r.pos
        M.ENGINE_ROUNDS.inc()
        M.ENGINE_ACCEPTED.observe(accepted)
        M.ENGINE_DRAFTED.inc(len(r.drafts))
        M.ENGINE_EMITTED.inc(r.stats.new_tokens - emitted)


def _accept(drafts: list[int], q: list[Tensor] | None, logits: Tensor, sampling: Sampling,
            gen: torch.Generator | None, top: list[int] | None) -> tuple[int, int]:
    """:func:`~.verify.accept`, given the rows' argmax where the step read it (greedy)."""
    if top is None:
        return accept(drafts, q, logits, sampling, gen)
    return accept(drafts, q, logits, sampling, gen, target=top)
