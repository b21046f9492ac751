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
from lmcache_vericache.connectors.draft_budget import DraftBudget
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


def make(tiny_model, compressor="none", max_num_seqs=4, **opts):
    # The pay gate would keep the first steps quiet (it measures plain steps first); these tests are
    # about the draft state, test_pay_gate.py about the gate.
    opts = {"gate": False, **opts}
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                          model_config=SimpleNamespace(max_model_len=4096),
                          scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
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
    assert p.prefixes.kept_ratio(None) == 1.0
    p._weight_bytes = 10 ** 6
    kv = p.rt.kv_bytes_per_token()
    assert not p._may_pay([10 ** 8 // kv])  # KV far above the weights, but int8 keeps it all
    p, _ = make(tiny_model, compressor="streamingllm", compressor_params={"keep_ratio": 0.25}, gate=True)
    assert abs(p.prefixes.kept_ratio(None) - 0.25) < 0.02
    p._weight_bytes = 10 ** 6
    assert p._may_pay([10 ** 8 // kv]) and not p._may_pay([10])  # KV-bound: may pay; weight-bound: not


def test_auto_budget_fits_max_num_seqs_requests_at_the_compressors_size(tiny_model):
    # Per request: max_model_len tokens at the entries a layer keeps of a 128-token chunk, plus the
    # open chunk, window and draft room (dense), in whole chunks; K/V of 2 layers x 2 heads x 32 fp32.
    per_token = 2 * 2 * 2 * 32 * 4
    p, _ = make(tiny_model, compressor="streamingllm", compressor_params={"keep_ratio": 0.25}, max_num_seqs=3)
    assert p.opts.draft_cache_bytes == "auto" and p.rt.kv_bytes_per_token() == per_token
    # streamingllm keeps 32 of 128: 4096 * 32/128 = 1024 entries + 128 + 0 + 4 = 1156 -> 1280.
    assert p._new_budget().limit == 3 * 1280 * per_token
    p, _ = make(tiny_model, compressor="int8", window=16, max_num_seqs=2)  # a quantizer keeps every entry
    assert p._new_budget().limit == 2 * 4352 * per_token  # 4096 + 128 + 16 + 4 = 4244 -> 4352
    p, _ = make(tiny_model, draft_cache_bytes=12345)
    assert p._new_budget().limit == 12345


def test_auto_budget_on_a_gpu_takes_at_most_a_share_of_vllms_memory():
    from lmcache_vericache.connectors.draft_budget import AUTO_DEVICE_SHARE, auto_bytes, device_cap

    assert device_cap(torch.device("cpu"), 0.9) is None  # no reservation on a CPU: no cap
    cap = device_cap(torch.device("cuda"), 0.9, total=80 << 30)
    assert cap == int(AUTO_DEVICE_SHARE * 0.9 * (80 << 30))
    need = auto_bytes(256, 8192, [128] * 30, 128, 140, 23040)  # 256 dense 8k caches: ~50 GB
    assert need > cap and auto_bytes(256, 8192, [128] * 30, 128, 140, 23040, cap) == cap
    assert auto_bytes(1, 1024, [128], 128, 140, 100, cap) < cap  # small needs are not raised to it


def test_budget_admits_n_caches_refuses_the_next_and_takes_freed_bytes_back(tiny_model):
    # Each request: 200-token prompt -> one 128-token chunk + 71 exact + 4 drafts = 203 entries -> 256.
    cache_bytes = 256 * 2 * 2 * 2 * 32 * 4  # K/V of 2 layers x 2 heads x 32 fp32 per entry
    p, paged = make(tiny_model, draft_cache_bytes=2 * cache_bytes)
    g = torch.Generator().manual_seed(2)
    a, b, c = (Target(p.rt, [3 * j, 3 * j + 1], torch.randint(0, 256, (200,), generator=g).tolist(), paged)
               for j in range(3))
    out = call(p, [a, b, c])
    assert out[0] == a.greedy(K) and out[1] == b.greedy(K) and out[2] == []  # c's cache would pass the budget
    assert p.stats.over_budget == 1 and p.budget.held == p.stats.cache_bytes == 2 * cache_bytes
    assert sorted(st.nbytes for st in p.states) == [0, cache_bytes, cache_bytes]
    assert all(st.cache.k.nbytes + st.cache.v.nbytes == st.nbytes for st in p.states)
    # a finished: its state is dropped and its bytes come back, so c is drafted now (exactly).
    out = call(p, [b, c])
    assert out == [b.greedy(K), c.greedy(K)] and p.stats.over_budget == 1
    assert len(p.states) == 2 and p.budget.held == p.stats.cache_bytes == 2 * cache_bytes
    # Every request gone: every byte is back.
    p._block_table = torch.zeros(1, 8, dtype=torch.int64)
    assert p.propose([[]], np.array([0]), np.zeros((1, 8), dtype=np.int32)) == [[]]
    assert p.states == [] and p.budget.held == 0


def test_growth_counts_old_and_new_buffer_and_zero_budget_drafts_nothing(tiny_model):
    b = DraftBudget(100)
    assert b.grow(0, 60) and b.held == 60
    assert not b.grow(60, 50) and b.held == 60  # 60 + 50 exist at once during the copy
    assert b.grow(60, 40) and b.held == 40
    b.give(40)
    assert b.held == 0
    p, paged = make(tiny_model, draft_cache_bytes=0)
    t = Target(p.rt, [1, 2], list(range(10, 150)), paged)
    assert call(p, [t]) == [[]] and call(p, [t]) == [[]] and p.stats.over_budget == 2 and p.budget.held == 0


class FakeDeviceAlloc:
    """Stands in for a CUDA allocation (no GPU here): records the call, returns a meta tensor."""

    def __init__(self):
        self.calls = []

    def __call__(self, n, *, dtype, device):
        self.calls.append((n, dtype, device))
        return torch.empty(n, dtype=dtype, device="meta")


def test_cuda_reservation_held_until_the_first_draft_cache_is_charged(tiny_model):
    for device, limit in (("cpu", 1000), ("cuda", 0)):  # CPU: accounting only; nothing to hold
        alloc = FakeDeviceAlloc()
        DraftBudget(limit).reserve_device(device, allocate=alloc)
        assert alloc.calls == []
    p, paged = make(tiny_model, draft_cache_bytes=10 ** 6)
    p.budget, alloc = p._new_budget(), FakeDeviceAlloc()
    p.budget.reserve_device("cuda", allocate=alloc)
    p.budget.reserve_device("cuda", allocate=alloc)  # held once
    assert alloc.calls == [(10 ** 6, torch.uint8, torch.device("cuda"))] and p.budget.reserved == 10 ** 6
    t = Target(p.rt, [4, 5], list(range(20, 220)), paged)
    assert call(p, [t]) == [t.greedy(K)]
    assert p.budget.reserved == 0 and p.budget.held > 0  # released for the draft caches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reservation_is_device_memory():
    before = torch.cuda.mem_get_info()[0]
    b = DraftBudget(256 << 20)
    b.reserve_device("cuda")
    assert before - torch.cuda.mem_get_info()[0] >= 256 << 20
    assert b.grow(0, 1) and b.reserved == 0


def test_quiet_steps_give_finished_requests_bytes_back(tiny_model):
    from lmcache_vericache.connectors.pay_gate import PayGate

    p, paged = make(tiny_model, draft_cache_bytes=1 << 24)
    g = torch.Generator().manual_seed(4)
    a, b = (Target(p.rt, [2 * j, 2 * j + 1], torch.randint(0, 256, (200,), generator=g).tolist(), paged)
            for j in range(2))
    assert call(p, [a, b]) == [a.greedy(K), b.greedy(K)]
    st_a = next(st for st in p.states if st.tokens[0] == a.tokens[0])
    p.gate, p._weight_bytes = PayGate(max_step_tokens=K + 1), None  # the gate's first steps are quiet
    a.accept(1)
    assert call(p, [a]) == [[]]  # b finished; the step is quiet
    assert p.stats.gated_steps == 1 and p.states == [st_a] and p.budget.held == st_a.nbytes > 0
