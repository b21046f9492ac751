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
from lmcache_vericache.connectors.draft_budget import DeviceHold, DraftBudget
from lmcache_vericache.connectors.draft_sync import BlockTables
from lmcache_vericache.connectors.kv_layout import CpuBlockLayout
from lmcache_vericache.connectors.proposer import CompressedKVProposer
from lmcache_vericache.engine import Runtime
from lmcache_vericache.testing.paged_target import PagedTarget

pytest.importorskip("vllm._custom_ops")
K, B = 4, 128


@pytest.fixture(scope="module")
def tiny_model():
    from lmcache_vericache.models import tiny_llama

    return tiny_llama(seed=0, head_dim=32)  # vLLM's CPU attention supports head sizes of 32 and up


def Target(rt: Runtime, blocks: list[int], prompt: list[int], paged) -> PagedTarget:
    """The 'vLLM side' (``paged``: its layout strategy and the block size of the table's ids)."""
    return PagedTarget(rt, paged.layout, blocks, prompt, paged.block_size)


def cpu_paged(rt, blocks=12):
    """vLLM's CPU attention backend's caches (its tiles, 128-token blocks)."""
    caches = [torch.zeros(blocks, rt.num_kv_heads, B, 2 * rt.head_dim) for _ in range(rt.num_layers)]
    return SimpleNamespace(layout=CpuBlockLayout(caches, lambda: ["vec"] * len(caches)), block_size=B)


def cuda_paged(rt, kernel_block=16, vllm_block=64):
    """Caches as vLLM's GPU workers allocate them (``allocate_kv_cache``, here on CPU tensors) with
    kernel blocks smaller than vLLM's block: the table's ids are kernel blocks."""
    from lmcache_vericache.connectors.kv_layout import LogicalLayout
    from lmcache_vericache.testing.paged_caches import layout_caches

    caches = layout_caches("LBNHC", layers=rt.num_layers, heads=rt.num_kv_heads, head_size=rt.head_dim,
                           block_size=vllm_block, num_blocks=12, kernel_block=kernel_block)
    return SimpleNamespace(layout=LogicalLayout(caches), block_size=kernel_block)


def make(tiny_model, compressor="none", max_num_seqs=4, paged=cpu_paged, max_model_len=4096, **opts):
    # The adaptive horizon would choose plain steps where drafting measures slower (test_horizon_*
    # below); these tests are about the draft state: every step drafts max_draft tokens.
    opts = {"adaptive": False, **opts}
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                          model_config=SimpleNamespace(max_model_len=max_model_len),
                          scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                          additional_config={"vericache_proposer": {"compressor": compressor, **opts}})
    p = CompressedKVProposer(cfg)
    rt = Runtime(tiny_model)
    paged = paged(rt)
    p.table = np.zeros((4, 8), dtype=np.int32)  # vLLM's input batch block table, as the tests set it
    p.attach(rt, lambda: BlockTables(p.table, paged.block_size), paged.layout)
    return p, paged


def set_table(p, blocks):
    """The step's block table: row i holds blocks[i] (vLLM writes it before each forward)."""
    p.table = np.zeros((max(4, len(blocks)), 64), dtype=np.int32)
    for i, b in enumerate(blocks):
        p.table[i, :len(b)] = b


def call(p, targets):
    rows = np.zeros((4, 4096), dtype=np.int32)
    for i, t in enumerate(targets):
        rows[i, :len(t.tokens)] = t.tokens
    set_table(p, [t.blocks for t in targets])
    n = np.array([len(t.tokens) for t in targets] + [0] * (4 - len(targets)), dtype=np.int32)
    return p.propose([[t.tokens[-1]] for t in targets], n, rows)


