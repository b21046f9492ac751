"""The proposer's per-request draft state, and how many tokens a step drafts.

Request identity: vLLM passes no request ids to a ``custom_class`` proposer, and rows of
``token_ids_cpu`` move as requests come and go. A :class:`DraftState` is therefore matched to a row
by content (:meth:`DraftStates.match`): the state's committed tokens must be a prefix of the row's.
Two requests with the same history would share KV anyway, so a match is always correct; a state no
row matched in a step belongs to a finished (or preempted) request and its cache is dropped.

Draft length (:class:`StepHorizon`): every request's drafts are verified in one vLLM forward, so the
batch runs in lock step, as the engine's does, and one :class:`~..engine.horizon.Horizon` chooses the
step's draft length from measured costs: the draft step (this proposer's forwards, its sync of the
draft caches included), vLLM's verify step for ``L + 1`` tokens and vLLM's plain step, both timed
between consecutive ``propose`` calls, and the acceptance vLLM's rejection sampler returned. It
chooses 0 (plain decoding) where drafting measures slower. Before any of that, :func:`may_pay` is
the bound no measurement can beat: a draft step cannot cost less than the bytes it reads.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..backends.keys import weight_files
from ..engine.cache import KVCache
from ..engine.horizon import Horizon
from .worker_context import ChunkSource

#: A draft step must read at most this share of a plain step's bytes for drafting to be tried at all.
MAX_BYTES_RATIO = 0.75


@dataclass
class DraftState:
    """Draft cache of one request: ``prefix`` positions compressed, then exact entries up to
    ``len(tokens)`` (the committed tokens whose KV vLLM has computed)."""

    cache: KVCache
    tokens: np.ndarray
    source: ChunkSource | None  # the store whose chunks form the prefix (None: compressed here)
    prefix: int = 0
    drafted: int = 0  # drafts proposed at the last step
    nbytes: int = 0  # of the cache, charged to the proposer's DraftBudget


class DraftStates:
    """The draft states of one proposer, matched to vLLM's rows each step (the module docstring).
    ``new_state(source)`` makes an empty state; ``clone(state)`` an independent copy charged to the
    budget (``None`` where it refuses); ``drop(state)`` gives a state's bytes back."""

    def __init__(self, new_state: Callable[[], DraftState], clone: Callable[[DraftState], DraftState | None],
                 drop: Callable[[DraftState], None]):
        self.states: list[DraftState] = []
        self._new, self._clone, self._drop = new_state, clone, drop

    def match(self, row: np.ndarray, claimed: list[DraftState]) -> DraftState:
        """The state of the request whose committed tokens ``row`` holds (the longest whose tokens
        are a prefix of it); a second row with that history gets a copy, a new request a new state."""
        best = None
        for st in self.states:
            m = len(st.tokens)
            if m < len(row) and (best is None or m > len(best.tokens)) and np.array_equal(st.tokens, row[:m]):
                best = st
        if best is not None and any(best is c for c in claimed):
            return self._clone(best) or self._new()
        return best if best is not None else self._new()

    def owners(self, rows: list[np.ndarray]) -> list[tuple[DraftState, np.ndarray]]:
        """States some row still extends, each with that row (a quiet step keeps them; they catch up
        when drafting; the row's length tells the last proposal's acceptance)."""
        out = []
        for st in self.states:
            m = len(st.tokens)
            row = next((r for r in rows if len(r) > m and (not m or r[m - 1] == st.tokens[-1])  # cheap test first
                        and np.array_equal(r[:m], st.tokens)), None)
            if row is not None:
                out.append((st, row))
        return out

    def keep(self, kept: list[DraftState]) -> None:
        """This step's states; the others' (finished or preempted requests) are dropped."""
        for st in self.states:
            if not any(st is k for k in kept):
                self._drop(st)
        self.states = kept


def accepted_of(st: DraftState, n_tokens: int) -> int | None:
    """Drafts vLLM accepted of ``st``'s last proposal, from its row's length now (the row grew by
    the accepted drafts plus one token); ``None`` where the state proposed nothing."""
    accepted = n_tokens - len(st.tokens) - 2
    return accepted if st.drafted and 0 <= accepted <= st.drafted else None


