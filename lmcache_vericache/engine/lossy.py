"""Decoding on a lossy KV cache alone, with no verification: what a compressed cache gives by
itself, and where its tokens leave full-KV decoding (VeriCache's verification keeps them equal).

Used by :meth:`~.vericache_engine.VeriCacheEngine.lossy`, ``vericache demo`` and
``benchmarks/drift.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .cache import KVCache
from .runtime import Runtime, Segment


def greedy(rt: Runtime, caches: Sequence[KVCache], first: Sequence[int], pos: Sequence[int], steps: int, *,
           logprobs: bool = False, on_step: Callable[[int], None] | None = None
           ) -> tuple[list[list[int]], torch.Tensor | None]:
    """``steps`` greedy tokens on each cache, one flat batch per step (a step reads the weights once
    for all of them). Cache ``i`` starts from token ``first[i]`` (already chosen) at position
    ``pos[i]``; EOS does not stop it. Returns the tokens per cache and, with ``logprobs``, the
    log-softmax of every step after the first ``[caches, steps - 1, V]``. Advances the caches.
    ``on_step(i)`` runs after step ``i`` (1-based; progress)."""
    toks, lps = [[f] for f in first], []
    for i in range(steps - 1):
        logits, _ = rt.forward(torch.tensor([t[-1] for t in toks]), torch.tensor([p + i for p in pos]),
                               [Segment(c, 1) for c in caches])
        if logprobs:
            lps.append(F.log_softmax(logits, -1))
        for t, row in zip(toks, logits):
            t.append(int(row.argmax()))
        if on_step is not None:
            on_step(i + 2)
    return toks, (torch.stack(lps, 1) if lps else None) if logprobs else None


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First position where ``a`` and ``b`` differ (``None``: equal over their common length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def loops(tokens: Sequence[int], period_max: int = 64) -> bool:
    """True if the output's second half is a repetition (the model fell into a loop): greedy
    acceptance over a loop is inflated, since any drafter predicts a loop."""
    tail = tokens[len(tokens) // 2:]
    return any(all(tail[j] == tail[j + p] for j in range(len(tail) - p)) for p in range(1, min(period_max, len(tail))))
