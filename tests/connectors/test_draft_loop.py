"""The proposer's draft loop: drafts equal each row's own greedy continuation for rows of different
lengths, the host reads the drafts once per call (not once per token), and on a GPU the forwards run
on the drafter's stream between a wait for the compute stream and the compute stream's wait for it
(recorded with a fake of the stream primitives: no GPU here)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmcache_vericache.connectors.draft_loop import greedy_drafts
from lmcache_vericache.engine import Runtime, Segment
from lmcache_vericache.models import tiny_llama
from lmcache_vericache.testing.streams import FakeStreams


def _rows(rt: Runtime, lengths: list[int]):
    """A prompt per row, prefilled into its own cache: (last token, its position, cache)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for r in range(len(lengths)):
        prompt = torch.randint(0, 256, (20 + 7 * r,), generator=g)
        cache = rt.new_cache(64)
        logits, _ = rt.forward(prompt, torch.arange(len(prompt)), [Segment(cache, len(prompt))])
        rows.append((int(logits[-1].argmax()), len(prompt), cache))
    return rows


def _greedy(rt: Runtime, tok: int, pos: int, cache, n: int) -> list[int]:
    out, saved = [], cache.n
    for s in range(n):
        logits, _ = rt.forward(torch.tensor([tok]), torch.tensor([pos + s]), [Segment(cache, 1)])
        tok = int(logits[0].argmax())
        out.append(tok)
    cache.n = saved
    return out


def test_drafts_equal_each_rows_greedy_continuation():
    rt = Runtime(tiny_llama(seed=0))
    lengths = [3, 6, 1, 0, 6]
    rows = _rows(rt, lengths)
    want = [_greedy(rt, t, p, c, n) for (t, p, c), n in zip(rows, lengths)]
    got = greedy_drafts(rt, [t for t, _, _ in rows], [p for _, p, _ in rows], [c for *_, c in rows], lengths)
    assert got == want and [len(d) for d in got] == lengths
    assert greedy_drafts(rt, [], [], [], []) == []


class _HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host one scalar at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.scalars = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.scalars += func.name() == "aten::_local_scalar_dense"
        return func(*args, **(kwargs or {}))


def test_one_host_read_per_call_not_per_token(monkeypatch):
    rt = Runtime(tiny_llama(seed=0))
    lengths = [5, 5, 2]
    rows = _rows(rt, lengths)
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(tuple(t.shape)) or real(t))
    with _HostReads() as mode:
        greedy_drafts(rt, [t for t, _, _ in rows], [p for _, p, _ in rows], [c for *_, c in rows], lengths)
    assert reads == [(3, 5)] and mode.scalars == 0  # one [rows, steps] read; no .item() per token


def test_forwards_run_on_the_drafters_stream_between_the_waits():
    rt = Runtime(tiny_llama(seed=0))
    rows = _rows(rt, [1])
    fake = FakeStreams()
    forward = rt.forward

    def noted(*args, **kwargs):
        fake.note("forward")
        return forward(*args, **kwargs)

    rt.forward = noted
    side = fake.new_stream()
    greedy_drafts(rt, [rows[0][0]], [rows[0][1]], [rows[0][2]], [3], streams=fake, stream=side)
    ops = [(op, stream) for op, stream, _ in fake.log]
    assert ops == [("record", "compute"), ("wait", side), ("forward", side), ("forward", side),
                   ("forward", side), ("record", side), ("wait", "compute")]
    ready, done = fake.events
    waits = [detail for op, _, detail in fake.log if op == "wait"]
    assert waits == [ready.name, done.name]  # the side waits for compute's event, compute for the side's
