"""Compressed-KV drafting inside vLLM: a ``custom_class`` speculative proposer.

    --speculative-config '{"method": "custom_class", "num_speculative_tokens": 8,
        "model": "lmcache_vericache.connectors.proposer.CompressedKVProposer"}'

Each step, for every request that just sampled, it drafts up to ``k`` tokens greedily with the target
model itself (the module vLLM hands to ``load_model``, run through this package's runtime: no second
copy of the weights) over a *draft cache*: the request's completed prefix chunks, read from vLLM's
paged KV (:mod:`.paged_layout`) and compressed once each with a registry compressor, plus the exact
KV of its newest tokens. vLLM's rejection sampler then verifies the drafts against its full KV, so
output is unchanged whatever the drafts are.

Options (vLLM forbids extra keys in the speculative config) come from ``--additional-config
'{"vericache_proposer": {...}}'`` or, key by key as a fallback, from ``VERICACHE_PROPOSER_<KEY>``
environment variables (``additional_config`` wins):

* ``compressor`` (str, default ``"int8"``) and ``compressor_params`` (JSON object): registry method;
* ``chunk_size`` (int, default 128): tokens compressed together, once the chunk is complete;
* ``window`` (int, default 0): newest tokens always kept exact besides the open chunk;
* ``max_draft`` (int, 1..k, default k): most tokens drafted per step;
* ``adaptive`` (bool, default true): size each request's draft from its measured acceptance
  (:class:`~lmcache_vericache.engine.horizon.Horizon`): drafts past the likely mismatch are pure cost;
* ``gate`` (bool, default true): propose only where a draft step reads at most ``MAX_BYTES_RATIO`` of
  a plain step's bytes and, measured in the run (:class:`PayGate`), beats a plain step;
* ``draft_cache_bytes`` (int >= 0 or ``"auto"``, the default): most bytes the draft caches hold; a
  request whose cache would pass it is not drafted that step (:mod:`.draft_budget`: "auto", and the
  bytes taken from vLLM's KV cache on a GPU);
* ``triton_draft`` (bool or null, the default: on CUDA where the kernels read the chunks' format):
  keep draft prefixes as the stored chunks (int8, int4, KIVI, TurboQuant) in one arena per format,
  attended by the Triton kernels in one call per layer for all requests (:mod:`..engine.chunk_prefix`),
  instead of decompressed copies; ``true`` where they cannot is a start-up error naming why.

With the package's KV connector (:mod:`.vericache_connector`) in the same vLLM, the proposer drafts
over the store's compressed chunks (the connector's compressor and chunk size; ``compressor`` and
``chunk_size`` above then apply only without a connector): chunks the store has (prompt chunks the
connector saved or loaded) are read from its hot tier, not compressed again; the rest (generated
tokens) are compressed here. It also drafts during a prefix load (:mod:`.drafts`): its runtime drafts
over the store's compressed chunks while the full chunks stream in, and the first step after the load
proposes those drafts (whatever the gate says: they were made while the request waited). Proposer and
connector meet in the engine's :class:`~.worker_context.WorkerContext` (the proposer attaches its
runtime to the context's drafter; the connector fills in its store when its worker side starts).

Request identity: vLLM passes no request ids, and rows of ``token_ids_cpu`` move as requests come and
go. A draft state is therefore matched to a row by content: the state's committed tokens must be a
prefix of the row's tokens. Two requests with the same history would share KV anyway, so a match is
always correct; a state no row matched in a step belongs to a finished (or preempted) request and is
dropped. Block tables come from the attention metadata of the step's target forward (captured by a
forward pre-hook on the target model): row ``i`` of it is row ``i`` of ``token_ids_cpu``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import compressors
from ..engine.cache import KVCache, append_chunks, kv_to_2ltd
from ..engine.chunk_prefix import ChunkPrefix
from ..engine.horizon import Horizon
from ..options import parse_options
from . import paged_layout as pl
from .device_io import TorchCuda
from .draft_budget import DraftBudget, auto_bytes, chunk_entries, device_cap, kept_counts
from .draft_loop import greedy_drafts
from .draft_prefixes import DraftPrefixes
from .kv_layout import KVLayout
from .kv_layout import layout_for as kv_layout_for
from .pay_gate import MAX_BYTES_RATIO, PayGate, weight_bytes
from .vllm_model import runtime_for
from .worker_context import ChunkSource, WorkerContext

logger = logging.getLogger(__name__)
Tensor = torch.Tensor
CONFIG_KEY = "vericache_proposer"
ENV_PREFIX = "VERICACHE_PROPOSER_"


@dataclass(frozen=True)
class ProposerOptions:
    compressor: str = "int8"
    compressor_params: dict[str, Any] = field(default_factory=dict)
    chunk_size: int = 128
    window: int = 0
    max_draft: int | None = None  # None: num_speculative_tokens
    adaptive: bool = True
    # Propose only while it pays (tokens per second measured with and without proposals, PayGate);
    # false: always propose.
    gate: bool = True
    draft_cache_bytes: int | str = "auto"
    triton_draft: bool | None = None

    def validate(self) -> None:
        """Raises ``ValueError`` whose message starts with the offending option's name."""
        if self.triton_draft is not None and not isinstance(self.triton_draft, bool):
            raise ValueError(f"triton_draft must be true, false or null (auto), got {self.triton_draft!r}")
        b = self.draft_cache_bytes
        if b != "auto" and not (isinstance(b, int) and b >= 0):
            raise ValueError(f'draft_cache_bytes must be an int >= 0 or "auto", got {b!r}')
        for name, low in (("chunk_size", 1), ("window", 0), ("max_draft", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        try:
            compressors.get(self.compressor, **self.compressor_params)
        except (ValueError, TypeError) as e:
            name = "compressor_params" if self.compressor in compressors.available() else "compressor"
            raise ValueError(f"{name}: {e}") from None

    @classmethod
    def load(cls, additional_config: Mapping[str, Any] | None, env: Mapping[str, str], k: int) -> ProposerOptions:
        """Options from ``additional_config[CONFIG_KEY]`` over ``VERICACHE_PROPOSER_*``; a bad key or
        value raises ``ValueError`` naming it as its source spells it."""
        given = (additional_config or {}).get(CONFIG_KEY) or {}
        if not isinstance(given, Mapping):
            raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a JSON object, got {given!r}")
        from_env = {var[len(ENV_PREFIX):].lower(): _parse_env(var, raw) for var, raw in env.items()
                    if var.startswith(ENV_PREFIX)}
        # Each source alone first, so a mistake is named the way its source spells it.
        parse_options(cls, from_env, where="environment", spell=lambda n: ENV_PREFIX + n.upper())
        opts = parse_options(cls, {**from_env, **given}, where="additional_config", prefix=f"{CONFIG_KEY}.")
        if opts.max_draft is not None and opts.max_draft > k:
            key = f"{CONFIG_KEY}.max_draft" if "max_draft" in given else ENV_PREFIX + "MAX_DRAFT"
            raise ValueError(f"{key}={opts.max_draft} exceeds num_speculative_tokens={k}")
        return opts


def _parse_env(var: str, raw: str) -> Any:
    """An environment value: JSON where it parses (numbers, booleans, objects), else the string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


@dataclass
class _State:
    """Draft cache of one request: ``prefix`` positions compressed, then exact entries up to
    ``len(tokens)`` (the committed tokens whose KV vLLM has computed)."""

    cache: KVCache
    tokens: np.ndarray
    horizon: Horizon
    prefix: int = 0
    drafted: int = 0  # drafts proposed at the last step
    nbytes: int = 0  # of the cache's buffers, charged to the proposer's DraftBudget
    # How the prefix is chunked: the KV connector's store (its compressor and chunk size, chunks read
    # from it where it has them) or this proposer's own options (chunks compressed here).
    source: ChunkSource | None = None


@dataclass
class ProposerStats:
    steps: int = 0
    proposed: int = 0
    chunks: int = 0
    compressed_bytes: int = 0
    full_bytes: int = 0
    sync_s: float = 0.0  # reading vLLM's paged KV and compressing
    draft_s: float = 0.0  # draft forwards
    store_chunks: int = 0  # prefix chunks read from the KV connector's store instead of compressed here
    load_drafts: int = 0  # tokens proposed from drafts made during a prefix load
    load_accepted: list[int] = field(default_factory=list)  # of those, accepted by vLLM, per request (alpha)
    gated_steps: int = 0  # steps the gate kept quiet
    over_budget: int = 0  # requests not drafted in a step: their draft cache would pass draft_cache_bytes
    cache_bytes: int = 0  # bytes the draft caches hold after the last step


class CompressedKVProposer:
    """vLLM ``custom_class`` proposer drafting over compressed KV with the target model's weights."""

    def __init__(self, vllm_config: Any):
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
        self.budget: DraftBudget | None = None  # sized once the model's shape is known (load_model)
        cache = getattr(vllm_config, "cache_config", None)  # vLLM's block (kernel blocks may be smaller)
        self.block_size: int | None = int(cache.block_size) if cache is not None else None
        self.mem_share = float(getattr(cache, "gpu_memory_utilization", 0.9) or 0.9)  # for "auto" on a GPU
        self.context = WorkerContext.of(vllm_config)
        self.states: list[_State] = []
        self.stats = ProposerStats()
        self.gate = PayGate(max_step_tokens=self.k + 1) if self.opts.gate else None
        mc = vllm_config.model_config
        self._weight_bytes = weight_bytes(getattr(mc, "model", None), getattr(mc, "dtype", torch.float32))
        self.rt = None
        self._attn: list[torch.nn.Module] = []
        self._layout: KVLayout | None = None  # vLLM's paged KV of the layers, read on first use
        self._block_table: Tensor | None = None
        self._first: list[tuple[np.ndarray, int]] = []  # load drafts proposed last step: (row, proposed)
        self._draft_stream: tuple[TorchCuda, Any] | None = None  # CUDA: (ops, the drafter's own stream)
        self._prefixes: DraftPrefixes | None = None  # dense or chunked, per chunk source (made with rt)

    # -- vLLM hooks ------------------------------------------------------------------------------
    def load_model(self, target_model: torch.nn.Module) -> None:
        self.rt = runtime_for(target_model)
        try:
            self.prefixes.check()
        except ValueError as e:
            raise ValueError(f"{CONFIG_KEY}.triton_draft: {e}") from None
        # On CUDA the draft caches' bytes are held from here, inside vLLM's measurement of the
        # model's memory, until the first draft cache is charged (why: DraftBudget.reserve_device).
        self.budget = self._new_budget()
        self.budget.reserve_device(self.rt.device)
        # The KV connector's load window drafts with these weights, its caches charged to the budget too.
        self.context.drafter.attach(self.rt, self.budget)
        self._attn = [layer.self_attn.attn for layer in target_model.model.layers]
        target_model.register_forward_pre_hook(self._capture)
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

    @property
    def prefixes(self) -> DraftPrefixes:
        """How draft caches hold their prefix (:mod:`.draft_prefixes`), for the current runtime."""
        if self._prefixes is None or self._prefixes.rt is not self.rt:
            self._prefixes = DraftPrefixes(self.rt, self.compressor, self.opts.chunk_size, self.opts.triton_draft,
                                           charge=lambda old, new: self.budget.grow(old, new))
        return self._prefixes

    def _new_budget(self) -> DraftBudget:
        o, rt = self.opts, self.rt
        if o.draft_cache_bytes != "auto":
            return DraftBudget(o.draft_cache_bytes)
        # A prefix kept as stored chunks costs its stored bytes: as many as that share of dense entries.
        kept = ([math.ceil(o.chunk_size * self.prefixes.kept_ratio(None))] * rt.num_layers
                if self.prefixes.arena(None) is not None else kept_counts(self.compressor, o.chunk_size, rt))
        return DraftBudget(auto_bytes(self.max_num_seqs, self.max_model_len, kept, o.chunk_size,
                                      o.chunk_size + o.window + self.max_draft, rt.kv_bytes_per_token(),
                                      device_cap(rt.device, self.mem_share)))

    def _capture(self, module: torch.nn.Module, args: Any) -> None:
        """Keep the block table of the step's forward; ``propose`` runs after it in the same step."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        md = get_forward_context().attn_metadata if is_forward_context_available() else None
        if isinstance(md, list):
            md = md[0] if md else None
        meta = md.get(self._attn[0].layer_name) if md else None
        self._block_table = meta.block_table.clone() if meta is not None else None

    def propose(self, sampled_token_ids: list, num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        if self.rt is None or self._block_table is None:
            return out
        self.stats.steps += 1
        self.budget = self.budget or self._new_budget()
        t0 = time.perf_counter()
        if self._first:
            self._count_first_acceptance(num_tokens_no_spec, token_ids_cpu)
        pre = self._load_drafts(out, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) if self.context.drafter.pending() else set()
        lengths = [int(num_tokens_no_spec[i]) if len(s) else -1 for i, s in enumerate(sampled_token_ids)]
        if self.gate is not None and not self._may_pay(lengths):
            self.gate.pause()
            return self._quiet(out, token_ids_cpu, lengths)
        if self.gate is not None and not self.gate.step(lengths):
            return self._quiet(out, token_ids_cpu, lengths)
        claimed: list[_State] = []
        rows: list[tuple[int, _State, np.ndarray, int]] = []  # row, state, its tokens, draft length
        for i, sampled in enumerate(sampled_token_ids):
            n_tok = int(num_tokens_no_spec[i])
            n = min(self.max_draft, self.max_model_len - n_tok)
            if len(sampled) == 0 or n <= 0 or i in pre:  # partial prefill, no room left, drafted at load
                continue
            row = token_ids_cpu[i, :n_tok]
            st = self._match(row, claimed)
            claimed.append(st)
            accepted = n_tok - len(st.tokens) - 2  # new tokens since the last step = accepted + 1
            if st.drafted and 0 <= accepted <= st.drafted:
                st.horizon.update(st.drafted, accepted, 0.0, 0.0)
            rows.append((i, st, row, min(n, st.horizon.L)))
        self._keep(claimed)  # before caches grow
        work: list[tuple[int, _State, int, int]] = []  # row, state, last position, draft length
        for i, st, row, n in rows:
            st.drafted = 0
            if not self._sync(st, row, self._block_table[i], n):
                self.stats.over_budget += 1
                continue
            st.drafted = n
            work.append((i, st, len(row) - 1, n))
        self.stats.cache_bytes = self.budget.held
        t1 = time.perf_counter()
        self.stats.sync_s += t1 - t0
        drafts = greedy_drafts(self.rt, [int(token_ids_cpu[i, pos]) for i, _, pos, _ in work],
                               [pos for _, _, pos, _ in work], [st.cache for _, st, _, _ in work],
                               [n for *_, n in work], self.context.guard.vllm, *self._streams())
        for (i, *_), d in zip(work, drafts):
            out[i] = d
        for _, st, _, _ in work:  # forget the draft tokens' KV
            st.cache.n = len(st.tokens) - st.prefix
        self.stats.draft_s += time.perf_counter() - t1
        self.stats.proposed += sum(len(o) for o in out)
        return out

    def _streams(self) -> tuple[TorchCuda | None, Any]:
        """The drafter's own stream on CUDA (made once; :mod:`.draft_loop` says why), none elsewhere."""
        if self.rt.device.type == "cuda" and self._draft_stream is None:
            ops = TorchCuda(self.rt.device)
            self._draft_stream = (ops, ops.new_stream())
        return self._draft_stream or (None, None)

    def _quiet(self, out: list[list[int]], token_ids_cpu: np.ndarray, lengths: list[int]) -> list[list[int]]:
        """A step without proposals: running requests' states are kept (caught up when proposing
        again; none proposed, so the next step's growth is not their acceptance), finished ones
        released now (the gate may stay quiet for long)."""
        self.stats.gated_steps += 1
        rows = [token_ids_cpu[i, :n] for i, n in enumerate(lengths) if n > 0]
        self._keep([st for st in self.states if any(  # the last token first: a full compare only for owners
            len(r) > len(st.tokens) and (not len(st.tokens) or r[len(st.tokens) - 1] == st.tokens[-1])
            and np.array_equal(r[:len(st.tokens)], st.tokens) for r in rows)])
        for st in self.states:
            st.drafted = 0
        return out

    def _keep(self, kept: list[_State]) -> None:
        """The states of this step's requests; the others' (finished or preempted) bytes come back."""
        for st in self.states:
            if not any(st is k for k in kept):
                self.budget.give(st.nbytes)
                if isinstance(st.cache.packed, ChunkPrefix):
                    st.cache.packed.release()  # its arena slots (the arena's capacity stays charged)
        self.states = kept

    def _may_pay(self, lengths: list[int]) -> bool:
        """The bytes bound: a draft step must read at most ``MAX_BYTES_RATIO`` of the bytes of a
        plain step (weights plus every row's KV, against weights plus the bytes the draft cache
        keeps: a quantizer's chunks decompressed keep every entry, so int8 drafting passes only
        where they are kept as stored chunks, ``triton_draft``). Where
        the weights dominate (short contexts, small batches) no acceptance can make drafting pay,
        so the proposer does not even probe (building draft states alone would cost more)."""
        if self._weight_bytes is None:
            return True
        ratio = self.prefixes.kept_ratio(self.context.source)
        kv = sum(n for n in lengths if n > 0) * self.rt.kv_bytes_per_token()
        return self._weight_bytes + ratio * kv <= MAX_BYTES_RATIO * (self._weight_bytes + kv)

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

    # -- draft state -------------------------------------------------------------------------------
    def _match(self, row: np.ndarray, claimed: list[_State]) -> _State:
        best = None
        for st in self.states:
            m = len(st.tokens)
            if m < len(row) and (best is None or m > len(best.tokens)) and np.array_equal(st.tokens, row[:m]):
                best = st
        if best is not None and any(best is c for c in claimed) and self.budget.grow(0, best.nbytes):
            # Two rows with one history: the second gets its own copy (else a fresh state).
            return _State(best.cache.clone(), best.tokens.copy(), self._horizon(), best.prefix,
                          nbytes=best.nbytes, source=best.source)
        if best is None or any(best is c for c in claimed):  # an empty cache: _sync grows it within the budget
            source = self.context.source
            return _State(self.prefixes.new_cache(source), row[:0].copy(), self._horizon(), source=source)
        return best

    def _horizon(self) -> Horizon:
        # Adaptive drafts start short and double after full acceptance: on a CPU each draft token is
        # a forward of the served model, so a long first draft is a costly guess.
        start = min(4, self.max_draft) if self.opts.adaptive else self.max_draft
        return Horizon("auto" if self.opts.adaptive else self.max_draft, self.max_draft, start_len=start)

    def _sync(self, st: _State, row: np.ndarray, block_ids: Tensor, n_draft: int) -> bool:
        """Bring the draft cache to the committed tokens ``row[:-1]`` (the last one has no KV yet):
        append newly completed chunks to its prefix (from the KV connector's store where it has them,
        else compressed here from vLLM's cache), then copy the exact KV of the rest from vLLM's cache.
        ``False`` (the state unchanged) where the cache would pass the budget."""
        valid, source = len(row) - 1, st.source
        compressor, c = self.prefixes.chunking(source)
        upto = max(st.prefix, (valid - self.opts.window) // c * c)
        keys = source.space.token_keys(row[:upto].tolist()) if source and upto > st.prefix else None
        ckvs, stored = [], []
        for s in range(st.prefix, upto, c):
            ckv = source.store.get_compressed(keys[s // c]) if keys else None
            stored.append(ckv is not None)
            if ckv is None:
                ckv = compressor.compress(kv_to_2ltd(*self._read(block_ids, s, s + c)), self.rt.num_kv_heads, start=s)
            ckvs.append(ckv)
        # The exact size first (prefix entries by the chunks' own count, suffix, draft room), in whole
        # chunks; a prefix kept as stored chunks takes arena slots (charged as the arena grows).
        chunked = isinstance(st.cache.packed, ChunkPrefix)
        if chunked and not st.cache.packed.arena.ensure(len(ckvs)):
            return False
        gained = ([sum(g) for g in zip(*map(chunk_entries, ckvs))] if ckvs and not chunked
                  else [0] * len(st.cache.base))
        need = max(b + g for b, g in zip(st.cache.base, gained)) + valid - upto + n_draft
        nbytes = self.budget.grow_cache(st.cache, st.nbytes, need, c)
        if nbytes is None:
            return False
        st.nbytes = nbytes
        self.stats.chunks += len(stored) - sum(stored)
        self.stats.store_chunks += sum(stored)
        self.stats.compressed_bytes += sum(ckv.nbytes for ckv in ckvs)
        self.stats.full_bytes += sum(ckv.full_nbytes for ckv in ckvs)
        if ckvs:
            append_chunks(st.cache, ckvs, compressor)  # drops the exact suffix: copied again below
            st.prefix = upto
        have = st.prefix + st.cache.n
        if have < valid:
            k, v = self._read(block_ids, have, valid)
            st.cache.write_suffix(st.cache.n, k, v)
            st.cache.n = valid - st.prefix
        st.tokens = row[:valid].copy()
        return True

    def _kv_layout(self) -> KVLayout:
        """The layout strategy of vLLM's caches (the CPU probe or the logical view: :mod:`.kv_layout`)."""
        if self._layout is None:
            caches = [a.kv_cache[0] if isinstance(a.kv_cache, (list, tuple)) else a.kv_cache for a in self._attn]
            self._layout = kv_layout_for(caches, lambda: [getattr(a, "isa", None) for a in self._attn])
        return self._layout

    def _read(self, block_ids: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Exact K, V of positions ``[start, stop)``: ``[layers, kv_heads, T, head_dim]`` each, on the
        host (the compressors run there; the suffix copy moves them to the draft cache's device)."""
        layout = self._kv_layout()
        k, v = layout.gather(pl.slots_for(block_ids, start, stop, self.block_size or layout.layers[0].shape[2]))
        return k.cpu(), v.cpu()