@pytest.mark.parametrize("paged", [cpu_paged, cuda_paged], ids=["cpu_tiles", "cuda_kernel_blocks"])
def test_exact_drafts_and_state_kept_across_steps(tiny_model, paged):
    # With CUDA caches the table names 16-token kernel blocks of vLLM's 64-token blocks: slots in
    # vLLM's block size would read 4x too far.
    p, paged = make(tiny_model, paged=paged)
    blocks = [5, 2, 9, 0] if paged.block_size == B else list(range(20, 40))
    g = torch.Generator().manual_seed(0)
    t = Target(p.rt, blocks, torch.randint(0, 256, (300,), generator=g).tolist(), paged)
    assert call(p, [t]) == [t.greedy(K)]
    st = p.states.states[0]
    assert st.prefix == 256 and p.sync.stats.chunks == 2  # two complete 128-token chunks compressed
    for step in range(4):
        if step:  # vLLM accepted some drafts: same state continues, drafts stay exact
            t.accept(2)
            assert call(p, [t]) == [t.greedy(K)]
            assert p.states.states == [st]
        # The draft cache is the exact KV of every committed token read back from the paged cache.
        n = len(t.tokens) - 1
        assert st.cache.base == [256] * p.rt.num_layers and 256 + st.cache.n == n
        assert torch.equal(st.cache.k[:, :, :n], t.full.k[:, :, :n])
        assert torch.equal(st.cache.v[:, :, :n], t.full.v[:, :, :n])


@pytest.mark.parametrize("paged", [cpu_paged, cuda_paged], ids=["cpu_tiles", "cuda_kernel_blocks"])
def test_a_step_drafts_from_its_own_block_table(tiny_model, paged):
    # vLLM moved the request (preempted and rescheduled into other blocks, its KV recomputed there)
    # and reused its old blocks for garbage. A proposer that drafted from an earlier step's table
    # (the forward hook that a CUDA graph replay skips) would read the garbage.
    p, paged = make(tiny_model, paged=paged)
    old, new = ([1, 3, 5], [6, 7, 8]) if paged.block_size == B else (list(range(0, 20)), list(range(24, 44)))
    g = torch.Generator().manual_seed(5)
    t = Target(p.rt, old, torch.randint(0, 256, (300,), generator=g).tolist(), paged)
    assert call(p, [t]) == [t.greedy(K)]
    t.blocks = list(new)
    n = len(t.tokens) - 1
    slots_old = pl.slots_for(torch.tensor(old), 0, n, paged.block_size)
    paged.layout.scatter(pl.slots_for(torch.tensor(t.blocks), 0, n, paged.block_size), *paged.layout.gather(slots_old))
    every = pl.slots_for(torch.tensor(old), 0, len(old) * paged.block_size, paged.block_size)
    garbage = torch.full_like(t.full.k[:, :, :1], 1e4).expand(-1, -1, len(every), -1)
    paged.layout.scatter(every, garbage, garbage)
    t.accept(2)
    assert call(p, [t]) == [t.greedy(K)]


def test_fixed_draft_length_when_not_adaptive(tiny_model):
    p, paged = make(tiny_model, adaptive=False, max_draft=3)
    t = Target(p.rt, [3, 1, 0], list(range(40, 240)), paged)
    for _ in range(3):
        assert call(p, [t]) == [t.greedy(3)]
        t.accept(0)


def test_sampled_steps_are_priced_by_their_own_horizon(tiny_model):
    # vLLM verifies an all-greedy batch by argmax, any other by rejection sampling over the vocabulary
    # (seconds at 8k / batch 8 on a CPU): slow sampled verify steps must not price greedy ones.
    p, paged = make(tiny_model, adaptive=True)
    now = [0.0]
    for h in p.horizons.values():
        h.clock = lambda: now[0]
    greedy = [True]
    p.all_greedy = lambda: greedy[0]
    t = Target(p.rt, [3, 1, 0], list(range(40, 240)), paged)
    for regime, step_s in ((True, 0.1), (False, 5.0), (True, 0.1)):
        greedy[0] = regime
        for _ in range(4):
            d = call(p, [t])
            assert p.horizon is p.horizons[regime]
            now[0] += step_s  # vLLM's step after this propose
            t.accept(len(d[0]))
    fast, slow = p.horizons[True], p.horizons[False]
    fast_samples = list(fast.verify_step_s) + list(fast.plain_step_s)
    slow_samples = list(slow.verify_step_s) + list(slow.plain_step_s)
    assert fast_samples and max(fast_samples) < 1.0
    assert slow_samples and min(slow_samples) >= 5.0
    rounds = p.report()["horizon_rounds"]  # rounds per draft length chosen, per regime
    assert set(rounds) == {"greedy", "sampled"} and sum(rounds["sampled"].values()) >= 1


