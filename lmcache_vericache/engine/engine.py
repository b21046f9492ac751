"""VeriCache decode loop: draft on the compressed KV, verify on the full KV, swap hidden behind drafting.

Per request and round: start swapping the full prefix into the verify buffer, draft ``L`` tokens on
the draft cache (compressed prefix + exact suffix), wait for the swap (recomputing any chunk the
source missed), verify ``[last token] + drafts`` in one forward over the full cache, emit the accepted
drafts plus the target's own token, and bring both caches to the committed point: the full cache
keeps exactly the verify forward's KV of the committed tokens, the draft cache's suffix gets a copy
of it.

Many requests run as one flat batch per step. With ``stagger`` they are not held in lock step:
each request drafts or verifies on its own schedule (half of them start with a half-length round),
so some draft while others verify and the swaps spread out. Scheduling changes speed, never tokens:
each request's tokens depend only on its own caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import compressors
from ..compressors import KVCompressor
from .horizon import DraftLen, Horizon, check_draft_len
from .proposer import NgramProposer
from .request import Request, Result
from .runtime import KVCache, Runtime, Segment
from .swap import FileSource, MemorySource, SwapIn, chunk_keys
from .verify import Sampling, accept

Tensor = torch.Tensor
Prompts = Sequence[int] | Tensor | Sequence[Sequence[int]]


class VeriCacheEngine:
    """Lossless compressed-KV drafting for a Llama-family HF model.

    ``source``: where full prefix chunks live between verifications: ``"memory"`` (host dict),
    ``"file"`` (one file per chunk under ``swap_dir``), ``"resident"`` (never swapped out: the
    baseline where the full KV fits), or any object with ``put``/``prefetch`` (e.g. the dual-tier store).
    """

    def __init__(self, model: torch.nn.Module, compressor: str | KVCompressor = "int8",
                 compressor_params: dict[str, Any] | None = None, *, chunk_size: int = 256,
                 draft_len: DraftLen = 16, max_draft_len: int = 64, source: Any = "memory",
                 swap_dir: str | None = None, stagger: bool = True, ngram: NgramProposer | None = None,
                 query_window: int = 32, eos_ids: set[int] | None = None):
        self.rt = Runtime(model)
        if isinstance(compressor, str):
            compressor = compressors.get(compressor, **(compressor_params or {}))
        elif compressor_params:
            raise ValueError("compressor_params only apply when compressor is given by name")
        self.compressor = compressor
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        check_draft_len(draft_len, max_draft_len)
        self.chunk_size, self.draft_len, self.max_draft_len = chunk_size, draft_len, max_draft_len
        self.stagger, self.ngram, self.query_window = stagger, ngram, query_window
        self.eos_ids = set(self.rt.eos_ids if eos_ids is None else eos_ids)
        if source == "memory":
            source = MemorySource()
        elif source == "file":
            if swap_dir is None:
                raise ValueError("source='file' needs swap_dir")
            source = FileSource(swap_dir)
        elif source == "resident":
            source = None
        elif isinstance(source, str) or not hasattr(source, "prefetch"):
            raise ValueError(f"source must be 'memory', 'file', 'resident' or an object with prefetch(), got {source!r}")
        self.source = source
        self._on_round: Callable[[Request], None] | None = None

    # -- public API -------------------------------------------------------------------------------
    def generate(self, prompts: Prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, draft_len: DraftLen | None = None,
                 stagger: bool | None = None, on_round: Callable[[Request], None] | None = None) -> list[Result]:
        """Decode every prompt (token ids) with draft/verify; request i samples with seed ``seed + i``.
        ``on_round(request)`` runs after each round's commit (observability and tests)."""
        sampling = Sampling(temperature, top_k, top_p)
        draft_len = self.draft_len if draft_len is None else draft_len
        check_draft_len(draft_len, self.max_draft_len)
        stagger = self.stagger if stagger is None else stagger
        reqs = self._start(prompts, max_new_tokens, sampling, seed, draft=True)
        self._on_round = on_round
        for r in reqs:
            r.horizon = Horizon(draft_len, self.max_draft_len)
            if not r.done:
                self._new_round(r)
                if stagger and r.idx % 2 and r.limit > 1:
                    r.limit //= 2  # a half-length first round puts odd requests out of phase
        while True:
            active = [r for r in reqs if not r.done]
            if not active:
                break
            drafting = [r for r in active if len(r.drafts) < r.limit]
            # Lock step: nobody verifies while anybody still drafts.
            verifying = [r for r in active if len(r.drafts) >= r.limit] if (stagger or not drafting) else []
            self._step(drafting, verifying, sampling)
        return [Result(r.out, r.stats) for r in reqs]

    def reference(self, prompts: Prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0) -> list[Result]:
        """Plain full-KV decoding in the same runtime: one token per forward. Records, per step, the
        top-1 minus top-2 logit margin (a divergence at a near-zero margin is a floating-point tie)."""
        sampling = Sampling(temperature, top_k, top_p)
        reqs = self._start(prompts, max_new_tokens, sampling, seed, draft=False)
        while active := [r for r in reqs if not r.done]:
            t0 = time.perf_counter()
            logits, _ = self.rt.forward(torch.tensor([r.tokens[-1] for r in active]),
                                        torch.tensor([r.pos for r in active]), [Segment(r.full, 1) for r in active])
            dt = time.perf_counter() - t0
            for r, row in zip(active, logits):
                r.stats.verify_s += dt
                self._emit(r, [self._pick(r, row, sampling)])
        return [Result(r.out, r.stats, r.margins) for r in reqs]

    # -- set-up -----------------------------------------------------------------------------------
    def _start(self, prompts: Prompts, max_new: int, sampling: Sampling, seed: int, draft: bool) -> list[Request]:
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new!r}")
        batch = _as_batch(prompts, self.rt.vocab_size)
        reqs: list[Request] = []
        done: dict[tuple[int, ...], tuple[Request, Tensor]] = {}  # identical prompts share one prefill
        for i, ids in enumerate(batch):
            cap = len(ids) + max_new + self.max_draft_len + 2
            gen = torch.Generator().manual_seed(seed + i)
            r = Request(i, list(ids), len(ids), max_new, self.rt.new_cache(cap), gen=gen)
            r.stats.prompt_tokens = len(ids)
            t0 = time.perf_counter()
            if tuple(ids) in done:
                twin, logits = done[tuple(ids)]
                r.full = _clone(twin.full)
                r.draft = _clone(twin.draft) if twin.draft is not None else None
                r.prefix, r.keys = twin.prefix, twin.keys
                r.stats.compressed_bytes, r.stats.full_prefix_bytes = twin.stats.compressed_bytes, twin.stats.full_prefix_bytes
            else:
                logits, queries = self._prefill(r)
                if draft:
                    self._build_draft(r, queries)
                done[tuple(ids)] = (r, logits)  # nothing decodes before _start returns: r stays pristine
            r.stats.prefill_s = time.perf_counter() - t0
            self._emit(r, [self._pick(r, logits, sampling)])
            reqs.append(r)
        return reqs

    def _prefill(self, r: Request) -> tuple[Tensor, Tensor | None]:
        """Exact KV of the prompt, chunk by chunk (the same pieces a recompute uses); returns the
        last position's logits and the observation-window queries of the prompt's last tokens."""
        ids, c, n = r.tokens, self.chunk_size, len(r.tokens)
        w = min(self.query_window, n)
        starts = list(range(0, n, c))
        if len(starts) > 1 and n - starts[-1] < w:
            starts.pop()  # the last piece must hold the whole observation window
        for j, s in enumerate(starts):
            e = starts[j + 1] if j + 1 < len(starts) else n
            last = e == n
            logits, q = self.rt.forward(torch.tensor(ids[s:e]), torch.arange(s, e), [Segment(r.full, e - s)],
                                        rows=torch.tensor([e - s - 1]), capture_q=w if last else 0)
        return logits[0], q

    def _build_draft(self, r: Request, queries: Tensor | None) -> None:
        """Compress full chunks of the prompt, hand the full chunks to the source, and lay out the
        draft cache: per layer the decompressed chunks, then the exact suffix."""
        c, rt = self.chunk_size, self.rt
        n_chunks = len(r.tokens) // c
        r.prefix = n_chunks * c
        r.keys = chunk_keys(r.tokens, c, salt=f"{rt.dtype}")[:n_chunks]
        per_layer: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(rt.num_layers)]
        for i in range(n_chunks):
            kv = r.full.to_2ltd(i * c, (i + 1) * c).contiguous()
            ckv = self.compressor.compress(kv, rt.num_kv_heads, start=i * c,
                                           queries=None if queries is None else queries.cpu())
            r.stats.compressed_bytes += ckv.nbytes
            r.stats.full_prefix_bytes += ckv.full_nbytes
            for li, lkv in enumerate(self.compressor.decompress(ckv)):
                per_layer[li].append((lkv.keys, lkv.values))
            if self.source is not None:
                self.source.put(r.keys[i], kv)
        base = [sum(k.shape[1] for k, _ in chunks) for chunks in per_layer]
        cap = max(base) + (len(r.tokens) - r.prefix) + r.max_new + self.max_draft_len + 2
        cap += self.ngram.num_tokens if self.ngram else 0
        r.draft = rt.new_cache(cap)
        for li, chunks in enumerate(per_layer):
            if chunks:
                r.draft.k[li, :, :base[li]] = torch.cat([k for k, _ in chunks], dim=1)
                r.draft.v[li, :, :base[li]] = torch.cat([v for _, v in chunks], dim=1)
        r.draft.base = base
        n_suffix = len(r.tokens) - r.prefix
        r.draft.write_suffix(0, *r.full.suffix(r.prefix, len(r.tokens)))
        r.draft.n = n_suffix
        if self.source is not None and r.prefix:
            # From here on the full prefix lives in the source; poison the verify buffer so a
            # verification that skipped the swap could not pass.
            r.full.k[:, :, :r.prefix] = float("nan")
            r.full.v[:, :, :r.prefix] = float("nan")

    # -- rounds -----------------------------------------------------------------------------------
    def _new_round(self, r: Request) -> None:
        r.drafts, r.qs, r.round_draft_s = [], [], 0.0
        r.limit = max(0, min(r.horizon.L, r.remaining - 1))
        if self.source is not None and r.prefix:
            r.swap = SwapIn(self.source, r.keys, r.full, self.chunk_size)

    def _step(self, drafting: list[Request], verifying: list[Request], sampling: Sampling) -> None:
        for r in verifying:
            self._finish_swap(r)
        tokens, positions, segs, rows, plan = [], [], [], [], []
        for r in drafting:
            feed = [r.drafts[-1] if r.drafts else r.tokens[-1]]
            if self.ngram is not None:
                room = r.limit - len(r.drafts) - 1
                feed += self.ngram.propose(r.tokens + r.drafts, room)
            plan.append(("draft", r, len(rows), feed))
            self._add(tokens, positions, segs, rows, r.draft, feed, r.pos + len(r.drafts), all_rows=len(feed) > 1)
        for r in verifying:
            feed = [r.tokens[-1]] + r.drafts
            plan.append(("verify", r, len(rows), feed))
            self._add(tokens, positions, segs, rows, r.full, feed, r.pos, all_rows=True)
        t0 = time.perf_counter()
        logits, _ = self.rt.forward(torch.tensor(tokens), torch.tensor(positions), segs, rows=torch.tensor(rows))
        dt = time.perf_counter() - t0
        for kind, r, row, feed in plan:
            if kind == "draft":
                r.stats.draft_s += dt
                r.round_draft_s += dt
                r.stats.draft_steps += 1
                self._take_drafts(r, feed, logits[row:row + len(feed)], sampling)
            else:
                r.stats.verify_s += dt
                self._verify(r, logits[row:row + len(feed)], sampling)

    @staticmethod
    def _add(tokens, positions, segs, rows, cache, feed, pos, all_rows):
        start = len(tokens)
        tokens += feed
        positions += range(pos, pos + len(feed))
        segs.append(Segment(cache, len(feed)))
        rows += range(start, start + len(feed)) if all_rows else [start + len(feed) - 1]

    def _take_drafts(self, r: Request, feed: list[int], logits: Tensor, sampling: Sampling) -> None:
        proposed = feed[1:]
        if proposed:
            # Stacked proposer: the drafter checks the n-gram guesses like a verifier (one-hot proposal
            # distribution), so the drafts it passes on still follow its own distribution q.
            onehot = [torch.nn.functional.one_hot(torch.tensor(t), logits.shape[-1]).float() for t in proposed]
            k, nxt = accept(proposed, None if sampling.greedy else onehot, logits, sampling, r.gen)
            new = proposed[:k] + [nxt]
            qs = [sampling.probs(logits[i]) for i in range(k + 1)] if not sampling.greedy else []
            r.draft.n -= len(proposed) - k  # drop the KV of rejected guesses
        else:
            nxt, q = sampling.pick(logits[-1], r.gen)
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
        r.stats.swap_wait_s += time.perf_counter() - t0
        r.stats.swap_s += r.swap.seconds
        r.stats.bytes_moved += r.swap.nbytes
        for i in misses:  # never verify against wrong KV: recompute the chunk from its tokens
            c, n = self.chunk_size, r.full.n
            r.full.n = i * c
            self.rt.forward(torch.tensor(r.tokens[i * c:(i + 1) * c]), torch.arange(i * c, (i + 1) * c),
                            [Segment(r.full, c)], rows=torch.tensor([c - 1]))
            r.full.n = n
            r.stats.recomputed_chunks += 1

    def _verify(self, r: Request, logits: Tensor, sampling: Sampling) -> None:
        t = r.pos
        k, nxt = accept(r.drafts, r.qs if not sampling.greedy else None, logits, sampling, r.gen)
        # Commit the exact KV of the fed tokens that were accepted: tokens[-1] and drafts[:k].
        r.full.n = t + k + 1
        r.draft.n = t - r.prefix + k + 1
        r.draft.write_suffix(t - r.prefix, *r.full.suffix(t, t + k + 1))
        drafted = len(r.drafts)
        r.stats.rounds += 1
        r.stats.accepted.append(k)
        r.stats.drafted.append(drafted)
        step_s = r.round_draft_s / drafted if drafted else 0.0
        r.horizon.update(drafted, k, step_s, r.swap.seconds if r.swap is not None else 0.0)
        r.swap = None
        self._emit(r, r.drafts[:k] + [nxt])
        if self._on_round is not None:
            self._on_round(r)
        if not r.done:
            self._new_round(r)

    def _pick(self, r: Request, logits: Tensor, sampling: Sampling) -> int:
        top2 = logits.topk(2).values
        r.margins.append(float(top2[0] - top2[1]))
        return sampling.pick(logits, r.gen)[0]

    def _emit(self, r: Request, new: list[int]) -> None:
        for t in new[:r.remaining]:
            r.tokens.append(t)
            if t in self.eos_ids:
                r.done = True
                break
        r.stats.new_tokens = len(r.out)
        if r.remaining <= 0:
            r.done = True


def _clone(c: KVCache) -> KVCache:
    return KVCache(c.k.clone(), c.v.clone(), list(c.base), c.n)


def _as_batch(prompts: Prompts, vocab: int) -> list[list[int]]:
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
    return batch
