"""The VeriCache engine: draft on the compressed KV, verify on the full KV, swap hidden behind drafting.

Per request and round (:mod:`~.rounds`): draft ``L`` tokens on the draft cache (compressed prefix +
exact suffix), verify ``[last token] + drafts`` in one forward over the full cache, emit the
accepted drafts plus the target's own token, and bring both caches to the committed point.

Where the full KV lives between rounds is the residency mode (:mod:`~.residency`); which requests
get caches, and their set-up, is :mod:`~.admission`; a new request's caches come from
:class:`~.prefill.Prefiller` (prefill and store puts, or the store's cached prefix).

Shared prefix (remote prefix caching): when the store already holds the leading chunks of a prompt,
the uncached prompt tail is fed to the drafter as the first draft step; the first verify block is
``tail + drafts`` over the swapped-in exact prefix, so the tail's exact KV comes from a forward over
the exact full prefix and the first emitted token is the target's own.

Many requests run as one flat batch per step. With ``stagger`` each request drafts or verifies on
its own schedule (half of them start with a half-length round), so some draft while others verify
and the swaps spread out; ``"auto"`` staggers only in offload, where the verify pool and the
per-round swaps need spreading. With the full KV resident the batch runs in lock step: its draft
forwards then read only the compressed KV (a staggered draft forward also carries other requests'
verify rows).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import compressors
from ..backends import DualTierStore, StoreConfig
from ..backends.keys import KeySpace, model_fingerprint
from . import lossy
from .admission import Admission, Batch, Prompts
from .config import EngineConfig, check_device, check_stagger, decoding_options, resolve_store, store_fields
from .draft_cache import DraftCaches
from .horizon import DraftLen, Horizon, check_draft_len
from .ngram import NgramProposer
from .prefill import Prefiller
from .request import Request, Result
from .rounds import Rounds
from .runtime import Runtime, Segment
from .swap import Staging
from .verify import Sampling, host


class VeriCacheEngine:
    """Lossless compressed-KV drafting for a Llama-family HF model.

    ``store``: where the full prefix chunks live between verifications, and the only owner of
    storage. ``None`` (default) or a :class:`StoreConfig` / mapping of its keys: the engine builds
    the store (a byte-bounded memory tier unless the config says ``capacity``) and closes it;
    ``compressor`` / ``compressor_params`` fill the config's. A :class:`DualTierStore` (e.g. a shared
    Redis one, where prompts whose prefix it holds skip that prefill) belongs to the caller; the
    engine drafts with its compressor. ``"resident"``: no store, the full KV never leaves the
    request (the baseline where it fits); ``compressor`` then names the drafter's method.

    The keyword options are :class:`~.config.EngineConfig`'s (validated before any model work):
    ``chunk_size``, ``draft_len``, ``max_draft_len``, ``stagger``, ``query_window``, ``full_kv``,
    ``kv_budget_bytes``, ``verify_buffers``, ``int8_draft``, ``triton_draft``, ``codebook_draft``, ``model_id``.
    ``int8_draft``: draft caches keep an int8 compressor's prefix as codes, attended by the CPU int8
    kernel (:mod:`~.int8_attention`); ``None``: on a CPU, where the compressor stores int8 codes and
    the kernel builds. ``triton_draft``: draft caches keep the prefix as its stored chunks (int8,
    int4, KIVI, TurboQuant), attended by the Triton kernels (:mod:`~.chunk_prefix`); ``None``: on a
    CUDA device where Triton imports and the compressor's format is one the kernels read.
    ``codebook_draft``: draft caches keep a TurboQuant prefix as its codes, attended by the CPU
    kernel (:mod:`~.codebook_attention`); ``None``: on a CPU with AVX512-VNNI where the kernel builds.

    ``mode`` (``"exact"``, default, or ``"verkv"``) and ``verkv`` (``kvfetch_draft``, ``epsilon``,
    ``delta``, ``sketch_bits``): the store config's decoding keys (docs/verkv.md). ``"verkv"`` decodes
    with KVFetch-certified attention over PoissonComp chunks and no verification forward: *not*
    identical to full-KV decoding. ``kvfetch_draft`` keeps the exact mode and drafts with KVFetch.

    ``device``: where the engine runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a :class:`torch.device`,
    or ``None``, default: the model's device). The model must already be there: the engine refuses a
    model on another device (it would otherwise move the caller's weights under it). On a CPU the
    runtime attends per segment with its C++ kernels; elsewhere one attention call per layer covers
    the batch, drafters whose chunks the Triton kernels read attend over them as stored
    (``triton_draft``) and swaps go through a pinned host pool (:mod:`~.swap`).

    Chunk keys come from the shared key scheme (:class:`~lmcache_vericache.backends.keys.KeySpace`):
    the same prompt chunk has the same key in every host whose key space agrees: ``model_id``
    (default: a digest of this model's weights), ``hash_scheme`` (default ``blake3``), dtype,
    ``chunk_size`` and compressor.
    """

    def __init__(self, model: torch.nn.Module, compressor: str | None = None,
                 compressor_params: dict[str, Any] | None = None, *, chunk_size: int = 256,
                 draft_len: DraftLen = 16, max_draft_len: int = 64,
                 store: DualTierStore | StoreConfig | Mapping[str, Any] | str | None = None,
                 stagger: bool | str = "auto", ngram: NgramProposer | None = None, query_window: int = 32,
                 eos_ids: set[int] | None = None, model_id: str | None = None, full_kv: str = "auto",
                 kv_budget_bytes: int | None = None, verify_buffers: int | None = None,
                 int8_draft: bool | None = None, mode: str | None = None,
                 verkv: Mapping[str, Any] | None = None, device: str | torch.device | None = None,
                 triton_draft: bool | None = None, codebook_draft: bool | None = None):
        check_device(model, device)
        self.config = EngineConfig(chunk_size, draft_len, max_draft_len, stagger, query_window, full_kv,
                                   kv_budget_bytes, verify_buffers, int8_draft, model_id, triton_draft, codebook_draft)
        decoding = decoding_options(mode, verkv)
        self.rt = Runtime(model)
        # CUDA: the swaps' pinned slabs (one chunk each) and side stream, kept across generate() calls.
        self.swap_staging = (Staging.on(self.rt.device, chunk_size * self.rt.kv_bytes_per_token())
                             if self.rt.device.type == "cuda" else None)
        #: Facts of the last ``generate()``: resolved mode, verify buffers, most requests at once, peak KV.
        self.last_run: dict[str, Any] = {}
        store_config, self.store, self._owns_store = resolve_store(store, compressor, compressor_params, decoding,
                                                                   self.rt.num_kv_heads)
        self.mode = store_config.mode
        kvfetch = (dict(epsilon=store_config.epsilon, delta=store_config.delta, sketch_bits=store_config.sketch_bits)
                   if store_config.uses_kvfetch else None)
        self.compressor = (self.store.compressor if self.store is not None
                           else compressors.get(store_config.compressor, **store_config.compressor_params))
        if full_kv == "offload" and self.store is None:
            raise ValueError("full_kv='offload' needs a store for the full KV (store='resident' has none)")
        self.ngram = ngram
        self.eos_ids = set(self.rt.eos_ids if eos_ids is None else eos_ids)
        if model_id is not None:
            store_config = StoreConfig.parse({**store_fields(store_config), "model_id": model_id},
                                             where="VeriCacheEngine")
        self.key_space: KeySpace = store_config.key_space(
            model=store_config.model_id or model_fingerprint(model), dtype=self.rt.dtype, chunk_size=chunk_size)
        draft_room = max_draft_len + 2 + (ngram.num_tokens if ngram else 0)
        # What a draft prefix is (dense, int8 or codebook codes, an arena's chunks, KVFetch's): one choice.
        self.drafts = DraftCaches.choose(self.rt, self.compressor, chunk_size, int8=int8_draft, codebook=codebook_draft,
                                         triton=triton_draft, kvfetch=kvfetch)
        self.int8_draft = self.drafts.kind == "int8"
        self.codebook_draft = self.drafts.kind == "codebook"
        self.codebook = self.drafts.codebook
        self.triton_draft = self.drafts.kind == "chunked"
        self.prefiller = Prefiller(self.rt, self.store, self.compressor, chunk_size, query_window, draft_room,
                                   self.key_space, self.drafts)
        self.admission = Admission(self.rt, self.config, self.prefiller, self.key_space, self.store, self.eos_ids,
                                   verkv=self.mode == "verkv")

    def chunk_keys(self, tokens: list[int]) -> list[str]:
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
        cfg = self.config
        sampling = Sampling(temperature, top_k, top_p)
        draft_len = cfg.draft_len if draft_len is None else draft_len
        check_draft_len(draft_len, cfg.max_draft_len)
        stagger = cfg.stagger if stagger is None else check_stagger(stagger)
        batch = Batch.of(prompts, max_new_tokens, self.rt.vocab_size, sampling, seed)
        res = self.admission.residency(batch, cfg.full_kv)
        if stagger == "auto":
            stagger = res.offload
        self.last_run = dict(full_kv=res.mode, verify_buffers=res.pool.count if res.pool else 0,
                             max_active=0, peak_kv_bytes=0)
        # Staggered requests draft and verify on their own schedules, each with its own horizon; in
        # lock step they share every forward, so one horizon (pooled acceptance, the batch's own
        # draft and verify forwards) sets one L for all and nobody idles waiting for a longer round.
        # Plain decoding (L = 0) is an option of auto only with the full KV resident: offload swaps
        # the prefix in every round, which only drafting hides.
        plain_ok = res.mode == "resident" and self.mode == "exact"
        verkv = self.mode == "verkv"

        def horizon() -> Horizon:
            return Horizon(draft_len, cfg.max_draft_len, plain_ok=plain_ok, swap_floor=res.mode != "resident")

        rounds = Rounds(self.rt, self.prefiller, self.store, chunk_size=cfg.chunk_size,
                        query_window=cfg.query_window, eos_ids=self.eos_ids, ngram=self.ngram, verkv=verkv,
                        sampling=sampling, res=res, batch_horizon=None if stagger else horizon(), on_round=on_round,
                        swap_staging=self.swap_staging)
        reqs: list[Request] = []
        started: list[Request] = []  # every request begun: the only ones a swap can run for

        def begin(r: Request) -> None:
            # Right after r's own set-up, not after the batch's: a stored prefix's swap then runs
            # beside the later requests' set-ups and the first verify comes sooner (8k / batch 8, int8:
            # the first round's first two draft steps took 0.11-0.22 s beside the swaps, now 0.05-0.08).
            r.horizon = rounds.batch_horizon if rounds.batch_horizon is not None else horizon()
            rounds.start(r)
            started.append(r)
            if stagger and r.idx % 2 and r.limit > 1:
                r.limit //= 2  # a half-length first round puts odd requests out of phase

        try:
            while True:
                reqs += self.admission.admit(batch, reqs, res, on_setup=begin)
                if verkv:  # no verification: a round's drafts are the output
                    for r in reqs:
                        if not r.done and len(r.drafts) >= r.limit:
                            rounds.commit_unverified(r)
                active = [r for r in reqs if not r.done]
                if not active:
                    break
                self.last_run["max_active"] = max(self.last_run["max_active"], len(active))
                self.last_run["peak_kv_bytes"] = max(self.last_run["peak_kv_bytes"], res.held_bytes(active))
                if res.offload:  # a request without a verify cache drafts meanwhile, up to its limit
                    rounds.lease_waiting()
                for r in active:
                    rounds.draft_while_swapping(r)
                drafting = [r for r in active if len(r.drafts) < r.limit]
                # Lock step: nobody verifies while anybody still drafts. Verifying needs a verify cache.
                verifying = ([r for r in active if len(r.drafts) >= r.limit and r.full is not None]
                             if (stagger or not drafting) else [])
                rounds.step(drafting, verifying)
        finally:
            # Only an error leaves swaps in flight: stop them before the caller gets control back.
            rounds.cancel(started)  # (a set-up failing leaves begun requests out of reqs)
        return [Result(r.out, r.stats) for r in sorted(reqs, key=lambda r: r.idx)]

    def reference(self, prompts: Prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0, stored_prefix: bool = False) -> list[Result]:
        """Plain full-KV decoding in the same runtime: one token per forward. Records, per step, the
        top-1 minus top-2 logit margin (a divergence at a near-zero margin is a floating-point tie).
        ``stored_prefix``: the leading full chunks of a prompt that the store holds are read from it
        instead of prefilled (the full-KV baseline of a served prefix, as LMCache's own prefix
        caching gives it; ``stats.cached_chunks`` counts them, ``stats.prefill_s`` includes the read)."""
        sampling = Sampling(temperature, top_k, top_p)
        reqs = self.setup_requests(prompts, max_new_tokens, sampling, seed, draft=False, stored_prefix=stored_prefix)
        while active := [r for r in reqs if not r.done]:
            t0 = time.perf_counter()
            logits, _ = self.rt.forward(torch.tensor([r.tokens[-1] for r in active]),
                                        torch.tensor([r.pos for r in active]), [Segment(r.full, 1) for r in active])
            logits = host(logits)  # one read per step, not one per request
            dt = time.perf_counter() - t0
            for r, row in zip(active, logits):
                r.stats.verify_s += dt
                r.emit([r.pick(row, sampling)], self.eos_ids)
        return [Result(r.out, r.stats, r.margins) for r in reqs]

    def lossy(self, prompts: Prompts, max_new_tokens: int, *,
              on_step: Callable[[int], None] | None = None) -> list[Result]:
        """Greedy decoding on each prompt's draft cache alone (compressed prefix + exact suffix,
        laid out as :meth:`generate` lays it out), with no verification: what the lossy cache gives
        by itself. The first token comes from the exact prefill, as in :meth:`generate` (a prompt
        whose prefix the store holds: from its tail fed over the draft cache); output stops after
        an EOS. ``on_step(i)`` runs once token ``i`` is chosen (1: after the prefill; progress)."""
        reqs = self.setup_requests(prompts, max_new_tokens, Sampling(), 0, draft=True)
        for r in reqs:
            if len(r.tokens) == r.n_prompt:  # prefix from the store: the tail goes over the draft cache too
                n = len(r.tokens) - r.start
                logits, _ = self.rt.forward(torch.tensor(r.tokens[r.start:]), torch.arange(r.start, r.start + n),
                                            [Segment(r.draft, n)], rows=torch.tensor([n - 1]))
                r.emit([int(logits[0].argmax())], self.eos_ids)
        if on_step is not None:
            on_step(1)
        steps = max(r.remaining for r in reqs) + 1
        toks, _ = lossy.greedy(self.rt, [r.draft for r in reqs], [r.tokens[-1] for r in reqs],
                               [r.pos for r in reqs], steps, on_step=on_step)
        out = []
        for r, t in zip(reqs, toks):
            r.tokens = r.tokens[:-1]
            r.emit(t, self.eos_ids)
            out.append(Result(r.out, r.stats))
            r.release()
        return out

    def setup_requests(self, prompts: Prompts, max_new: int, sampling: Sampling, seed: int, *, draft: bool,
                       stored_prefix: bool = False) -> list[Request]:
        """Every prompt set up at once with resident caches, no budget (reference decoding,
        benchmarks that time steps over prefilled caches); each request's clock starts at its set-up."""
        batch = Batch.of(prompts, max_new, self.rt.vocab_size, sampling, seed)
        res = self.admission.residency(batch, "resident")
        twins: dict = {}
        reqs = []
        for i in range(len(batch.prompts)):
            batch.t0 = time.perf_counter()
            reqs.append(self.admission.setup(batch, i, res, twins, draft=draft, stored_prefix=stored_prefix))
        return reqs