def test_rows_matched_by_content_partial_prefill_and_finished_requests(tiny_model):
    p, paged = make(tiny_model, compressor="int8", window=16)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (200,), generator=g).tolist()
    a = Target(p.rt, [1, 3], prompt, paged)
    b = Target(p.rt, [4, 6], torch.randint(0, 256, (150,), generator=g).tolist(), paged)
    out = call(p, [a, b])
    assert all(0 < len(o) <= K for o in out) and len(p.states.states) == 2
    sa = next(s for s in p.states.states if len(s.tokens) == len(a.tokens) - 1)
    out2 = call(p, [b, a])  # rows swapped: states follow the content
    assert len(out2[0]) == len(out2[1]) == K and any(s is sa for s in p.states.states)
    # A partial prefill (nothing sampled) gets no drafts; b finished: its state is dropped.
    rows = np.zeros((2, 1024), dtype=np.int32)
    rows[0, :len(a.tokens)] = a.tokens
    set_table(p, [[1, 3], [0, 0]])
    assert p.propose([[a.tokens[-1]], []], np.array([len(a.tokens), 64]), rows) == [out2[1], []]
    assert p.states.states == [sa]


def test_bytes_bound_counts_what_a_draft_step_reads(tiny_model):
    # int8 chunks attended dequantized read every entry: drafting can never read fewer bytes than a
    # plain step. Kept as codes (the CPU kernel, the default where it builds) they read ~a quarter of
    # fp32's bytes; StreamingLLM at 25% keeps a quarter of the entries.
    from lmcache_vericache.connectors.draft_states import may_pay

    kv = 10 ** 8
    p, _ = make(tiny_model, compressor="int8", int8_draft=False)
    assert p.caches_for(None).kind == "dense" and p.caches_for(None).read_ratio() == 1.0
    assert not may_pay(10 ** 6, kv, 1.0)  # KV far above the weights, but dense int8 keeps it all
    p, _ = make(tiny_model, compressor="int8")
    caches = p.caches_for(None)
    assert caches.kind == "int8" and 0.2 < caches.read_ratio() < 0.35  # 32 codes + a float32 scale per 128 bytes
    p, _ = make(tiny_model, compressor="streamingllm", compressor_params={"keep_ratio": 0.25})
    ratio = p.caches_for(None).read_ratio()
    assert abs(ratio - 0.25) < 0.02
    assert may_pay(10 ** 6, kv, ratio) and not may_pay(10 ** 6, 10, ratio)  # KV-bound: may pay; weight-bound: not