class StepHorizon:
    """The draft length of each step (the module docstring). ``adaptive=False``: always ``max_draft``.

    :meth:`begin` at the start of ``propose`` accounts the step vLLM just ran (its seconds since the
    last :meth:`end`, the rounds ``(drafted, accepted)`` it verified) when it was a steady decode
    step (the same rows, each grown by what one step can emit; a prefill or a batch change is no
    sample); :meth:`end` closes ``propose`` with the drafts it made and their seconds."""

    def __init__(self, max_draft: int, adaptive: bool = True, clock: Callable[[], float] = time.perf_counter):
        start = min(4, max_draft) if adaptive else max_draft
        self.horizon = Horizon("auto" if adaptive else max_draft, max_draft, start_len=start, plain_ok=adaptive,
                               swap_floor=False)
        self.max_draft, self.clock = max_draft, clock
        self._lengths: list[int] | None = None
        self._end: float | None = None
        self._drafted, self._draft_s = 0, 0.0
        self.draft_step_s: deque[float] = deque(maxlen=256)
        self.verify_step_s: deque[float] = deque(maxlen=256)
        self.plain_step_s: deque[float] = deque(maxlen=256)
        self.trace: list[list] = []  # per step: [rows decoding, drafts, vLLM's step ms before it, propose ms, draft ms]
        self._vllm_s: float | None = None  # vLLM's step before this propose (since the last end)
        self._begin = 0.0

    @property
    def L(self) -> int:
        return self.horizon.L

    def begin(self, lengths: list[int], rounds: list[tuple[int, int]]) -> None:
        """``lengths``: each row's tokens (-1: a row in prefill); ``rounds``: for the rows that
        proposed at the last step, ``(drafted, accepted)``."""
        now = self.clock()
        self._vllm_s, self._begin = (now - self._end if self._end is not None else None), now
        prev, self._lengths = self._lengths, lengths
        steady = prev is not None and len(prev) == len(lengths) and all(
            a >= 0 and 0 < b - a <= self.max_draft + 1 for a, b in zip(prev, lengths))
        if not steady or self._end is None:
            return
        step_s = now - self._end
        if self._drafted and rounds:
            step = self._draft_s / self._drafted
            self.draft_step_s.append(step)
            self.verify_step_s.append(step_s)
            self.horizon.update_rounds(rounds, step, 0.0, step_s, self._draft_s + step_s)
        elif not self._drafted:
            self.plain_step_s.append(step_s)
            self.horizon.update_rounds([(0, 0)], 0.0, 0.0, step_s, step_s)

    def end(self, drafted: int, draft_s: float) -> None:
        """``drafted``: the most drafts a row got this step (0: none); ``draft_s``: their seconds."""
        self._drafted, self._draft_s = drafted, draft_s
        self._end = self.clock()
        if len(self.trace) < 2048:
            rows = sum(n > 0 for n in self._lengths or ())
            vllm_ms = None if self._vllm_s is None else round(1e3 * self._vllm_s, 1)  # None: after a pause
            self.trace.append([rows, drafted, vllm_ms, round(1e3 * (self._end - self._begin), 1), round(1e3 * draft_s, 1)])

    def pause(self) -> None:
        """A step drafting was ruled out for another reason: the next interval is no sample."""
        self._end = self._lengths = None

    def clear_samples(self) -> None:
        """Forget the reported step costs (the horizon's own model is kept)."""
        for d in (self.draft_step_s, self.verify_step_s, self.plain_step_s):
            d.clear()
        self.trace = []

    def medians_ms(self) -> dict[str, float | None]:
        return {name: (1e3 * statistics.median(d) if d else None) for name, d in (
            ("draft_step_ms", self.draft_step_s), ("verify_step_ms", self.verify_step_s),
            ("plain_step_ms", self.plain_step_s))}


def weight_bytes(folder: str | None, dtype: torch.dtype) -> int | None:
    """Bytes of the served weights in ``dtype``, from the safetensors headers (no tensor is read);
    ``None`` where the model is not a local safetensors folder."""
    files = weight_files(folder) if folder else []
    if not files:
        return None
    from safetensors import safe_open

    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            total += sum(int(np.prod(h.get_slice(n).get_shape())) for n in h.keys())
    return total * size


def may_pay(weights: int | None, kv_bytes: int, read_ratio: float) -> bool:
    """The bytes bound: a draft step (weights plus ``read_ratio`` of the KV) must read at most
    :data:`MAX_BYTES_RATIO` of a plain step's bytes (weights plus ``kv_bytes``). Where the weights
    dominate (short contexts, small batches) no acceptance can make drafting pay, so it is not even
    tried (building draft states alone would cost more). Unknown weights: tried."""
    if weights is None:
        return True
    return weights + read_ratio * kv_bytes <= MAX_BYTES_RATIO * (weights + kv_bytes)
