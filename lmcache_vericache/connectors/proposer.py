"""Compressed-KV drafting inside vLLM: a ``custom_class`` speculative proposer.

    --speculative-config '{"method": "custom_class", "num_speculative_tokens": 8,
        "model": "lmcache_vericache.connectors.proposer.CompressedKVProposer"}'

Each step, for every request that just sampled, it drafts up to ``k`` tokens greedily with the target
model itself (the module vLLM hands to ``load_model``, run through this package's runtime: no second
copy of the weights) over a *draft cache*: the request's completed prefix chunks in compressed form
plus the exact KV of its newest tokens. vLLM's rejection sampler then verifies the drafts against
its full KV, so output is unchanged whatever the drafts are. Options: :mod:`.proposer_options`.

This class is a thin facade over vLLM's hooks; the work is delegated:

* what a draft cache is (dense, int8 or TurboQuant codes read by the CPU kernels, stored chunks read
  by the Triton kernels on CUDA): :class:`~..engine.draft_cache.DraftCaches`, the engine's own;
* which row is which request, and how many tokens a step drafts (0 where drafting does not pay):
  :mod:`.draft_states`;
* reading the store's chunks and vLLM's paged KV into the draft caches, from vLLM's own block
  table of the step: :mod:`.draft_sync`; the draft forwards: :mod:`.draft_loop`.

With the package's KV connector (:mod:`.vericache_connector`) in the same vLLM, prefix chunks come
from its store (its compressor and chunk size; chunks it does not have are compressed here), and
drafts made while a request's prefix was loading (:mod:`.load_drafter`) are proposed at its first
step. Proposer and connector meet in the engine's :class:`~.worker_context.WorkerContext`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from .. import compressors
from ..backends.fused_planes import vllm_isa
from ..compressors import KVCompressor
from ..engine.draft_cache import DraftCaches
from .device_io import TorchCuda
from .draft_budget import DeviceHold, DraftBudget, device_cap
from .draft_loop import greedy_drafts
from .draft_states import DraftState, DraftStates, StepHorizon, accepted_of, may_pay, weight_bytes
from .draft_sync import BlockTables, DraftSync
from .kv_layout import KVLayout
from .kv_layout import layout_for as kv_layout_for
from .lmcache_source import lmcache_source, open_store, planes_layout
from .proposer_options import CONFIG_KEY, ProposerOptions
from .vllm_model import runtime_for
from .vllm_version import check_proposer
from .worker_context import ChunkSource, WorkerContext

logger = logging.getLogger("vllm." + __name__)
__all__ = ["CompressedKVProposer", "ProposerOptions"]


@dataclass
class ProposerStats:
    steps: int = 0
    proposed: int = 0
    quiet_steps: int = 0  # steps without drafts: the horizon chose plain decoding, or the bytes bound
    sync_s: float = 0.0  # bringing draft caches to vLLM's committed tokens (store reads, compression)
    draft_s: float = 0.0  # draft forwards
    load_drafts: int = 0  # tokens proposed from drafts made during a prefix load
    load_accepted: list[int] = field(default_factory=list)  # of those, accepted by vLLM, per request (alpha)
    cache_bytes: int = 0  # bytes the draft caches hold after the last step


class CompressedKVProposer:
    """vLLM ``custom_class`` proposer drafting over compressed KV with the target model's weights."""

    def __init__(self, vllm_config: Any):
        check_proposer()  # before anything else: on vLLM >= 0.34 the hook this class speaks is gone
        spec = vllm_config.speculative_config
        pc = getattr(vllm_config, "parallel_config", None)
        if pc is not None and (pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1):
            # Its draft forwards run the rank's slice of the model outside vLLM's step: no collectives.
            raise ValueError("CompressedKVProposer needs tensor_parallel_size = pipeline_parallel_size = 1 "
                             f"(got {pc.tensor_parallel_size} / {pc.pipeline_parallel_size})")
        self.k = int(spec.num_speculative_tokens)
        self.opts = ProposerOptions.load(getattr(vllm_config, "additional_config", None), os.environ, self.k)
        self.compressor = compressors.get(self.opts.compressor, **self.opts.compressor_params)
        self.max_draft = self.opts.max_draft or self.k
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_num_seqs = int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", 1))
        self.mem_share = float(getattr(getattr(vllm_config, "cache_config", None), "gpu_memory_utilization", 0.9) or 0.9)
        mc = vllm_config.model_config
        self._model_name = str(getattr(mc, "model", "") or "")  # LMCache MP's model name (lmcache_source)
        self._weight_bytes = weight_bytes(getattr(mc, "model", None), getattr(mc, "dtype", torch.float32))
        self.context = WorkerContext.of(vllm_config)
        # vLLM verifies an all-greedy batch by argmax and any other by rejection sampling over the
        # vocabulary (a sampled verify step cost 2.2-4 s against 0.56 s greedy at 8k / batch 8, bf16,
        # on a CPU): two cost regimes, one horizon each, so sampled steps do not price greedy ones.
        self.horizons = {greedy: StepHorizon(self.max_draft, self.opts.adaptive) for greedy in (True, False)}
        self.horizon = self.horizons[True]  # the regime of the current step
        self.all_greedy: Callable[[], bool] = lambda: True  # () -> whether this step's batch is all greedy
        self.states = DraftStates(self._new_state, self._clone_state, self._drop_state)
        self.stats = ProposerStats()
        self.rt = None
        self.budget: DraftBudget | None = None  # sized once the model's shape is known (load_model)
        self.sync: DraftSync | None = None
        self.block_tables: Any = None  # () -> BlockTables of the step (vLLM's input batch)
        self._attn: list[torch.nn.Module] = []
        self._layout: KVLayout | None = None  # vLLM's paged KV of the layers, read on first use
        self._caches: dict[int, DraftCaches] = {}  # id(compressor) -> its draft caches
        self._first: list[tuple[np.ndarray, int]] = []  # load drafts proposed last step: (row, proposed)
        self._draft_stream: tuple[TorchCuda, Any] | None = None  # CUDA: (ops, the drafter's own stream)
        # Beside LMCache's MP server: the L2 adapter's store (lmcache_store), opened now so that a bad
        # config fails at start-up; its key space once vLLM's KV layout is known (source()).
        self._lmcache = None
        self._lmcache_source: ChunkSource | None = None
        if self.opts.lmcache_store is not None:
            kv = getattr(vllm_config, "kv_transfer_config", None)
            if getattr(kv, "kv_connector", None) == "VeriCacheConnector":
                logger.info("vericache proposer: lmcache_store ignored: the VeriCache connector's store applies")
            else:
                heads = getattr(mc, "get_total_num_kv_heads", None)
                self._lmcache = open_store(self.opts.lmcache_store, heads() if heads else None)
                weakref.finalize(self, self._lmcache[1].close)

    # -- vLLM hooks ------------------------------------------------------------------------------
    def load_model(self, target_model: torch.nn.Module) -> None:
        runner = _calling_runner(self)
        self.attach(runtime_for(target_model), lambda: BlockTables.of_runner(runner),
                    all_greedy=lambda: bool(runner.input_batch.all_greedy))
        self._attn = [layer.self_attn.attn for layer in target_model.model.layers]
        # vLLM's forward and the load-window drafter must not run the model at once (ModelGuard).
        # (A hook returning a value would replace the forward's inputs / output: these return None.)
        guard = self.context.guard
        target_model.register_forward_pre_hook(lambda *_: guard.enter())
        target_model.register_forward_hook(lambda *_: guard.leave(), always_call=True)
        compute_logits = target_model.compute_logits

        def locked_logits(*args: Any, **kwargs: Any) -> Any:
            with guard.vllm():
                return compute_logits(*args, **kwargs)

        target_model.compute_logits = locked_logits
        target_model._vericache_proposer = self  # reachable from LLM.apply_model (stats, tests)

    def attach(self, rt: Any, block_tables: Any, layout: KVLayout | None = None,
               all_greedy: Callable[[], bool] | None = None) -> None:
        """Draft with runtime ``rt`` over vLLM's KV (``layout``: read from the attention layers when
        not given) at the blocks ``block_tables()`` names each step (``all_greedy()``: whether the
        step's batch samples no request, default always); validates the draft-cache options
        (``ValueError`` naming the option) and sizes the budget."""
        self.rt, self.block_tables, self._layout = rt, block_tables, layout
        if all_greedy is not None:
            self.all_greedy = all_greedy
        self._caches = {}
        own = self.caches_for(None)  # the options checked now, not at the first draft
        own.warm_up(self.max_model_len)  # CUDA: the Triton variants compiled before vLLM's steps
        limit = (self.opts.draft_cache_bytes if self.opts.draft_cache_bytes != "auto" else
                 own.auto_bytes(self.max_num_seqs, self.max_model_len, self.opts.chunk_size + self.opts.window + self.max_draft))
        cap = device_cap(rt.device, self.mem_share)
        limit = min(limit, cap) if cap is not None and self.opts.draft_cache_bytes == "auto" else limit
        # On CUDA the bytes are held from here, inside vLLM's measurement of the model's memory, until
        # the first draft cache is charged (DeviceHold.take says why).
        hold = DeviceHold(limit)
        hold.take(rt.device)
        self.budget = DraftBudget(limit, on_charge=hold.release)
        self.sync = DraftSync(rt, lambda: self.budget, self.caches_for, self.opts.window, self._kv_layout)
        self.context.drafter.attach(rt, self.budget, self.caches_for_chunks)

    def propose(self, sampled_token_ids: list, num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        if self.rt is None:
            return out
        t0 = time.perf_counter()
        self.stats.steps += 1
        if self._first:
            self._count_first_acceptance(num_tokens_no_spec, token_ids_cpu)
        pre = self._load_drafts(out, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) if self.context.drafter.pending() else set()
        self._choose_horizon()
        lengths = [int(num_tokens_no_spec[i]) if len(s) else -1 for i, s in enumerate(sampled_token_ids)]
        rows = {i: token_ids_cpu[i, :n] for i, n in enumerate(lengths) if n > 0}
        owned = self.states.owners(list(rows.values()))  # (state, the row extending it)
        owners = [st for st, _ in owned]
        rounds = [(st.drafted, a) for st, row in owned if (a := accepted_of(st, len(row))) is not None]
        self.horizon.begin(lengths, rounds)
        bound = not self.opts.adaptive or self._may_pay(lengths)
        L = self.horizon.L if bound else 0
        if L == 0:  # plain decoding: states kept (caught up when drafting again), finished ones dropped
            self.states.keep(owners)
            for st in owners:
                st.drafted = 0
            self.stats.quiet_steps += 1
            self.horizon.end(0, 0.0)
            if not bound:  # not the horizon's choice: no sample of its plain steps
                self.horizon.pause()
            return out
        claimed: list[DraftState] = []
        work: list[tuple[DraftState, int, np.ndarray, int]] = []  # state, row, its tokens, draft length
        for i, row in rows.items():
            n = min(L, self.max_model_len - len(row))
            if n <= 0 or i in pre:  # no room left, or drafted during its load
                continue
            st = self.states.match(row, claimed)
            claimed.append(st)
            work.append((st, i, row, n))
        self.states.keep(claimed)  # before caches grow
        for st in claimed:
            st.drafted = 0
        done = self.sync.sync(work, self.block_tables())
        work = [w for w, ok in zip(work, done) if ok]
        t1 = time.perf_counter()
        drafts = greedy_drafts(self.rt, [int(row[-1]) for _, _, row, _ in work], [len(row) - 1 for _, _, row, _ in work],
                               [st.cache for st, *_ in work], [n for *_, n in work], self.context.guard.vllm,
                               *self._streams())
        for (st, i, _, n), d in zip(work, drafts):
            out[i], st.drafted = d, n
            st.cache.n = len(st.tokens) - st.prefix  # forget the draft tokens' KV
        t2 = time.perf_counter()
        self.stats.sync_s += t1 - t0
        self.stats.draft_s += t2 - t1
        self.stats.proposed += sum(len(o) for o in out)
        self.stats.cache_bytes = self.budget.held
        # The horizon prices the draft forwards: a state's sync is mostly its one-off build (a new
        # request's prefix read or compressed), then a few exact tokens a step (in stats.sync_s).
        self.horizon.end(max((n for *_, n in work), default=0), t2 - t1)
        return out

    def _choose_horizon(self) -> None:
        """The horizon of this step's cost regime; one entered anew takes no sample from the step
        before (it ran in the other regime)."""
        horizon = self.horizons[bool(self.all_greedy())]
        if horizon is not self.horizon:
            horizon.pause()
            self.horizon = horizon

    def _may_pay(self, lengths: list[int]) -> bool:
        """The bytes bound of this step's rows (:func:`~.draft_states.may_pay`)."""
        kv = sum(n for n in lengths if n > 0) * self.rt.kv_bytes_per_token()
        return may_pay(self._weight_bytes, kv, self.caches_for(self.source()).read_ratio())

    def source(self) -> ChunkSource | None:
        """Where stored prefix chunks come from: the package's KV connector's store; without it, the
        L2 adapter's store beside LMCache's MP server (``lmcache_store``: :mod:`.lmcache_source`);
        else none (every chunk compressed here)."""
        if self.context.source is not None or self._lmcache is None:
            return self.context.source
        if self._lmcache_source is None:
            kv = self._kv_layout()
            block = int(kv.layers[0].shape[2])  # the CPU cache's block (its tiles); unused elsewhere
            isa = (getattr(self._attn[0], "isa", None) if self._attn else None) or vllm_isa(kv.dtype, block, kv.head_size)
            self._lmcache_source = lmcache_source(*self._lmcache, self.opts.lmcache_chunk_size, self._model_name,
                                                  kv.dtype, planes_layout(kv.device, isa, block))
        return self._lmcache_source

    # -- draft caches -----------------------------------------------------------------------------
    def caches_for(self, source: ChunkSource | None) -> DraftCaches:
        """The draft caches of ``source``'s chunks (the KV connector's store), else of our own options."""
        if source is None:
            return self.caches_for_chunks(self.compressor, self.opts.chunk_size)
        return self.caches_for_chunks(source.store.compressor, source.chunk_size)

    def caches_for_chunks(self, compressor: KVCompressor, chunk_size: int) -> DraftCaches:
        """The draft caches of chunks of ``compressor`` (the load drafter's: a load's store chunks)."""
        key = id(compressor)
        if key not in self._caches:
            o, rt = self.opts, self.rt
            try:
                self._caches[key] = DraftCaches.choose(rt, compressor, chunk_size, int8=o.int8_draft,
                                                       codebook=o.codebook_draft, triton=o.triton_draft,
                                                       charge=lambda old, new: self.budget.grow(old, new))
            except ValueError as e:
                if compressor is self.compressor:  # our own options: a start-up error naming the option
                    raise ValueError(f"{CONFIG_KEY}.{e}") from None
                logger.warning("vericache proposer: the %s chunks of the KV connector's store are drafted "
                               "over decompressed copies: %s", compressor.name, e)
                self._caches[key] = DraftCaches(rt, compressor, chunk_size)
        return self._caches[key]

    def _new_state(self) -> DraftState:
        source = self.source()
        return DraftState(self.caches_for(source).new(), np.empty(0, dtype=np.int32), source)

    def _clone_state(self, st: DraftState) -> DraftState | None:
        """A second row with one history gets its own copy (``None``: the budget refused it)."""
        if not self.budget.grow(0, st.nbytes):
            return None
        return DraftState(st.cache.clone(), st.tokens.copy(), st.source, st.prefix, nbytes=st.nbytes)

    def _drop_state(self, st: DraftState) -> None:
        self.budget.give(st.nbytes)
        st.cache.release()

    def _kv_layout(self) -> KVLayout:
        """The layout strategy of vLLM's caches (the CPU probe or the logical view: :mod:`.kv_layout`)."""
        if self._layout is None:
            caches = [a.kv_cache[0] if isinstance(a.kv_cache, (list, tuple)) else a.kv_cache for a in self._attn]
            self._layout = kv_layout_for(caches, lambda: [getattr(a, "isa", None) for a in self._attn])
        return self._layout

    def _streams(self) -> tuple[TorchCuda | None, Any]:
        """The drafter's own stream on CUDA (made once; :mod:`.draft_loop` says why), none elsewhere."""
        if self.rt.device.type == "cuda" and self._draft_stream is None:
            ops = TorchCuda(self.rt.device)
            self._draft_stream = (ops, ops.new_stream())
        return self._draft_stream or (None, None)

    # -- drafts made during a prefix load --------------------------------------------------------
    def _load_drafts(self, out: list[list[int]], sampled_token_ids: list, num_tokens_no_spec: np.ndarray,
                     token_ids_cpu: np.ndarray) -> set[int]:
        """Rows whose request just ran its first step after a prefix load drafted during it: propose
        those drafts if the first one is the token vLLM sampled. Returns the rows served."""
        served = set()
        for i, sampled in enumerate(sampled_token_ids):
            n_tok = int(num_tokens_no_spec[i])
            if len(sampled) == 0 or n_tok < 2:
                continue
            made = self.context.drafter.take(token_ids_cpu[i, :n_tok - 1].tolist())
            if made is None:
                continue
            matched = bool(made) and made[0] == int(token_ids_cpu[i, n_tok - 1])
            self.context.drafter.count_use(matched)
            if matched:
                out[i] = made[1:1 + min(self.k, self.max_model_len - n_tok)]
                self.stats.load_drafts += len(out[i])
                self._first.append((token_ids_cpu[i, :n_tok].copy(), len(out[i])))
                served.add(i)
        return served

    def _count_first_acceptance(self, num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray) -> None:
        """Drafts accepted in each request's first verification after its load (found by content)."""
        for row, proposed in self._first:
            for i in range(len(num_tokens_no_spec)):
                n = int(num_tokens_no_spec[i])
                if n > len(row) and np.array_equal(token_ids_cpu[i, :len(row)], row):
                    self.stats.load_accepted.append(min(proposed, n - len(row) - 1))
                    break
        self._first = []

    def report(self, reset_costs: bool = False) -> dict[str, Any]:
        """Counters, the step costs measured since the last reset (medians, ms) and the draft
        caches' kind. ``reset_costs``: start the cost samples afresh (per benchmark job)."""
        sync = asdict(self.sync.stats) if self.sync is not None else {}
        kind = self.caches_for(self.source()).kind if self.rt is not None else None
        out = {**asdict(self.stats), **sync, **self.horizon.medians_ms(), "draft_cache": kind,
               "live_states": len(self.states.states), "horizon_L": self.horizon.L,
               # rounds per draft length chosen (0: plain steps), per verify regime, over its last 4096 rounds
               "horizon_rounds": {("greedy" if g else "sampled"): dict(Counter(r.L for r in h.horizon.record))
                                  for g, h in self.horizons.items()},
               # per regime since the last reset, per step: [rows decoding, drafts per row, vLLM's step ms before it, propose ms, draft ms]
               "horizon_trace": {("greedy" if g else "sampled"): h.trace for g, h in self.horizons.items()}}
        if reset_costs:
            for horizon in self.horizons.values():
                horizon.clear_samples()
        return out


def _calling_runner(proposer: CompressedKVProposer) -> Any:
    """The vLLM model runner whose ``load_model`` is calling ours (its ``drafter`` is ``proposer``):
    the proposer reads that runner's input batch (block table) each step. vLLM hands a custom
    proposer neither, so it is found on the call stack; ``RuntimeError`` naming the way out if not."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if getattr(obj, "drafter", None) is proposer and hasattr(obj, "input_batch"):
            return obj
        frame = frame.f_back
    raise RuntimeError("CompressedKVProposer.load_model was not called by a vLLM model runner whose drafter it "
                       "is (vLLM's custom_class hook, vLLM 0.32); call attach(runtime, block_tables) instead")