def test_auto_budget_fits_max_num_seqs_requests_at_the_compressors_size(tiny_model):
    # Per request: max_model_len tokens at the entries a layer keeps of a 128-token chunk, plus the
    # open chunk, window and draft room (dense), in whole chunks; K/V of 2 layers x 2 heads x 32 fp32.
    per_token = 2 * 2 * 2 * 32 * 4
    p, _ = make(tiny_model, compressor="streamingllm", compressor_params={"keep_ratio": 0.25}, max_num_seqs=3)
    assert p.opts.draft_cache_bytes == "auto" and p.rt.kv_bytes_per_token() == per_token
    # streamingllm keeps 32 of 128: 4096 * 32/128 = 1024 entries + 128 + 0 + 4 = 1156 -> 1280, and one
    # more cache's worth: a dense cache is copied whole while it grows.
    assert p.budget.limit == (3 + 1) * 1280 * per_token
    p, _ = make(tiny_model, compressor="int8", window=16, max_num_seqs=2, int8_draft=False)  # dense: every entry
    assert p.budget.limit == (2 + 1) * 4352 * per_token  # 4096 + 128 + 16 + 4 = 4244 -> 4352
    p, _ = make(tiny_model, compressor="int8", window=16, max_num_seqs=2)  # codes: their stored share, plus the suffix
    packed = int(np.ceil(4096 * p.caches_for(None).read_ratio()))
    growing = 256 + int(np.ceil(packed / 2))  # one cache's dense buffers and one of its 2 layers, held twice while it grows
    assert p.budget.limit == (2 * (256 + packed) + growing) * per_token  # 148 dense -> 256
    p, _ = make(tiny_model, draft_cache_bytes=12345)
    assert p.budget.limit == 12345


def test_auto_budget_lets_every_request_grow_to_max_model_len(tiny_model):
    # max_num_seqs requests near max_model_len, each taking a new chunk into its int8 prefix: the prefix
    # grows a layer at a time, so a growth holds one layer twice, not the whole prefix (vLLM at 8k /
    # batch 8 refused drafts to some of its requests when every growth was charged old + new).
    p, paged = make(tiny_model, compressor="int8", max_num_seqs=4, max_model_len=2100,
                    paged=lambda rt: cpu_paged(rt, blocks=68))
    assert p.caches_for(None).kind == "int8"
    g = torch.Generator().manual_seed(5)
    ts = [Target(p.rt, list(range(17 * j, 17 * j + 17)), torch.randint(0, 256, (2030,), generator=g).tolist(), paged)
          for j in range(4)]
    for _ in range(6):  # 2031 -> 2051 tokens: every request crosses 2048, a chunk boundary
        out = call(p, ts)
        assert [len(d) for d in out] == [K] * 4
        for t in ts:
            t.accept(K - 1)
    assert p.sync.stats.over_budget == 0 and p.sync.stats.chunks == 4 * 16
    assert p.budget.held <= p.budget.limit


def test_auto_budget_on_a_gpu_takes_at_most_a_share_of_vllms_memory():
    from lmcache_vericache.connectors.draft_budget import AUTO_DEVICE_SHARE, device_cap

    assert device_cap(torch.device("cpu"), 0.9) is None  # no reservation on a CPU: no cap
    cap = device_cap(torch.device("cuda"), 0.9, total=80 << 30)
    assert cap == int(AUTO_DEVICE_SHARE * 0.9 * (80 << 30))


def test_budget_admits_n_caches_refuses_the_next_and_takes_freed_bytes_back(tiny_model):
    # Each request: 200-token prompt -> one 128-token chunk + 71 exact + 4 drafts = 203 entries -> 256.
    cache_bytes = 256 * 2 * 2 * 2 * 32 * 4  # K/V of 2 layers x 2 heads x 32 fp32 per entry
    p, paged = make(tiny_model, draft_cache_bytes=2 * cache_bytes)
    g = torch.Generator().manual_seed(2)
    a, b, c = (Target(p.rt, [3 * j, 3 * j + 1], torch.randint(0, 256, (200,), generator=g).tolist(), paged)
               for j in range(3))
    out = call(p, [a, b, c])
    assert out[0] == a.greedy(K) and out[1] == b.greedy(K) and out[2] == []  # c's cache would pass the budget
    assert p.sync.stats.over_budget == 1 and p.budget.held == p.stats.cache_bytes == 2 * cache_bytes
    assert sorted(st.nbytes for st in p.states.states) == [0, cache_bytes, cache_bytes]
    assert all(st.cache.k.nbytes + st.cache.v.nbytes == st.nbytes for st in p.states.states)
    # a finished: its state is dropped and its bytes come back, so c is drafted now (exactly).
    out = call(p, [b, c])
    assert out == [b.greedy(K), c.greedy(K)] and p.sync.stats.over_budget == 1
    assert len(p.states.states) == 2 and p.budget.held == p.stats.cache_bytes == 2 * cache_bytes
    # Every request gone: every byte is back.
    set_table(p, [])
    assert p.propose([[]], np.array([0]), np.zeros((1, 8), dtype=np.int32)) == [[]]
    assert p.states.states == [] and p.budget.held == 0


