"""CompressedKVProposer's per-request state without an engine: a tiny Llama's real KV laid out in a
paged cache exactly as vLLM's CPU cache-write op does it, the proposer's own sync/draft path on top.

With the ``none`` (identity) compressor the draft cache holds the exact KV, so drafts must equal the model's
own greedy continuation; that pins the paged read, chunk compression, suffix copy and positions.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmcache_vericache.connectors import paged_layout as pl
from lmcache_vericache.connectors.kv_layout import CpuBlockLayout
from lmcache_vericache.connectors.proposer import CompressedKVProposer
from lmcache_vericache.engine import Runtime, Segment

pytest.importorskip("vllm._custom_ops")
K, B = 4, 128


@pytest.fixture(scope="module")
def tiny_model():
    from lmcache_vericache.models import tiny_llama

    return tiny_llama(seed=0, head_dim=32)  # vLLM's CPU attention supports head sizes of 32 and up


class Target:
    """The 'vLLM side': a full cache per request in the runtime, mirrored into a paged cache."""

    def __init__(self, rt: Runtime, blocks: list[int], prompt: list[int], paged: list[torch.Tensor]):
        self.rt, self.blocks, self.paged = rt, torch.tensor(blocks), paged
        self.full = rt.new_cache(1024)
        self.tokens = list(prompt)
        self._compute(0)

    def _compute(self, start: int) -> None:
        """Compute KV of tokens[start:] (the full cache) and write it to the paged cache; append the
        greedy next token."""
        n = len(self.tokens) - start
        logits, _ = self.rt.forward(torch.tensor(self.tokens[start:]), torch.arange(start, start + n),
                                    [Segment(self.full, n)])
        slots = pl.slots_for(self.blocks, start, start + n, B)
        for li, cache in enumerate(self.paged):
            pl.scatter(cache, pl.layout_for(cache, "vec"), slots, self.full.k[li, :, start:start + n],
                       self.full.v[li, :, start:start + n])
        self.tokens.append(int(logits[-1].argmax()))

    def greedy(self, n: int) -> list[int]:
        """The next n greedy tokens after tokens (without committing them)."""
        c = self.full
        saved, out, tok = c.n, [], self.tokens[-1]
        for _ in range(n):
            logits, _ = self.rt.forward(torch.tensor([tok]), torch.tensor([c.n]), [Segment(c, 1)])
            tok = int(logits[0].argmax())
            out.append(tok)
        c.n = saved
        return out

    def accept(self, m: int) -> None:
        """Commit m more greedy tokens (what vLLM does after verification)."""
        start = self.full.n
        self.tokens += self.greedy(m)  # m accepted drafts; _compute adds the bonus token
        self._compute(start)


def make(tiny_model, compressor="none", **opts):
    # The pay gate would keep the first steps quiet (it measures plain steps first); these tests are
    # about the draft state, test_pay_gate.py about the gate.
    opts = {"gate": False, **opts}
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                          model_config=SimpleNamespace(max_model_len=4096),
                          additional_config={"vericache_proposer": {"compressor": compressor, **opts}})
    p = CompressedKVProposer(cfg)
    p.rt = Runtime(tiny_model)
    rt = p.rt
    paged = [torch.zeros(12, rt.num_kv_heads, B, 2 * rt.head_dim) for _ in range(rt.num_layers)]
    p._layout = CpuBlockLayout(paged, lambda: ["vec"] * len(paged))
    return p, paged


def call(p, targets):
    rows = np.zeros((4, 1024), dtype=np.int32)
    for i, t in enumerate(targets):
        rows[i, :len(t.tokens)] = t.tokens
    p._block_table = torch.stack([torch.nn.functional.pad(t.blocks, (0, 8 - len(t.blocks))) for t in targets])
    n = np.array([len(t.tokens) for t in targets] + [0] * (4 - len(targets)), dtype=np.int32)
    return p.propose([[t.tokens[-1]] for t in targets], n, rows)


def test_exact_drafts_and_state_kept_across_steps(tiny_model):
    p, paged = make(tiny_model)
    g = torch.Generator().manual_seed(0)
    t = Target(p.rt, [5, 2, 9, 0], torch.randint(0, 256, (300,), generator=g).tolist(), paged)
    assert call(p, [t]) == [t.greedy(K)]
    st = p.states[0]
    assert st.prefix == 256 and p.stats.chunks == 2  # two complete 128-token chunks compressed
    for step in range(4):
        if step:  # vLLM accepted some drafts: same state continues, drafts stay exact
            t.accept(2)
            assert call(p, [t]) == [t.greedy(K)]
            assert p.states == [st]
        # The draft cache is the exact KV of every committed token read back from the paged cache.
        n = len(t.tokens) - 1
        assert st.cache.base == [256] * p.rt.num_layers and 256 + st.cache.n == n
        assert torch.equal(st.cache.k[:, :, :n], t.full.k[:, :, :n])
        assert torch.equal(st.cache.v[:, :, :n], t.full.v[:, :, :n])
    # vLLM rejected every draft twice: the request's draft length shrinks (adaptive horizon).
    t.accept(0)
    call(p, [t])
    t.accept(0)
    out = call(p, [t])[0]
    assert 1 <= len(out) < K and out == t.greedy(len(out))


def test_fixed_draft_length_when_not_adaptive(tiny_model):
    p, paged = make(tiny_model, adaptive=False, max_draft=3)
    t = Target(p.rt, [3, 1, 0], list(range(40, 240)), paged)
    for _ in range(3):
        assert call(p, [t]) == [t.greedy(3)]
        t.accept(0)


def test_rows_matched_by_content_partial_prefill_and_finished_requests(tiny_model):
    p, paged = make(tiny_model, compressor="int8", window=16)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (200,), generator=g).tolist()
    a = Target(p.rt, [1, 3], prompt, paged)
    b = Target(p.rt, [4, 6], torch.randint(0, 256, (150,), generator=g).tolist(), paged)
    out = call(p, [a, b])
    assert all(0 < len(o) <= K for o in out) and len(p.states) == 2
    sa = next(s for s in p.states if len(s.tokens) == len(a.tokens) - 1)
    out2 = call(p, [b, a])  # rows swapped: states follow the content
    assert len(out2[0]) == len(out2[1]) == K and any(s is sa for s in p.states)
    # A partial prefill (nothing sampled) gets no drafts; b finished: its state is dropped.
    rows = np.zeros((2, 1024), dtype=np.int32)
    rows[0, :len(a.tokens)] = a.tokens
    p._block_table = torch.stack([torch.tensor([1, 3]), torch.tensor([0, 0])])
    assert p.propose([[a.tokens[-1]], []], np.array([len(a.tokens), 64]), rows) == [out2[1], []]
    assert p.states == [sa]


def test_bytes_bound_counts_the_entries_a_dense_draft_cache_keeps(tiny_model):
    # int8 chunks are attended dequantized: a draft step reads every entry, so drafting can never
    # read fewer bytes than a plain step; StreamingLLM at 25% keeps a quarter of them.
    p, _ = make(tiny_model, compressor="int8", gate=True)
    assert p._kept_ratio(None) == 1.0
    p._weight_bytes = 10 ** 6
    kv = p.rt.kv_bytes_per_token()
    assert not p._may_pay([10 ** 8 // kv])  # KV far above the weights, but int8 keeps it all
    p, _ = make(tiny_model, compressor="streamingllm", compressor_params={"keep_ratio": 0.25}, gate=True)
    assert abs(p._kept_ratio(None) - 0.25) < 0.02
    p._weight_bytes = 10 ** 6
    assert p._may_pay([10 ** 8 // kv]) and not p._may_pay([10])  # KV-bound: may pay; weight-bound: not
