"""Reading vLLM's KV and the store's chunks into the proposer's draft caches, once per step.

Each step, every drafting request's cache is brought to its committed tokens (``row[:-1]``: the last
one has no KV yet): newly completed chunks join its compressed prefix (read from the KV connector's
store where it has them, else compressed here from vLLM's paged KV), then the exact KV of the rest
is copied from vLLM's paged KV. Which blocks hold a row's tokens comes from vLLM's own input batch
(:class:`BlockTables`: the table vLLM commits before each forward, in its kernel blocks), read at
``propose`` time, so a step never drafts from an earlier step's table (a forward hook would miss
steps replayed as CUDA graphs). Slots are computed on the host for every request of the step at
once, moved to the device in one copy and gathered in one call (:meth:`DraftSync.sync`): no
per-request transfer or synchronization. Chunks are compressed where vLLM's KV lives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..engine.cache import kv_to_2ltd
from ..engine.draft_cache import DraftCaches
from .draft_budget import DraftBudget
from .draft_states import DraftState
from .kv_layout import KVLayout, slots_to

Tensor = torch.Tensor


@dataclass
class SyncStats:
    chunks: int = 0  # prefix chunks compressed here
    store_chunks: int = 0  # prefix chunks read from the KV connector's store instead
    compressed_bytes: int = 0
    full_bytes: int = 0
    over_budget: int = 0  # requests not drafted in a step: their draft cache would pass draft_cache_bytes


class BlockTables:
    """vLLM's block table of the current step: row ``i`` of ``table`` (host int32 ``[rows, width]``)
    holds the blocks of ``token_ids_cpu`` row ``i``, in units of ``block_size`` tokens (the kernel
    block, which may be smaller than ``cache_config.block_size``)."""

    def __init__(self, table: np.ndarray, block_size: int):
        self.table, self.block_size = np.asarray(table), int(block_size)

    @classmethod
    def of_runner(cls, runner: Any) -> BlockTables:
        """The first KV cache group's table of a vLLM model runner's input batch now (its host copy:
        the one vLLM writes and commits to the device before each forward; read each step, as vLLM
        may replace its input batch after start-up)."""
        bt = runner.input_batch.block_table[0]
        return cls(bt.get_numpy_array(), bt.block_size)

    def slots(self, row: int, start: int, stop: int) -> np.ndarray:
        """Slots of token positions ``[start, stop)`` of row ``row``."""
        p = np.arange(start, stop, dtype=np.int64)
        blocks = self.table[row]
        return blocks[p // self.block_size].astype(np.int64) * self.block_size + p % self.block_size


@dataclass
class _Plan:
    st: DraftState
    caches: DraftCaches
    row: np.ndarray
    n_draft: int
    upto: int  # the prefix after this step
    keys: list[str] | None  # store keys of the row's chunks (a store source only)
    compress: list[int]  # chunk starts to compress here
    stored: dict[int, Any]  # chunk start -> the store's compressed chunk
    suffix: tuple[int, int]  # exact positions to copy


class DraftSync:
    """Brings draft states to vLLM's committed tokens (the module docstring). ``caches_for(source)``:
    the :class:`DraftCaches` of a state's chunk source; ``layout()``: vLLM's paged KV of the layers."""

    def __init__(self, rt: Any, budget: Callable[[], DraftBudget], caches_for: Callable[[Any], DraftCaches],
                 window: int, layout: Callable[[], KVLayout]):
        self.rt, self._budget, self.caches_for, self.window, self.layout = rt, budget, caches_for, window, layout
        self.stats = SyncStats()

    def sync(self, work: list[tuple[DraftState, int, np.ndarray, int]], tables: BlockTables) -> list[bool]:
        """For each ``(state, table row, committed tokens, drafts to come)``, the state brought to the
        tokens (``True``) or left as it was (``False``: its cache would pass the budget)."""
        plans = [self._plan(st, row, n) for st, _, row, n in work]
        ranges = [[(s, s + p.caches.chunk_size) for s in p.compress] + [p.suffix] for p in plans]
        slots = [tables.slots(i, a, b) for (_, i, _, _), rs in zip(work, ranges) for a, b in rs if b > a]
        if slots:
            k, v = self.layout().gather(slots_to(torch.from_numpy(np.concatenate(slots)), self.rt.device))
        done, at = [], 0
        for p, rs in zip(plans, ranges):
            parts = []
            for a, b in rs:
                parts.append((k[:, :, at:at + b - a], v[:, :, at:at + b - a]) if b > a else None)
                at += max(0, b - a)
            done.append(self._apply(p, parts[:-1], parts[-1]))
        return done

    def _plan(self, st: DraftState, row: np.ndarray, n_draft: int) -> _Plan:
        caches = self.caches_for(st.source)
        c, valid, source = caches.chunk_size, len(row) - 1, st.source
        upto = max(st.prefix, (valid - self.window) // c * c)
        keys = source.space.token_keys(row[:upto].tolist()) if source and upto > st.prefix else None
        stored, compress = {}, []
        for s in range(st.prefix, upto, c):
            ckv = source.store.get_compressed(keys[s // c]) if keys else None
            if ckv is not None:
                stored[s] = ckv
            else:
                compress.append(s)
        have = upto if upto > st.prefix else st.prefix + st.cache.n
        return _Plan(st, caches, row, n_draft, upto, keys, compress, stored, (have, valid))

    def _apply(self, p: _Plan, chunks: list, suffix: tuple[Tensor, Tensor] | None) -> bool:
        st, caches, c = p.st, p.caches, p.caches.chunk_size
        made = {s: caches.compressor.compress(kv_to_2ltd(*kv), self.rt.num_kv_heads, start=s)
                for s, kv in zip(p.compress, chunks)}
        ckvs = [p.stored.get(s) or made[s] for s in range(st.prefix, p.upto, c)]
        valid = len(p.row) - 1
        if not self._charge(st, caches, ckvs, valid - p.upto + p.n_draft):
            self.stats.over_budget += 1
            return False
        if ckvs:
            try:
                caches.append(st.cache, ckvs)  # drops the exact suffix: copied again below
            except MemoryError:  # an arena's growth refused by the budget
                self.stats.over_budget += 1
                return False
            st.prefix = p.upto
        self._true_up(st, caches)
        self.stats.chunks += len(made)
        self.stats.store_chunks += len(p.stored)
        self.stats.compressed_bytes += sum(ckv.nbytes for ckv in ckvs)
        self.stats.full_bytes += sum(ckv.full_nbytes for ckv in ckvs)
        if suffix is not None:
            st.cache.write_suffix(st.cache.n, *suffix)
        st.cache.n = valid - st.prefix
        st.tokens = p.row[:valid].copy()
        return True

    def _charge(self, st: DraftState, caches: DraftCaches, ckvs: list, exact: int) -> bool:
        """Charge the cache's growth before it is allocated: its dense buffers to :meth:`DraftCaches.need`
        entries, in whole chunks, and its packed prefix by the chunks' expected bytes."""
        need = caches.need(st.cache, ckvs, exact)
        entries = max(st.cache.capacity, math.ceil(need / caches.chunk_size) * caches.chunk_size)
        grown = caches.nbytes(st.cache, entries=entries)
        if caches.kind in ("int8", "codebook"):
            grown += math.ceil(sum(ckv.num_tokens for ckv in ckvs) * caches.read_ratio() * self.rt.kv_bytes_per_token())
        if grown > st.nbytes and not self._budget().grow(st.nbytes, grown, caches.copying(st.cache, entries)):
            return False
        st.nbytes = max(grown, st.nbytes)
        st.cache.reserve(entries, exact=True)
        return True

    def _true_up(self, st: DraftState, caches: DraftCaches) -> None:
        """The charge set to what the cache holds (a packed prefix's estimate replaced by its size)."""
        held = caches.nbytes(st.cache)
        self._budget().adjust(st.nbytes, held)
        st.nbytes = held