def test_growth_counts_old_and_new_buffer_and_zero_budget_drafts_nothing(tiny_model):
    b = DraftBudget(100)
    assert b.grow(0, 60) and b.held == 60
    assert not b.grow(60, 50) and b.held == 60  # 60 + 50 exist at once during the copy
    assert b.grow(60, 70, copying=30) and b.held == 70  # only 30 of the old 60 copied at a time: 70 + 30
    assert not b.grow(70, 80, copying=30) and b.held == 70
    assert b.grow(70, 30) and b.held == 30  # shrinking copies the old one whole: 30 + 70
    b.give(30)
    assert b.held == 0
    p, paged = make(tiny_model, draft_cache_bytes=0)
    t = Target(p.rt, [1, 2], list(range(10, 150)), paged)
    assert call(p, [t]) == [[]] and call(p, [t]) == [[]] and p.sync.stats.over_budget == 2 and p.budget.held == 0


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
        DeviceHold(limit, allocate=alloc).take(device)
        assert alloc.calls == []
    p, paged = make(tiny_model, draft_cache_bytes=10 ** 6)
    hold, alloc = DeviceHold(10 ** 6, allocate=FakeDeviceAlloc()), None
    alloc = hold._allocate
    hold.take("cuda")
    hold.take("cuda")  # held once
    p.budget.on_charge = hold.release
    assert alloc.calls == [(10 ** 6, torch.uint8, torch.device("cuda"))] and hold.held == 10 ** 6
    t = Target(p.rt, [4, 5], list(range(20, 220)), paged)
    assert call(p, [t]) == [t.greedy(K)]
    assert hold.held == 0 and p.budget.held > 0  # released for the draft caches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reservation_is_device_memory():
    before = torch.cuda.mem_get_info()[0]
    hold = DeviceHold(256 << 20)
    hold.take("cuda")
    assert before - torch.cuda.mem_get_info()[0] >= 256 << 20
    b = DraftBudget(256 << 20, on_charge=hold.release)
    assert b.grow(0, 1) and hold.held == 0


def test_quiet_steps_give_finished_requests_bytes_back(tiny_model):
    p, paged = make(tiny_model, draft_cache_bytes=1 << 24)
    g = torch.Generator().manual_seed(4)
    a, b = (Target(p.rt, [2 * j, 2 * j + 1], torch.randint(0, 256, (200,), generator=g).tolist(), paged)
            for j in range(2))
    assert call(p, [a, b]) == [a.greedy(K), b.greedy(K)]
    st_a = next(st for st in p.states.states if st.tokens[0] == a.tokens[0])
    p.horizon.horizon.L = 0  # the horizon chose plain decoding for this step
    a.accept(1)
    assert call(p, [a]) == [[]]  # b finished; the step is quiet
    assert p.stats.quiet_steps == 1 and p.states.states == [st_a] and p.budget.held == st_a.nbytes > 0


def test_adaptive_proposer_is_quiet_where_the_bytes_bound_rules_drafting_out(tiny_model):
    p, paged = make(tiny_model, compressor="int8", adaptive=True)
    t = Target(p.rt, [1, 2], list(range(10, 150)), paged)
    p._weight_bytes = 10 ** 12  # weights dwarf the KV: a draft step reads about what a plain one does
    assert call(p, [t]) == [[]] and p.stats.quiet_steps == 1 and p.states.states == []
    p._weight_bytes = 1  # KV-bound: the horizon's first steps draft
    assert len(call(p, [t])[0]) == min(4, K) and p.stats.quiet_steps == 1
