"""A new request's caches, before its first round: prefill or the store's prefix, then the draft layout.

Prefill computes the prompt's exact KV into the full cache chunk by chunk, puts each full chunk
into the store (which compresses it) and lays the draft cache out from the compressed chunks the
store hands back. When the store already holds the prompt's leading chunks (put by another engine
or process), their prefill is skipped: the draft cache is laid out from their compressed chunks
at once and the exact prefix arrives by the first round's swap.
"""

from __future__ import annotations

import logging

import torch

from ..backends import DualTierStore, TierError
from ..backends.keys import KeySpace
from ..compressors import CompressedKV, KVCompressor
from .cache import poison_prefix
from .draft_cache import DraftCaches
from .request import Request
from .runtime import Runtime, Segment
from .verify import host

logger = logging.getLogger(__name__)

Tensor = torch.Tensor


class Prefiller:
    """Sets up requests for one engine. ``draft_room``: draft-cache entries a request needs beyond
    its prompt and new tokens (the longest round's drafts and n-gram guesses)."""

    def __init__(self, rt: Runtime, store: DualTierStore | None, compressor: KVCompressor, chunk_size: int,
                 query_window: int, draft_room: int, key_space: KeySpace, drafts: DraftCaches):
        self.rt, self.store, self.compressor, self.key_space = rt, store, compressor, key_space
        self.drafts = drafts  # what a draft cache's prefix is (draft_cache.py)
        self.kvfetch = drafts.kind == "certified"  # KVFetch draft caches take their chunks' full KV too
        self.chunk_size, self.query_window, self.draft_room = chunk_size, query_window, draft_room

    def setup(self, r: Request, keys: list[str], draft: bool) -> Tensor | None:
        """Caches of a new request (``keys``: its chunk keys). Returns the logits of the prompt's last
        position, or ``None`` when the prompt's prefix came from the store and its tail is left to
        the first round."""
        if not draft:
            return self.prefill(r, self._load_full_prefix(r, keys))[0]
        c = self.chunk_size
        if self.store is not None:
            cached = self.store.get_compressed_prefix(self._cacheable(r, keys))
            full = None
            if cached and self.kvfetch:  # KVFetch reads the full tier: have it now or prefill
                full = [self.store.get_full(k) for k in keys[:len(cached)]]
                if not all(r.full.fits_chunk(f, c) for f in full):
                    cached = []
            if cached:
                r.full.n = len(cached) * c
                r.stats.cached_chunks = len(cached)
                self._layout_draft(r, keys, cached, full)
                if full is not None:  # already read for KVFetch: the full cache takes them, no swap
                    for i, kv in enumerate(full):
                        r.full.load_2ltd(i * c, kv)
                    r.stats.bytes_moved += sum(kv.nbytes for kv in full)
                else:  # the exact prefix arrives by the swap, before the first verify. Poisoned until
                    r.prefix_missing = True  # then: a verification that skipped the swap cannot pass
                    poison_prefix(r.full, r.prefix)
                return None
        logits, queries = self.prefill(r)
        r.queries = None if queries is None else host(queries)
        self._layout_draft(r, keys, self._store_prompt(r, keys, r.queries))
        return logits

    def _load_full_prefix(self, r: Request, keys: list[str]) -> int:
        """Reference decoding (full KV only): the leading run of the prompt's full chunks the store
        holds goes straight into the full cache, as LMCache's own prefix caching serves it; at
        least one prompt token stays uncached (its forward yields the first token). Returns the
        number of positions loaded (0 without a store: ``keys`` is empty then)."""
        c, n = self.chunk_size, 0
        for key in self._cacheable(r, keys):
            kv = self.store.get_full(key)
            if not r.full.fits_chunk(kv, c):
                break
            r.full.load_2ltd(n, kv)
            n += c
            r.stats.cached_chunks += 1
            r.stats.bytes_moved += kv.nbytes
        r.full.n = n
        return n

    def _cacheable(self, r: Request, keys: list[str]) -> list[str]:
        """Keys of the prompt chunks a store may serve: at least one prompt token stays uncached,
        its forward yields the first token."""
        return keys[:(len(r.tokens) - 1) // self.chunk_size]

    def prefill(self, r: Request, start: int = 0) -> tuple[Tensor, Tensor | None]:
        """Exact KV of the prompt from position ``start`` on (the full cache holds the positions
        before it), chunk by chunk (the same pieces a recompute uses); returns the last position's
        logits and the observation-window queries of the prompt's last tokens."""
        ids, c, n = r.tokens, self.chunk_size, len(r.tokens)
        w = min(self.query_window, n - start)
        starts = list(range(start, n, c))
        if len(starts) > 1 and n - starts[-1] < w:
            starts.pop()  # the last piece must hold the whole observation window
        for j, s in enumerate(starts):
            e = starts[j + 1] if j + 1 < len(starts) else n
            last = e == n
            logits, q = self.rt.forward(torch.tensor(ids[s:e]), torch.arange(s, e), [Segment(r.full, e - s)],
                                        rows=torch.tensor([e - s - 1]), capture_q=w if last else 0)
        return logits[0], q

    def recompute_chunk(self, r: Request, i: int) -> None:
        """Exact KV of prompt chunk ``i`` from its tokens, into the full cache (a chunk the store
        missed), and, once per request, back into the store: a chunk lost with a restarted server
        or deleted as corrupt is rewritten instead of recomputed every round. Full-only (no
        compression on the decode path); the next prefill of the prompt restores the compressed copy."""
        c, n = self.chunk_size, r.full.n
        r.full.n = i * c
        self.rt.forward(torch.tensor(r.tokens[i * c:(i + 1) * c]), torch.arange(i * c, (i + 1) * c),
                        [Segment(r.full, c)], rows=torch.tensor([c - 1]))
        r.full.n = n
        if self.store is not None and i not in r.restored:
            r.restored.add(i)
            try:
                self.store.put(r.keys[i], r.full.to_2ltd(i * c, (i + 1) * c).contiguous(), compress=False,
                               replace=True)  # the stored value may exist but be unusable (wrong shape)
            except TierError as e:  # logged by the store; the chunk stays recomputed each round
                logger.debug("request %d: could not restore chunk %d in the store: %s", r.idx, i, e)

    def compress_generated(self, r: Request, window: int, offload: bool) -> None:
        """Long generations: while the draft cache's exact suffix holds a whole chunk more than
        ``window`` exact recent positions, its oldest chunk (committed exact KV, read from the full
        cache) joins the compressed prefix, so the exact part of the draft cache stays bounded.
        Offload also puts the full chunk into the store: the next verify cache is rebuilt from the
        store's prefix and the draft cache's suffix. Methods scored by observation-window queries
        use the prompt's (none for a prompt served from the store: its generated KV stays exact);
        a failed put ends this for the request (its KV stays exact: slower, never wrong)."""
        c = self.chunk_size
        while not r.exact_only and r.full.n - r.prefix >= c + window:
            p = r.prefix
            kv = r.full.to_2ltd(p, p + c).contiguous()
            try:
                if offload:
                    key = self.key_space.token_keys(r.tokens[:p + c])[-1]
                    self.store.put(key, kv, start=p, queries=r.queries)
                    [ckv] = self.store.get_compressed_prefix([key]) or [None]
                    if ckv is None:
                        raise TierError(f"compressed chunk {key} not readable after its put")
                    r.keys.append(key)
                else:
                    ckv = self.compressor.compress(kv, self.rt.num_kv_heads, start=p, queries=r.queries)
            except (TierError, ValueError) as e:
                logger.info("request %d: generated KV from position %d stays exact: %s", r.idx, p, e)
                r.exact_only = True
                return
            room = r.full.n - (p + c) + r.remaining + self.draft_room
            self.drafts.append(r.draft, [ckv], room=room, full=[kv])
            r.prefix = p + c
            r.draft.write_suffix(0, *r.full.suffix(r.prefix, r.full.n))
            r.draft.n = r.full.n - r.prefix
            r.stats.generated_chunks += 1

    def _store_prompt(self, r: Request, keys: list[str], queries: Tensor | None) -> list[CompressedKV]:
        """Put the prompt's full chunks into the store (which compresses them) and take the
        compressed chunks back from it. A failed put ends the stored prefix there: that chunk and
        the rest stay resident in both caches (exact), so a broken store costs speed, not tokens."""
        c, heads = self.chunk_size, self.rt.num_kv_heads
        q = queries  # on the host already (setup)
        n = len(r.tokens) // c
        if self.store is None:  # resident baseline: no store, compress here
            return [self.compressor.compress(r.full.to_2ltd(i * c, (i + 1) * c), heads, start=i * c, queries=q)
                    for i in range(n)]
        for i in range(n):
            try:
                self.store.put(keys[i], r.full.to_2ltd(i * c, (i + 1) * c).contiguous(), start=i * c, queries=q)
            except TierError as e:
                logger.warning("request %d: storing prompt chunk %d of %d failed, keeping it and the rest "
                               "resident: %s", r.idx, i, n, e)
                n = i
                break
        return self.store.get_compressed_prefix(keys[:n])

    def _layout_draft(self, r: Request, keys: list[str], ckvs: list[CompressedKV],
                      full: list[Tensor] | None = None) -> None:
        """Draft cache: the compressed chunks, then the exact suffix (what the full cache holds past
        the prefix). A KVFetch draft cache also takes the chunks' full KV (``full``, default: the
        full cache's)."""
        r.prefix, r.keys = len(ckvs) * self.chunk_size, keys[:len(ckvs)]
        for ckv in ckvs:
            r.stats.compressed_bytes += ckv.nbytes
            r.stats.full_prefix_bytes += ckv.full_nbytes
        r.draft = self.drafts.new()
        if self.kvfetch:
            c = self.chunk_size
            full = full or [r.full.to_2ltd(i * c, (i + 1) * c) for i in range(len(ckvs))]
        self.drafts.append(r.draft, ckvs, room=len(r.tokens) - r.prefix + r.max_new + self.draft_room, full=full)
        if r.full.n > r.prefix:  # prompt computed here: its exact suffix seeds the draft cache
            r.draft.write_suffix(0, *r.full.suffix(r.prefix, r.full.n))
            r.draft.n = r.full.n - r.prefix
