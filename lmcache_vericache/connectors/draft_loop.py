"""The proposer's greedy draft: ``k`` forwards of a batch of requests over their draft caches.

Each forward's argmax stays on the device and is the next forward's input; the drafts come back to
the host in one read at the end (a read per drafted token would stall a GPU's queue ``k`` times a
step). Rows are ordered longest draft first, so the rows still drafting at step ``s`` are a prefix
and need no host-side selection.

On a GPU the forwards run on the drafter's own stream (``streams``, a
:class:`~.device_io.StreamOps`): it first waits for the compute stream, whose queued work (vLLM's
forward) wrote the KV the draft caches were synced from, and the compute stream waits for it before
the final read. Called on vLLM's worker thread, between its forward and the next step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..engine.cache import KVCache
from ..engine.runtime import Runtime, Segment
from .device_io import StreamOps


def greedy_drafts(rt: Runtime, first: list[int], positions: list[int], caches: list[KVCache], lengths: list[int],
                  lock: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                  streams: StreamOps | None = None, stream: Any = None) -> list[list[int]]:
    """Draft ``lengths[r]`` tokens for row ``r``: its last committed token ``first[r]`` at
    ``positions[r]``, then each drafted token, one position further per step, over ``caches[r]``
    (their draft tokens' KV is appended: the caller forgets it). ``lock()`` is held around each
    forward (the model is shared with vLLM's forward). Returns the tokens per row, in row order."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    steps = lengths[order[0]] if order else 0
    if steps <= 0:
        return [[] for _ in lengths]
    dev = rt.device
    # Made on the compute stream and read on the drafter's: all three stay referenced until the
    # compute stream has waited for the drafter (freed earlier, their memory could be reused first).
    first_tokens = torch.tensor([first[r] for r in order], device=dev)
    pos = torch.tensor([positions[r] for r in order], device=dev)
    drafted = torch.empty(len(order), steps, dtype=torch.long, device=dev)
    use = contextlib.nullcontext() if streams is None else streams.use(stream)
    if streams is not None:
        ready = streams.record(streams.current_stream())
    with use:
        if streams is not None:
            streams.wait(stream, ready)
        tokens = first_tokens
        for s in range(steps):
            live = sum(lengths[r] > s for r in order)
            with lock():
                logits, _ = rt.forward(tokens[:live], pos[:live] + s, [Segment(caches[r], 1) for r in order[:live]])
            tokens = logits.argmax(-1)
            drafted[:live, s] = tokens
        done = streams.record(stream) if streams is not None else None
    if streams is not None:
        streams.wait(streams.current_stream(), done)
    rows = drafted.tolist()  # the one host read
    out: list[list[int]] = [[] for _ in lengths]
    for i, r in enumerate(order):
        out[r] = rows[i][:lengths[r]]
    return out
