"""The VeriCache decode loop: draft on the compressed KV, verify on the full KV, swap hidden behind drafting.

Per request and round: draft ``L`` tokens on the draft cache (compressed prefix + exact suffix),
verify ``[last token] + drafts`` in one forward over the full cache, emit the accepted drafts plus
the target's own token, and bring both caches to the committed point: the full cache keeps exactly
the verify forward's KV of the committed tokens, the draft cache's suffix gets a copy of it.

Where the full KV lives between rounds is the residency mode (:mod:`~.residency`): ``resident``
keeps it in the request (a prefix read from the store is swapped in once, behind the first round's
drafting); ``offload`` leases a pooled verify cache at each round's start, swaps the full prefix in
from the store behind that round's drafting (recomputing any chunk the store missed) and returns
the cache after verifying. Requests are admitted while the ``kv_budget_bytes`` holds them.

Storage is the project's :class:`~lmcache_vericache.backends.DualTierStore`; a new request's caches
come from :class:`~.prefill.Prefiller` (prefill and store puts, or the store's cached prefix), and
rounds prefetch the full chunks from the store.

Shared prefix (remote prefix caching): when the store already holds the leading chunks of a prompt,
the uncached prompt tail is fed to the drafter as the first draft step; the first verify block is
``tail + drafts`` over the swapped-in exact prefix, so the tail's exact KV comes from a forward over
the exact full prefix and the first emitted token is the target's own (lossless as every other round).

Many requests run as one flat batch per step. With ``stagger`` they are not held in lock step:
each request drafts or verifies on its own schedule (half of them start with a half-length round),
so some draft while others verify and the swaps spread out. ``stagger="auto"`` (default) staggers
only in offload, where the verify pool and the per-round swaps need spreading; with the full KV
resident the batch runs in lock step: its draft forwards then read only the compressed KV (a
staggered draft forward also carries other requests' verify rows), and at 8k / batch 8 lock step
was the faster mode in every comparison since the draft step became one kernel call per layer
(README, "Where VeriCache pays"). Scheduling changes speed, never tokens: each request's tokens
depend only on its own caches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import compressors
from .. import metrics as M
from ..backends import DualTierStore, StoreConfig
from ..backends.keys import KeySpace, model_fingerprint
from . import int8_attention
from .cache import KVCache
from .horizon import DraftLen, Horizon, check_draft_len
from .kvfetch import CertifiedPrefix
from .prefill import Prefiller
from .proposer import NgramProposer
from .request import Request, Result
from .residency import Residency, check_residency
from .runtime import Runtime, Segment
from .swap import SwapIn
from .verify import Sampling, accept

logger = logging.getLogger(__name__)

Tensor = torch.Tensor
Prompts = Sequence[int] | Tensor | Sequence[Sequence[int]]


class VeriCacheEngine:
    """Lossless compressed-KV drafting for a Llama-family HF model.

    ``store``: where the full prefix chunks live between verifications, and the only owner of
    storage. ``None`` (default) or a :class:`StoreConfig` / mapping of its keys: the engine builds
    the store (a byte-bounded memory tier unless the config says ``capacity``) and closes it;
    ``compressor`` / ``compressor_params`` fill the config's. A :class:`DualTierStore` (e.g. a shared
    Redis one, where prompts whose prefix it holds skip that prefill) belongs to the caller; the
    engine drafts with its compressor. ``"resident"``: no store, the full KV never leaves the
    request (the baseline where it fits); ``compressor`` then names the drafter's method.

    ``full_kv`` (``"auto"``, ``"resident"``, ``"offload"``), ``kv_budget_bytes`` and ``verify_buffers``:
    where a request's full KV lives between verifications and how much KV may be resident; see
    :mod:`~.residency` (auto: resident unless the budget is too small for it).

    ``mode`` (``"exact"``, default, or ``"verkv"``) and ``verkv`` (``kvfetch_draft``, ``epsilon``,
    ``delta``, ``sketch_bits``): the store config's decoding keys (docs/verkv.md). ``"verkv"`` decodes
    with KVFetch-certified attention over PoissonComp chunks and no verification forward: *not*
    identical to full-KV decoding. ``kvfetch_draft`` keeps the exact mode and drafts with KVFetch.

    ``int8_draft``: draft caches keep an int8 compressor's prefix as codes and attend over them with
    the int8 kernel (:mod:`~.int8_attention`), reading 1 byte per element; ``None`` (default): where
    the compressor stores int8 codes and the kernel builds on this machine.

    Chunk keys come from the shared key scheme (:class:`~lmcache_vericache.backends.keys.KeySpace`):
    the same prompt chunk has the same key in every host (LMCache plugin, L2 adapter) whose key
    space agrees: ``model_id`` (default: a digest of this model's weights), ``hash_scheme``
    (default ``blake3``, the LMCache server's), dtype, ``chunk_size`` and compressor.
    """

    def __init__(self, model: torch.nn.Module, compressor: str | None = None,
                 compressor_params: dict[str, Any] | None = None, *, chunk_size: int = 256,
                 draft_len: DraftLen = 16, max_draft_len: int = 64,
                 store: DualTierStore | StoreConfig | Mapping[str, Any] | str | None = None,
                 stagger: bool | str = "auto", ngram: NgramProposer | None = None, query_window: int = 32,
                 eos_ids: set[int] | None = None, model_id: str | None = None, full_kv: str = "auto",
                 kv_budget_bytes: int | None = None, verify_buffers: int | None = None,
                 int8_draft: bool | None = None, mode: str | None = None,
                 verkv: Mapping[str, Any] | None = None):
        self.rt = Runtime(model)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        check_draft_len(draft_len, max_draft_len)
        _check_stagger(stagger)
        check_residency(full_kv, kv_budget_bytes, verify_buffers)
        self.full_kv, self.kv_budget_bytes, self.verify_buffers = full_kv, kv_budget_bytes, verify_buffers
        #: Facts of the last ``generate()``: resolved mode, verify buffers, most requests at once, peak KV.
        self.last_run: dict[str, Any] = {}
        config, self.store, self._owns_store = self._store_config(store, compressor, compressor_params, mode, verkv)
        self.mode = config.mode
        kvfetch = (dict(epsilon=config.epsilon, delta=config.delta, sketch_bits=config.sketch_bits)
                   if config.uses_kvfetch else None)
        self.compressor = (self.store.compressor if self.store is not None
                           else compressors.get(config.compressor, **config.compressor_params))
        if full_kv == "offload" and self.store is None:
            raise ValueError("full_kv='offload' needs a store for the full KV (store='resident' has none)")
        self.chunk_size, self.draft_len, self.max_draft_len = chunk_size, draft_len, max_draft_len
        self.stagger, self.ngram, self.query_window = stagger, ngram, query_window
        self.eos_ids = set(self.rt.eos_ids if eos_ids is None else eos_ids)
        if model_id is not None:
            config = StoreConfig.parse({**_fields(config), "model_id": model_id}, where="VeriCacheEngine")
        self.key_space: KeySpace = config.key_space(
            model=config.model_id or model_fingerprint(model), dtype=self.rt.dtype, chunk_size=chunk_size)
        draft_room = max_draft_len + 2 + (ngram.num_tokens if ngram else 0)
        self.int8_draft = self._int8_draft(int8_draft)
        self._prefiller = Prefiller(self.rt, self.store, self.compressor, chunk_size, query_window, draft_room,
                                    self.key_space, self.int8_draft and kvfetch is None, kvfetch)
        self._on_round: Callable[[Request], None] | None = None
        # Lock step: one horizon for the batch, and the rounds verified in the current forward.
        self._batch_horizon: Horizon | None = None
        self._verified: list[tuple[Request, int, int, float, float]] = []

    def _store_config(self, store: Any, compressor: str | None, params: dict[str, Any] | None, mode: str | None,
                      verkv: Mapping[str, Any] | None) -> tuple[StoreConfig, DualTierStore | None, bool]:
        """(config, store, owned). The config names the compressor, key and decoding settings in every case."""
        heads = self.rt.num_kv_heads
        if verkv is not None and not isinstance(verkv, Mapping):
            raise ValueError(f"verkv must be a mapping of VerKV options, got {type(verkv).__name__}")
        decoding = dict(verkv or {}) | ({} if mode is None else {"mode": mode})
        unknown = set(decoding) - {"mode", "kvfetch_draft", "epsilon", "delta", "sketch_bits"}
        if unknown:
            raise ValueError(f"verkv: unknown option(s) {sorted(unknown)}; known: kvfetch_draft, epsilon, delta, "
                             "sketch_bits")
        if isinstance(store, DualTierStore):
            ours = store.compressor
            given = compressors.get(compressor, **(params or {})) if compressor is not None else ours
            if (given.name, given.params()) != (ours.name, ours.params()):
                raise ValueError(f"compressor {compressor} {params or {}} differs from the store's {ours.name} "
                                 f"{ours.params()}; pass compressor=None to use the store's")
            if store.num_kv_heads != heads:
                raise ValueError(f"store has num_kv_heads={store.num_kv_heads}, the model {heads}")
            config = StoreConfig.parse({"compressor": store.compressor.name, "num_kv_heads": heads,
                                        "compressor_params": store.compressor.params(), **decoding},
                                       where="VeriCacheEngine")
            return config, store, False
        if isinstance(store, str) and store != "resident":
            raise ValueError(f"store must be a DualTierStore, a StoreConfig, a mapping or 'resident', got {store!r}")
        values = {} if store in (None, "resident") else _fields(store)
        if compressor is not None:
            values["compressor"] = compressor
        if params is not None:
            values["compressor_params"] = params
        values.update(decoding)
        config = StoreConfig.parse(values, where="VeriCacheEngine store config").with_heads(heads)
        if store == "resident":
            return config, None, False
        return config, config.build(), True

    def _int8_draft(self, wanted: bool | None) -> bool:
        """Whether draft caches keep an int8 prefix as codes (attended by the int8 kernel). Auto
        (``None``): where the compressor stores int8 codes, on CPU, and the kernel builds."""
        if wanted is not None and not isinstance(wanted, bool):
            raise ValueError(f"int8_draft must be True, False or None (auto), got {wanted!r}")
        if wanted is False:
            return False
        if not self.compressor.stores_int8_codes or self.rt.device.type != "cpu":
            if wanted:
                raise ValueError(f"int8_draft needs a compressor that stores int8 codes on CPU, not "
                                 f"{self.compressor.name} on {self.rt.device.type}")
            return False
        if (not int8_attention.available() or self.rt.head_dim not in int8_attention.HEAD_DIMS
                or self.rt.dtype not in int8_attention.DTYPES):
            if wanted:
                raise ValueError(f"int8_draft: the int8 attention kernel could not be built (see the log) or "
                                 f"does not take head size {self.rt.head_dim} / {self.rt.dtype} (it takes "
                                 f"{int8_attention.HEAD_DIMS} / {int8_attention.DTYPES})")
            return False
        return True

    def chunk_keys(self, tokens: Sequence[int]) -> list[str]:
        """Store keys of the full chunks of ``tokens``, as every host names them."""
        return self.key_space.token_keys(tokens)

    def close(self) -> None:
        """Close the store if the engine made it (a store passed in belongs to the caller)."""
        if self._owns_store and self.store is not None:
            self.store.close()

    def __enter__(self) -> VeriCacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API -------------------------------------------------------------------------------
    def generate(self, prompts: Prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, draft_len: DraftLen | None = None,
                 stagger: bool | str | None = None, on_round: Callable[[Request], None] | None = None) -> list[Result]:
        """Decode every prompt (token ids) with draft/verify; request i samples with seed ``seed + i``.
        ``on_round(request)`` runs after each round's commit (observability and tests).

        Sampling is reproducible for an engine in the same state: a prompt prefix served from the
        store drafts on another schedule, which draws another sample of the same distribution."""
        sampling = Sampling(temperature, top_k, top_p)
        draft_len = self.draft_len if draft_len is None else draft_len
        check_draft_len(draft_len, self.max_draft_len)
        stagger = self.stagger if stagger is None else _check_stagger(stagger)
        batch = self._batch(prompts, max_new_tokens)
        res = self._residency(batch, max_new_tokens, self.full_kv)
        if stagger == "auto":
            stagger = res.offload
        pending, reqs, t_begin = list(range(len(batch))), [], time.perf_counter()
        self.last_run = dict(full_kv=res.mode, verify_buffers=res.pool.count if res.pool else 0,
                             max_active=0, peak_kv_bytes=0)
        self._on_round = on_round
        # Staggered requests draft and verify on their own schedules, each with its own horizon; in
        # lock step they share every forward, so one horizon (pooled acceptance, the batch's own
        # draft and verify forwards) sets one L for all and nobody idles waiting for a longer round.
        # Plain decoding (L = 0) is an option of auto only with the full KV resident: offload swaps
        # the prefix in every round, which only drafting hides.
        plain_ok = res.mode == "resident" and self.mode == "exact"
        self._batch_horizon = None if stagger else Horizon(draft_len, self.max_draft_len, plain_ok=plain_ok)
        self._verified = []
        try:
            while True:
                for r in self._admit(batch, pending, reqs, res, max_new_tokens, sampling, seed, t_begin):
                    r.horizon = (self._batch_horizon if self._batch_horizon is not None
                                 else Horizon(draft_len, self.max_draft_len, plain_ok=plain_ok))
                    if not r.done:
                        self._new_round(r, res)
                        if stagger and r.idx % 2 and r.limit > 1:
                            r.limit //= 2  # a half-length first round puts odd requests out of phase
                if self.mode == "verkv":  # no verification: a round's drafts are the output
                    for r in reqs:
                        if not r.done and len(r.drafts) >= r.limit:
                            self._commit_unverified(r, res)
                active = [r for r in reqs if not r.done]
                if not active:
                    break
                self._track(active, res)
                if res.offload:  # a request without a verify cache drafts meanwhile, up to its limit
                    self._lease_waiting(res)
                for r in active:
                    # A cached prompt's first round drafts only while its exact prefix is still arriving:
                    # once it is in, verifying the tail at once gives the first token soonest.
                    if r.start < r.pos and r.swap is not None and r.swap.done:
                        r.limit = min(r.limit, len(r.drafts))
                drafting = [r for r in active if len(r.drafts) < r.limit]
                # Lock step: nobody verifies while anybody still drafts. Verifying needs a verify cache.
                verifying = ([r for r in active if len(r.drafts) >= r.limit and r.full is not None]
                             if (stagger or not drafting) else [])
                self._step(drafting, verifying, sampling, res)
        finally:
            self._verified = []  # an error mid-forward must not keep requests (and their caches) alive
            # Only an error leaves swaps in flight: stop them before the caller gets control back,
            # so no background thread keeps reading the store and writing into the caches.
            for r in reqs:
                if r.swap is not None:
                    r.swap.cancel()
                    r.swap = None
        return [Result(r.out, r.stats) for r in sorted(reqs, key=lambda r: r.idx)]

    def reference(self, prompts: Prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0, stored_prefix: bool = False) -> list[Result]:
        """Plain full-KV decoding in the same runtime: one token per forward. Records, per step, the
        top-1 minus top-2 logit margin (a divergence at a near-zero margin is a floating-point tie).
        ``stored_prefix``: the leading full chunks of a prompt that the store holds are read from it
        instead of prefilled (the full-KV baseline of a served prefix, as LMCache's own prefix
        caching gives it; ``stats.cached_chunks`` counts them, ``stats.prefill_s`` includes the read)."""
        sampling = Sampling(temperature, top_k, top_p)
        reqs = self._start(prompts, max_new_tokens, sampling, seed, draft=False, stored_prefix=stored_prefix)
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
    def _start(self, prompts: Prompts, max_new: int, sampling: Sampling, seed: int, draft: bool,
               stored_prefix: bool = False) -> list[Request]:
        """Set up every prompt at once with resident caches (reference decoding, benchmarks)."""
        batch = self._batch(prompts, max_new)
        res = self._residency(batch, max_new, "resident")
        twins: dict = {}
        return [self._setup(batch, i, max_new, sampling, seed, draft, res, time.perf_counter(), twins,
                            stored_prefix) for i in range(len(batch))]

    def _batch(self, prompts: Prompts, max_new: int) -> list[list[int]]:
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new!r}")
        return _as_batch(prompts, self.rt.vocab_size)

    def _capacity(self, ids: list[int], max_new: int) -> int:
        return len(ids) + max_new + self.max_draft_len + 2

    def _residency(self, batch: list[list[int]], max_new: int, full_kv: str) -> Residency:
        cap = max(self._capacity(ids, max_new) for ids in batch)
        return Residency(full_kv, self.kv_budget_bytes, self.verify_buffers, len(batch),
                         cap * self.rt.kv_bytes_per_token(), lambda: self.rt.new_cache(cap), self.store is not None)

    def _admit(self, batch: list[list[int]], pending: list[int], reqs: list[Request], res: Residency,
               max_new: int, sampling: Sampling, seed: int, t_begin: float) -> list[Request]:
        """Set up pending requests, in order, while the KV budget admits them (one at least when
        nothing runs); returns the new ones (appended to ``reqs``)."""
        new: list[Request] = []
        twins: dict[tuple[int, ...], tuple[Request, Tensor | None]] = {}  # nothing decodes in between
        while pending:
            running = [r for r in reqs if not r.done]
            held = res.held_bytes(running)
            full_bytes = self._capacity(batch[pending[0]], max_new) * self.rt.kv_bytes_per_token()
            if not res.admits(held, full_bytes, first=not running):
                break
            r = self._setup(batch, pending[0], max_new, sampling, seed, True, res, t_begin, twins)
            if r is None:  # offload: every verify buffer is in a round; prefill needs one
                break
            pending.pop(0)
            res.observe(r.draft, full_bytes)
            reqs.append(r)
            new.append(r)
        for r in new:
            if r.done:  # finished at set-up (one token, or EOS): its KV is not needed any more
                self._release(r)
        return new

    def _setup(self, batch: list[list[int]], i: int, max_new: int, sampling: Sampling, seed: int, draft: bool,
               res: Residency, t_begin: float, twins: dict, stored_prefix: bool = False) -> Request | None:
        """Caches of request ``i`` (``None``: offload and no verify cache free for its prefill).
        ``twins``: requests set up since the last decode step, by prompt; an identical prompt copies
        their caches instead of prefilling again (and decodes as if it had prefilled)."""
        ids = batch[i]
        full = res.pool.lease() if res.offload else self.rt.new_cache(self._capacity(ids, max_new))
        if full is None:
            return None
        r = Request(i, list(ids), len(ids), max_new, full, gen=torch.Generator().manual_seed(seed + i), t0=t_begin)
        r.stats.prompt_tokens = len(ids)
        t0 = time.perf_counter()
        if tuple(ids) in twins:
            twin, logits = twins[tuple(ids)]
            if not res.offload:  # offload: the verify cache goes back to the pool below
                r.full = twin.full.clone()
            r.draft = twin.draft.clone() if twin.draft is not None else None
            r.prefix, r.keys, r.prefix_missing = twin.prefix, list(twin.keys), twin.prefix_missing
            r.queries = twin.queries
            for name in ("compressed_bytes", "full_prefix_bytes", "cached_chunks", "bytes_moved"):
                setattr(r.stats, name, getattr(twin.stats, name))
        else:
            keys = self.chunk_keys(r.tokens) if self.store is not None and (draft or stored_prefix) else []
            logits = self._prefiller.setup(r, keys, draft)
            twins[tuple(ids)] = (r, logits)
        r.stats.prefill_s = time.perf_counter() - t0
        if logits is not None:
            self._emit(r, [self._pick(r, logits, sampling)])
        r.start = r.pos if logits is not None else r.prefix
        if res.offload:  # the full KV now lives in the store and the draft cache's exact suffix
            res.pool.release(r.full)
            r.full = None
        if draft and self.mode == "verkv":  # never verified: KVFetch reads full chunks of its own
            r.full = None
        if draft:
            M.ENGINE_REQUESTS.inc()
            M.ENGINE_CACHED.inc(r.stats.cached_chunks)
            M.ENGINE_EMITTED.inc(r.stats.new_tokens)
        return r

    def _track(self, active: list[Request], res: Residency) -> None:
        run = self.last_run
        run["max_active"] = max(run["max_active"], len(active))
        run["peak_kv_bytes"] = max(run["peak_kv_bytes"], res.held_bytes(active))

    # -- rounds -----------------------------------------------------------------------------------
    def _new_round(self, r: Request, res: Residency) -> None:
        r.drafts, r.qs, r.round_draft_s = [], [], 0.0
        r.limit = self._limit(r)
        if self.mode == "verkv":  # every token comes from the (certified) drafter
            return
        if res.offload:  # a verify cache when its turn comes (first come, first served)
            res.waiting.append(r)
        elif r.prefix_missing:  # resident: a prefix read from the store is swapped in once
            r.swap = SwapIn(self.store, r.keys, r.full, self.chunk_size)

    def _limit(self, r: Request) -> int:
        """Drafts of ``r``'s round: its horizon's L, capped by the tokens it still may emit (a
        verified round also emits the target's own token; verkv rounds emit only drafts)."""
        return max(0, min(r.horizon.L, r.remaining - (self.mode != "verkv")))

    def _lease_waiting(self, res: Residency) -> None:
        """Offload: hand free verify caches to the requests waiting longest. Each gets the exact
        suffix copied in from its draft cache and starts swapping its full prefix from the store."""
        while res.waiting:
            r = res.waiting[0]
            if r.done:
                res.waiting.popleft()
                continue
            full = res.pool.lease()
            if full is None:
                return
            res.waiting.popleft()
            self._fill(r, full)

    def _fill(self, r: Request, full: KVCache) -> None:
        n = r.start - r.prefix  # positions [prefix, start) are exact in the draft cache
        if n:
            k, v = r.draft.suffix(0, n)
            full.k[:, :, r.prefix:r.start], full.v[:, :, r.prefix:r.start] = k, v
        full.n, r.full = r.start, full
        if r.prefix:
            r.swap = SwapIn(self.store, r.keys, full, self.chunk_size)

    def _step(self, drafting: list[Request], verifying: list[Request], sampling: Sampling, res: Residency) -> None:
        for r in verifying:
            self._finish_swap(r)
        tokens, positions, segs, rows, plan = [], [], [], [], []
        for r in drafting:
            # First step of a round feeds tokens[start:] (one token, or a cached prompt's tail).
            base, pos = ([r.drafts[-1]], r.pos + len(r.drafts)) if r.drafts else (r.tokens[r.start:], r.start)
            proposed = (self.ngram.propose(r.tokens + r.drafts, r.limit - len(r.drafts) - 1)
                        if self.ngram is not None else [])
            plan.append(("draft", r, len(rows), proposed))
            self._add(tokens, positions, segs, rows, r.draft, base + proposed, pos, len(base) - 1)
        for r in verifying:
            plan.append(("verify", r, len(rows), r.drafts))
            self._add(tokens, positions, segs, rows, r.full, r.tokens[r.start:] + r.drafts, r.start, r.pos - r.start)
        t0 = time.perf_counter()
        logits, _ = self.rt.forward(torch.tensor(tokens), torch.tensor(positions), segs, rows=torch.tensor(rows))
        dt = time.perf_counter() - t0
        for kind, r, row, guesses in plan:
            rows_r = logits[row:row + len(guesses) + 1]
            if kind == "draft":
                r.stats.draft_s += dt
                r.round_draft_s += dt
                r.stats.draft_steps += 1
                self._take_drafts(r, guesses, rows_r, sampling)
            else:
                r.stats.verify_s += dt
                r.round_verify_s = dt
                self._verify(r, rows_r, sampling, res)
        if self._verified:  # lock step: the batch's horizon learns from every round of this forward
            done, self._verified = self._verified, []
            steps = [step for _, d, _, step, _ in done if d > 0]  # capped last rounds may not draft
            self._batch_horizon.update_rounds([(d, k) for _, d, k, _, _ in done],
                                              sum(steps) / len(steps) if steps else 0.0,
                                              max(swap for *_, swap in done), dt)
            for r, *_ in done:  # their next rounds started with the L from before this update
                if not r.done:
                    r.limit = self._limit(r)

    @staticmethod
    def _add(tokens, positions, segs, rows, cache, feed, pos, first_row):
        """Append ``feed`` at ``pos`` over ``cache``; logits wanted from ``feed[first_row]`` on."""
        start = len(tokens)
        tokens += feed
        positions += range(pos, pos + len(feed))
        segs.append(Segment(cache, len(feed)))
        rows += range(start + first_row, start + len(feed))

    def _take_drafts(self, r: Request, proposed: list[int], logits: Tensor, sampling: Sampling) -> None:
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
            self._prefiller.recompute_chunk(r, i)
            r.stats.recomputed_chunks += 1
        r.prefix_missing = False

    def _verify(self, r: Request, logits: Tensor, sampling: Sampling, res: Residency) -> None:
        t = r.pos
        k, nxt = accept(r.drafts, r.qs if not sampling.greedy else None, logits, sampling, r.gen)
        # Commit the exact KV of the fed tokens that were accepted: tokens[start:] and drafts[:k].
        r.full.n = t + k + 1
        r.draft.n = t - r.prefix + k + 1
        r.draft.write_suffix(r.start - r.prefix, *r.full.suffix(r.start, t + k + 1))
        drafted = len(r.drafts)
        step_s = r.round_draft_s / drafted if drafted else 0.0
        swap_s = r.swap.seconds if r.swap is not None else 0.0
        if self._batch_horizon is not None:
            self._verified.append((r, drafted, k, step_s, swap_s))
        else:
            r.horizon.update(drafted, k, step_s, swap_s, r.round_verify_s)
        r.swap = None
        self._commit(r, r.drafts[:k] + [nxt], k)
        if not r.done:
            self._prefiller.compress_generated(r, self.query_window, res.offload)
        if self._on_round is not None:
            self._on_round(r)
        if res.offload:  # the committed exact KV is in the draft cache's suffix now
            res.pool.release(r.full)
            r.full = None
        if r.done:
            self._release(r)
        else:
            self._new_round(r, res)

    def _commit_unverified(self, r: Request, res: Residency) -> None:
        """verkv mode: emit the round's drafts as they are (certified attention, no verification).
        The last draft's KV is not in the draft cache yet: the next round feeds it (``start = pos``)."""
        self._commit(r, r.drafts, max(0, len(r.drafts) - 1))  # a round of L emits L (not L + 1)
        if self._on_round is not None:
            self._on_round(r)
        if r.done:
            self._release(r)
        else:
            self._new_round(r, res)

    def _commit(self, r: Request, tokens: list[int], accepted: int) -> None:
        """Record a finished round (stats, metrics) and emit its ``tokens``; the next feed starts at
        the last of them."""
        r.stats.rounds += 1
        r.stats.accepted.append(accepted)
        r.stats.drafted.append(len(r.drafts))
        emitted = r.stats.new_tokens
        self._emit(r, tokens)
        r.start = r.pos
        M.ENGINE_ROUNDS.inc()
        M.ENGINE_ACCEPTED.observe(accepted)
        M.ENGINE_DRAFTED.inc(len(r.drafts))
        M.ENGINE_EMITTED.inc(r.stats.new_tokens - emitted)

    def _release(self, r: Request) -> None:
        """A finished request frees its KV (resident KV is freed as each request ends); KVFetch
        counters go to its stats first."""
        if r.draft is not None and isinstance(r.draft.packed, CertifiedPrefix):
            r.stats.kvfetch = r.draft.packed.stats.as_dict()
        r.full = r.draft = None

    def _pick(self, r: Request, logits: Tensor, sampling: Sampling) -> int:
        top2 = logits.topk(2).values
        r.margins.append(float(top2[0] - top2[1]))
        return sampling.pick(logits, r.gen)[0]

    def _emit(self, r: Request, new: list[int]) -> None:
        if not r.stats.ttft_s:
            r.stats.ttft_s = time.perf_counter() - r.t0
        for t in new[:r.remaining]:
            r.tokens.append(t)
            if t in self.eos_ids:
                r.done = True
                break
        r.stats.new_tokens = len(r.out)
        if r.remaining <= 0:
            r.done = True


def _check_stagger(stagger: Any) -> bool | str:
    if not (isinstance(stagger, bool) or stagger == "auto"):
        raise ValueError(f"stagger must be True, False or 'auto', got {stagger!r}")
    return stagger


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


def _fields(config: StoreConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, StoreConfig):
        return {k: v for k, v in vars(config).items()}
    if not isinstance(config, Mapping):
        raise ValueError(f"store config must be a StoreConfig or a mapping, got {type(config).__name__}")
    return dict(config)
