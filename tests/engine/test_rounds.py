"""Round mechanics on the tiny model: commit/rollback leave caches equal to a fresh prefill, EOS and
max_new_tokens stop exactly, scheduling (adaptive L, staggering, lock step, n-gram stacking) changes
speed but never tokens, swap misses or corrupt full chunks in the store (real files, damaged in
place) fall back to recomputation, a failing store put keeps the prompt's rest resident, and an error
mid-generate leaves no swap running."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import random_prompts

from lmcache_vericache import compressors as C
from lmcache_vericache.backends import DiskTier, DualTierStore, MemoryTier, TierError, encode_full
from lmcache_vericache.backends.store import FULL_SUFFIX
from lmcache_vericache.engine import NgramProposer, Runtime, Segment, VeriCacheEngine
from lmcache_vericache.engine import rounds as engine_mod

pytestmark = pytest.mark.usefixtures("one_thread")
SL = ("streamingllm", {"keep_ratio": 0.25})  # evicts 3/4: plenty of rejections


def _eng(model, **kw):
    kw.setdefault("chunk_size", 64)
    kw.setdefault("draft_len", 6)
    if kw.get("store") != "resident":  # the swap path: a verify cache from the pool, refilled each round
        kw.setdefault("full_kv", "offload")
    name, params = kw.pop("method", SL)
    return VeriCacheEngine(model, name, params, **kw)


def test_caches_after_commit_equal_fresh_prefill(tiny_model):
    eng = _eng(tiny_model)
    rt, checked = Runtime(tiny_model), []
    comp = C.get(*SL[:1], **SL[1])

    def check(r):
        if r.done or r.stats.accepted[-1] == r.stats.drafted[-1]:
            return
        n = len(r.tokens) - 1  # caches hold tokens[:-1]
        assert r.full.n == n and r.draft.n == n - r.prefix
        fresh = rt.new_cache(n + 1)
        rt.forward(torch.tensor(r.tokens[:-1]), torch.arange(n), [Segment(fresh, n)])
        torch.testing.assert_close(r.full.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(r.full.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5, rtol=1e-4)
        # draft cache: compressed fresh chunks, then the exact suffix
        dk, dv = r.draft.suffix(0, n - r.prefix)
        torch.testing.assert_close(dk, fresh.k[:, :, r.prefix:n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(dv, fresh.v[:, :, r.prefix:n], atol=1e-5, rtol=1e-4)
        layers = comp.decompress(comp.compress(fresh.to_2ltd(0, 64), rt.num_kv_heads, start=0))
        torch.testing.assert_close(r.draft.k[0, :, :layers[0].keys.shape[1]], layers[0].keys, atol=1e-5, rtol=1e-4)
        checked.append(n)

    eng.generate(random_prompts(1, [300]), 60, on_round=check)
    assert len(checked) >= 2  # several rounds ended in a rejection and were checked


def test_max_new_tokens_exact_and_eos_stops(tiny_model):
    prompts = random_prompts(3, [200, 130, 257])
    eng = _eng(tiny_model, eos_ids=set())
    ref = eng.reference(prompts, 41)
    for n in [1, 2, 7, 41]:
        out = eng.generate(prompts, n)
        assert [len(o.tokens) for o in out] == [n] * 3
        assert [o.tokens for o in out] == [r.tokens[:n] for r in ref]
    eos = ref[0].tokens[17]  # a token the model really emits, as EOS
    cut = ref[0].tokens.index(eos) + 1
    out = _eng(tiny_model, eos_ids={eos}).generate(prompts[:1], 41)
    assert out[0].tokens == ref[0].tokens[:cut] and out[0].tokens[-1] == eos


@pytest.mark.parametrize("variant", [
    dict(draft_len="auto"), dict(draft_len=1), dict(draft_len=0), dict(stagger=False), dict(draft_len=12, stagger=True),
    dict(ngram=NgramProposer(max_ngram=3, num_tokens=5)), dict(store="resident"), dict(full_kv="resident"),
    dict(verify_buffers=1), dict(verify_buffers=1, draft_len="auto", stagger=False),
])
def test_scheduling_changes_speed_not_tokens(tiny_model, variant):
    prompts = random_prompts(4, [300, 200, 129, 64])
    prompts[1] = prompts[1][:100] * 2  # repetitive: the n-gram proposer finds matches
    ref = _eng(tiny_model).reference(prompts, 50)
    out = _eng(tiny_model, **variant).generate(prompts, 50)
    assert [o.tokens for o in out] == [r.tokens for r in ref]
    if "ngram" in variant:  # the proposer really supplied drafts: more drafts than draft forwards
        assert sum(out[1].stats.drafted) > out[1].stats.draft_steps


def test_adaptive_horizon_grows_on_full_acceptance(tiny_model):
    # int8 drafts are (nearly) exact: L doubles after the first, fully accepted round; from the
    # second block size on, the measured costs per block size pick L (test_horizon.py).
    # The swap's floor (L >= swap time / draft step while rounds swap) can only raise it: on a
    # loaded host a slow swap does.
    eng = _eng(tiny_model, method=("int8", {}), draft_len="auto", max_draft_len=32)
    [out] = eng.generate(random_prompts(1, [300]), 100)
    assert out.stats.drafted[0] == 4 and out.stats.accepted[0] == 4 and out.stats.drafted[1] >= 8


def test_lock_step_shares_one_horizon(tiny_model):
    """In lock step every request of the batch drafts the same L each round (one horizon, pooled
    acceptance): none waits idle for a longer round. Staggered, each request keeps its own. (Full KV
    resident: with offload's pool of verify caches the requests of a batch verify in turns.)"""
    prompts = random_prompts(4, [300, 200, 129, 64])
    ref = _eng(tiny_model, eos_ids=set()).reference(prompts, 60)

    def drafted_per_round(stagger):
        out = _eng(tiny_model, draft_len="auto", stagger=stagger, full_kv="resident", eos_ids=set()).generate(prompts, 60)
        assert [o.tokens for o in out] == [r.tokens for r in ref]
        rounds = min(len(o.stats.drafted) for o in out) - 1  # the last rounds are cut by max_new_tokens
        return [{o.stats.drafted[i] for o in out} for i in range(rounds)]

    lock, staggered, auto = drafted_per_round(False), drafted_per_round(True), drafted_per_round("auto")
    assert len(lock) >= 3 and all(len(s) == 1 for s in lock)
    assert any(len(s) > 1 for s in staggered)
    assert len(auto) >= 3 and all(len(s) == 1 for s in auto)  # resident: the default is lock step
    with pytest.raises(ValueError, match="stagger must be"):
        _eng(tiny_model, stagger="yes")
    with pytest.raises(ValueError, match="stagger must be"):
        _eng(tiny_model).generate(prompts, 4, stagger=1)


def test_auto_horizon_falls_back_to_plain_decoding_where_drafting_does_not_pay():
    """With ``plain_ok`` the rounds after the first drafting one without a swap are a plain trial
    (L = 0: verify the last token alone = plain decoding; ``plain_trial`` rounds), measured; then the
    measured rates decide (the mode in use stays unless the other measured ``switch_margin``
    faster), and each mode is re-measured now and then: drafting once plain rounds
    have run ``probe_ratio`` times as long as the last drafting round, plain once drafting has run
    ``probe_ratio`` times as long as a trial. Without ``plain_ok`` L never drops to 0. (L = 0
    rounds themselves are tested token-identical in test_scheduling_changes_speed_not_tokens.)"""
    from lmcache_vericache.engine.horizon import Horizon

    def first_round(plain_ok, step_s, settle_margin=1.25):
        h = Horizon("auto", max_len=32, plain_ok=plain_ok, probe_ratio=4, settle_margin=settle_margin)
        h.update_rounds([(8, 4)], 9.0, 5.0, 2.8)  # a round that swapped: its slow steps are no evidence
        assert h.L >= 1
        h.update_rounds([(8, 4)], step_s, 0.0, 2.8)  # 5 tokens in 8 steps + a 2.8 s verify
        assert h._step_s == step_s and h._draft_rate == 5 / (8 * step_s + 2.8)  # only the clean round counted
        return h

    h = first_round(True, step_s=1.0)  # 5 tokens in 10.8 s
    assert h.L == 0 and h._probe_len >= 1  # plain decoding is measured next
    for _ in range(35):  # 1 token per 1.2 s beats drafting's measured rate: plain until 4 x 10.8 s passed
        h.update_rounds([(0, 0)], 0.0, 0.0, 1.2)
        assert h.L == 0
    h.update_rounds([(0, 0)], 0.0, 0.0, 1.2)  # 43.2 s of plain rounds: draft again to re-measure
    assert h.L == h._probe_len >= 1
    h.update_rounds([(h.L, 1)], 1.0, 0.0, 2.0 + 0.2 * h.L)  # drafting still loses: plain again
    assert h.L == 0

    h = first_round(True, step_s=1.0)
    for _ in range(4):  # plain measured 3% faster (0.476 against 0.463 tok/s): within the switch margin
        h.update_rounds([(0, 0)], 0.0, 0.0, 2.1)
    assert h.L >= 1  # drafting, the mode in use, stays

    h = first_round(True, step_s=1.0)
    for v in (20.0, 1.2, 1.2):  # one slow plain step among fast ones: the median decides
        h.update_rounds([(0, 0)], 0.0, 0.0, v)
        assert h.L == 0
    h.update_rounds([(0, 0)], 0.0, 0.0, 1.2)
    assert h.L == 0  # plain chosen
    h = first_round(True, step_s=1.0)
    for _ in range(4):  # the trial measured plain slower than drafting:
        h.update_rounds([(0, 0)], 0.0, 0.0, 60.0)
    assert h.L >= 1  # back to drafting

    def modes(h):
        out = []
        for _ in range(16):
            if h.L == 0:
                h.update_rounds([(0, 0)], 0.0, 0.0, 1.2)
            else:
                h.update_rounds([(h.L, h.L)], 0.05, 0.0, 2.6 + 0.2 * (h.L + 1))
            out.append("D" if h.L else "P")  # the mode of the next round
        return "".join(out)

    # cheap drafts: 5 tokens in 3.2 s. Drafting wins: back to it after the 4-round trial; another
    # trial once drafting has run 4 x the trial's 4.8 s, and drafting again after it
    seen = modes(first_round(True, step_s=0.05, settle_margin=float("inf")))
    assert seen.startswith("PPPDDD") and "DPPPPD" in seen
    # drafting measured 1.56 tok/s, 1.9x plain's 0.83 in both first rounds of a trial: two settle it
    seen = modes(first_round(True, step_s=0.05))
    assert seen.startswith("PDDD") and "DPPD" in seen and "PPP" not in seen
    h = first_round(False, step_s=1.0)
    assert h.L >= 1


def test_the_swap_floor_on_L_lasts_only_while_rounds_swap():
    """L >= swap time / draft step hides a round's swap behind its drafting. With the full KV
    resident only the first round swaps (a stored prefix, once): later rounds drop that floor. In
    offload every round swaps and the floor stays."""
    from lmcache_vericache.engine.horizon import Horizon

    def run(later_swap_s):
        h = Horizon("auto", max_len=32)
        h.update_rounds([(8, 2)], 0.1, 2.0, 1.0)  # a 2 s swap behind 0.1 s draft steps: L >= 20
        assert h.L >= 20
        for n in (4, 8, 4):  # poor acceptance, a verify that grows with L
            h.update_rounds([(n, 1)], 0.1, later_swap_s, 0.5 + 0.1 * (n + 1))
        return h

    resident = run(0.0)
    assert resident.l_min == 1 and resident.L < 8
    offload = run(2.0)
    assert offload.l_min == 20 and offload.L >= 20


def test_horizons_measure_each_kind_of_forward_apart(tiny_model, monkeypatch):
    """A staggered forward can carry draft rows of some requests and verify rows of others: its time
    goes into the rounds' seconds, never into a horizon's draft-step or verify samples. In lock step
    every forward is of one kind, and the batch's horizon predicts each round it chose from them (on a
    clock that makes a draft forward 1 s, a verify 10 s and a mixed one 100 s: exactly)."""
    from lmcache_vericache.engine.horizon import Horizon

    kind, clock = {}, {"t": 0.0}

    def perf_counter():
        clock["t"] += kind["s"]  # read before and after each forward
        return clock["t"]

    real_step = engine_mod.Rounds.step

    def step(self, drafting, verifying):
        kind["s"] = 100.0 if drafting and verifying else 1.0 if drafting else 10.0
        return real_step(self, drafting, verifying)

    seen, real_update = [], Horizon.update_rounds

    def update_rounds(self, rounds, draft_step_s, swap_s, verify_s=0.0, round_s=None):
        seen.append((max(d for d, _ in rounds), draft_step_s, verify_s, round_s))
        return real_update(self, rounds, draft_step_s, swap_s, verify_s, round_s)

    monkeypatch.setattr(engine_mod, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(engine_mod.Rounds, "step", step)
    monkeypatch.setattr(Horizon, "update_rounds", update_rounds)
    prompts = random_prompts(4, [300, 200, 129, 64])
    _eng(tiny_model, draft_len="auto", stagger=True, full_kv="resident", eos_ids=set()).generate(prompts, 40)
    drafting = [x for x in seen if x[0] > 0]
    assert any(x[3] >= 100 for x in drafting)  # rounds that shared forwards with other kinds
    assert {x[1] for x in drafting} <= {0.0, 1.0} and {x[2] for x in drafting} <= {0.0, 10.0}
    assert any(x[1] == 1.0 for x in drafting) and any(x[2] == 10.0 for x in drafting)
    horizons = {}
    _eng(tiny_model, draft_len="auto", stagger=False, full_kv="resident", eos_ids=set()).generate(
        prompts, 40, on_round=lambda r: horizons.setdefault(id(r.horizon), r.horizon))
    [h] = horizons.values()
    assert [x.measured_s for x in h.record] == [10.0 + x.L for x in h.record]
    predicted = [x for x in h.record if x.predicted_s is not None]
    assert len(predicted) >= 3 and all(x.predicted_s == x.measured_s for x in predicted)


def test_plain_decoding_is_an_option_only_with_the_full_kv_resident(tiny_model):
    """The engine offers auto's L = 0 fallback only where no swap must hide behind drafting."""
    prompts = random_prompts(2, [200, 130])
    seen = {}
    for full_kv in ("resident", "offload"):
        _eng(tiny_model, draft_len="auto", full_kv=full_kv).generate(
            prompts, 12, on_round=lambda r, k=full_kv: seen.setdefault(k, set()).add(r.horizon.plain_ok))
    assert seen == {"resident": {True}, "offload": {False}}


def test_swap_misses_are_recomputed(tiny_model):
    """Full chunks gone from the store (deleted) or stored with the wrong length are misses: every
    round recomputes them and the tokens stay identical."""
    prompts = random_prompts(2, [400, 300])
    ref = _eng(tiny_model).reference(prompts, 40)
    store = DualTierStore(C.get(SL[0], **SL[1]), MemoryTier(1 << 30), num_kv_heads=Runtime(tiny_model).num_kv_heads)
    eng = _eng(tiny_model, store=store)
    assert eng.compressor is store.compressor  # one compressor: the store compresses, the engine decompresses
    first = eng.generate(prompts, 40)
    assert [o.tokens for o in first] == [r.tokens for r in ref]
    assert [o.stats.cached_chunks for o in first] == [0, 0] and store.stats.puts == 6 + 4
    for p in prompts:  # damage the stored prompt chunks: odd ones deleted, chunk 2 cut to 10 tokens
        for i, key in enumerate(eng.chunk_keys(p)):
            if i % 2:
                store.capacity.delete(key + FULL_SUFFIX)
            elif i == 2:
                store.capacity.put(key + FULL_SUFFIX, encode_full(store.get_full(key)[:, :, :10].clone()))
    out = eng.generate(prompts, 40)  # the prompts' prefixes now come from the store: cached path
    assert [o.tokens for o in out] == [r.tokens for r in ref]
    assert [o.stats.cached_chunks for o in out] == [(400 - 1) // 64, (300 - 1) // 64]
    # Recomputed once, then put back: later rounds swap them in again (chunks 1, 2, 3, 5 of 6 and
    # 1, 2, 3 of 4), and the store holds the exact chunks once more.
    assert out[0].stats.recomputed_chunks == 4 and out[1].stats.recomputed_chunks == 3
    assert out[0].stats.rounds > 1 and out[1].stats.rounds > 1
    fresh = DualTierStore(C.get(SL[0], **SL[1]), MemoryTier(1 << 30), num_kv_heads=Runtime(tiny_model).num_kv_heads)
    _eng(tiny_model, store=fresh).generate(prompts, 1)
    for p in prompts:
        for key in eng.chunk_keys(p):
            assert torch.equal(store.get_full(key), fresh.get_full(key))


def test_file_source_and_corruption(tiny_model, tmp_path):
    prompts = random_prompts(1, [300])
    ref = _eng(tiny_model).reference(prompts, 40)
    eng = _eng(tiny_model, store={"capacity": "disk", "disk_path": str(tmp_path)})
    assert isinstance(eng.store.capacity, DiskTier) and eng.compressor is eng.store.compressor
    [out] = eng.generate(prompts, 40)
    assert out.tokens == ref[0].tokens and out.stats.recomputed_chunks == 0
    assert out.stats.bytes_moved == out.stats.rounds * 256 * Runtime(tiny_model).kv_bytes_per_token()
    tier = eng.store.capacity
    for key in eng.chunk_keys(prompts[0])[:2]:  # flip a byte in two full-chunk files
        f = tier._file(key + FULL_SUFFIX)
        raw = bytearray(f.read_bytes())
        raw[-7] ^= 0x40
        f.write_bytes(bytes(raw))
    corrupt = eng.store.stats.corrupt
    [out] = eng.generate(prompts, 40)
    assert out.tokens == ref[0].tokens and out.stats.recomputed_chunks == 2
    assert out.stats.cached_chunks == 4  # second call: the prefix came from the store
    # counted once each, deleted, never verified against; recomputed once and rewritten
    assert eng.store.stats.corrupt - corrupt == 2
    assert all(eng.store.get_full(k) is not None for k in eng.chunk_keys(prompts[0]))
    assert eng.store.stats.corrupt - corrupt == 2


class _FailingTier(MemoryTier):
    """Memory tier that refuses every put after the first ``ok`` ones (a fault: a full disk, say)."""

    def __init__(self, max_bytes: int, ok: int):
        super().__init__(max_bytes)
        self.ok, self.puts = ok, 0

    def put(self, key, data):
        if self.puts >= self.ok:
            raise TierError(f"failing tier: put {key!r} refused after {self.ok} puts")
        self.puts += 1
        super().put(key, data)


def test_failed_put_keeps_the_rest_resident(tiny_model):
    """A put failing at prompt chunk 2 ends the stored prefix there: chunks 0-1 are swapped, the rest
    stays exact in both caches; tokens are unchanged and the failure is counted."""
    prompts = random_prompts(1, [400])
    ref = _eng(tiny_model).reference(prompts, 40)
    heads = Runtime(tiny_model).num_kv_heads
    store = DualTierStore(C.get(SL[0], **SL[1]), _FailingTier(1 << 30, ok=2 * 2), num_kv_heads=heads)  # 2 chunks
    eng = _eng(tiny_model, store=store)
    seen = []
    [out] = eng.generate(prompts, 40, on_round=lambda r: seen.append((r.prefix, len(r.keys))))
    assert out.tokens == ref[0].tokens
    assert seen and set(seen) == {(2 * 64, 2)}  # the request's stored prefix: 2 chunks, every round
    # the prompt's chunk 2, then once more when the first round tried to compress the exact suffix
    # (then never again: the request's KV past the stored prefix stays exact)
    assert store.stats.put_errors == 2 and store.stats.puts == 2
    assert out.stats.recomputed_chunks == 0
    assert out.stats.bytes_moved == out.stats.rounds * 2 * 64 * Runtime(tiny_model).kv_bytes_per_token()
    store.close()


class _SlowTier(MemoryTier):
    """Memory tier whose full-chunk reads take ``delay`` seconds (a slow capacity tier)."""

    def __init__(self, max_bytes: int, delay: float):
        super().__init__(max_bytes)
        self.delay = delay

    def get(self, key):
        if key.endswith(FULL_SUFFIX):
            time.sleep(self.delay)
        return super().get(key)


def test_a_cached_prompts_first_round_drafts_until_its_prefix_is_in(tiny_model):
    """Full KV resident, auto horizon: the first round of a prompt whose prefix comes from the store
    drafts on past its L (4) while the swap runs, up to max_draft_len, since its verify waits for the
    swap anyway; a fixed L stays as set. Tokens identical to plain decoding either way."""
    prompts = random_prompts(2, [200, 193])  # 3 chunks of 64 cached: tails of 8 tokens and of 1
    ref = _eng(tiny_model).reference(prompts, 40)
    for draft_len, first in (("auto", 12), (4, 4)):
        # 3 chunks a prompt, one read at a time, 0.2 s each: the swaps take 1.2 s, drafting milliseconds
        store = _slow_store(tiny_model, 0.2)
        _eng(tiny_model, store=store, full_kv="resident").generate(prompts, 1)  # puts the prompts' chunks
        eng = _eng(tiny_model, store=store, full_kv="resident", draft_len=draft_len, max_draft_len=12)
        out = eng.generate(prompts, 40)
        assert [o.tokens for o in out] == [r.tokens for r in ref]
        assert all(o.stats.cached_chunks == 3 and o.stats.drafted[0] == first for o in out), \
            [o.stats.drafted for o in out]
        store.close()


def _record_swaps(monkeypatch) -> list:
    """A spy on the rounds' SwapIn: the list of every swap the engine starts, in order."""
    swaps = []

    class RecordedSwapIn(engine_mod.SwapIn):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            swaps.append(self)

    monkeypatch.setattr(engine_mod, "SwapIn", RecordedSwapIn)
    return swaps


def _slow_store(model, delay: float) -> DualTierStore:
    """Full chunks read one at a time, ``delay`` seconds each (a slow capacity tier)."""
    heads = Runtime(model).num_kv_heads
    return DualTierStore(C.get(SL[0], **SL[1]), _SlowTier(1 << 30, delay), num_kv_heads=heads, max_concurrent_reads=1)


def test_a_cached_prompts_swap_starts_right_after_its_own_set_up(tiny_model, monkeypatch):
    """Full KV resident: each request's first round, and with it its prefix's swap, starts as soon as
    its own set-up is done, so the swap runs beside the later requests' set-ups; tokens identical."""
    prompts = random_prompts(3, [200, 200, 200])
    ref = _eng(tiny_model).reference(prompts, 30)
    store = _slow_store(tiny_model, 0.05)
    _eng(tiny_model, store=store, full_kv="resident").generate(prompts, 1)  # puts the prompts' chunks
    eng = _eng(tiny_model, store=store, full_kv="resident")
    swaps, seen = _record_swaps(monkeypatch), []
    real_setup = eng.admission.setup

    def setup(batch, i, *args, **kwargs):
        seen.append(len(swaps))  # swaps started before request i's set-up
        return real_setup(batch, i, *args, **kwargs)

    monkeypatch.setattr(eng.admission, "setup", setup)
    out = eng.generate(prompts, 30)
    assert seen == [0, 1, 2]  # (all three after the last set-up, before)
    assert [o.tokens for o in out] == [r.tokens for r in ref]
    assert all(o.stats.cached_chunks == 3 for o in out)
    store.close()


def test_a_twin_never_copies_a_full_cache_its_swap_is_writing(tiny_model, monkeypatch):
    """A repeated prompt is set up as a copy of its twin, but not the twin's full cache while that
    cache's prefix is still arriving (its swap writes it on another thread): the copy takes the
    twin's length and poisoned prefix and swaps its own. Tokens identical to plain decoding."""
    from lmcache_vericache.engine.cache import KVCache

    prompts = random_prompts(1, [200]) * 2
    ref = _eng(tiny_model).reference(prompts, 30)
    store = _slow_store(tiny_model, 0.1)  # a swap of 3 chunks takes 0.3 s: the twin's set-up comes first
    _eng(tiny_model, store=store, full_kv="resident").generate(prompts[:1], 1)
    eng = _eng(tiny_model, store=store, full_kv="resident")
    full_caches, cloned = set(), []  # the full caches of the requests set up so far; was each clone one?
    real_setup, real_clone = eng.admission.setup, KVCache.clone

    def setup(*args, **kwargs):
        r = real_setup(*args, **kwargs)
        full_caches.add(id(r.full))
        return r

    monkeypatch.setattr(eng.admission, "setup", setup)
    monkeypatch.setattr(KVCache, "clone", lambda self: cloned.append(id(self) in full_caches) or real_clone(self))
    out = eng.generate(prompts, 30)
    assert [o.tokens for o in out] == [r.tokens for r in ref]
    assert cloned and not any(cloned)  # the twin's draft cache was copied, no full cache
    assert all(o.stats.cached_chunks == 3 and o.stats.recomputed_chunks == 0 for o in out)
    store.close()


def test_a_failed_set_up_stops_the_swaps_of_those_before_it(tiny_model, monkeypatch):
    """The second request's set-up raising leaves no swap of the first running: generate stops it
    before the error reaches the caller (injected: a set-up that fails after another has started)."""
    prompts = random_prompts(2, [200, 200])
    store = _slow_store(tiny_model, 0.2)  # the first request's swap takes 0.6 s
    _eng(tiny_model, store=store, full_kv="resident").generate(prompts, 1)
    eng = _eng(tiny_model, store=store, full_kv="resident")
    swaps = _record_swaps(monkeypatch)
    real_setup = eng.admission.setup

    def setup(batch, i, *args, **kwargs):
        if i == 1:
            assert swaps and not swaps[0].done  # the first request's swap is running
            raise RuntimeError("set-up failed")
        return real_setup(batch, i, *args, **kwargs)

    monkeypatch.setattr(eng.admission, "setup", setup)
    with pytest.raises(RuntimeError, match="set-up failed"):
        eng.generate(prompts, 30)
    assert len(swaps) == 1 and swaps[0].done
    assert store.stats.cancelled > 0  # its pending reads were dropped, not waited for
    store.close()


def test_drafting_on_while_a_prefix_arrives_stops_where_it_must():
    """draft_while_swapping on its own: it extends an auto round by one draft at a time while the swap
    runs, never past an EOS, never while the batch decodes plainly (L = 0: a request admitted mid-run
    would hold everyone in drafting), never a fixed L or in offload; once the prefix is in, a tail of
    several tokens verifies at once and a 1-token tail keeps its L."""
    from lmcache_vericache.engine.horizon import Horizon

    def run(L=4, drafts=(5, 6, 7, 8), draft_len="auto", done=False, start=10, offload=False):
        h = Horizon(draft_len, max_len=12)
        h.L = L
        r = SimpleNamespace(prefix_missing=True, swap=SimpleNamespace(done=done), horizon=h, drafts=list(drafts),
                            limit=L, remaining=40, start=start, pos=10)
        rounds = engine_mod.Rounds(None, None, None, chunk_size=64, query_window=32, eos_ids={2}, ngram=None,
                                   verkv=False, sampling=None, res=SimpleNamespace(offload=offload),
                                   batch_horizon=None, on_round=None)  # only its scheduling state is read
        rounds.draft_while_swapping(r)
        return r.limit

    assert run() == 5 and run(drafts=range(11)) == 12 and run(drafts=range(12)) == 12  # max_len 12
    assert run(L=0, drafts=()) == 0  # plain decoding chosen
    assert run(drafts=(5, 6, 7, 2)) == 4  # an EOS ends the round
    assert run(draft_len=4) == 4 and run(offload=True) == 4
    assert run(done=True) == 4 and run(drafts=(5,), done=True) == 4  # a 1-token tail keeps its L
    assert run(drafts=(5,), done=True, start=8) == 1  # a longer tail verifies as soon as the prefix is in


def test_error_mid_generate_cancels_swaps(tiny_model, monkeypatch):
    """An exception raised mid-generate (here by on_round) propagates, and generate stops every
    in-flight swap first: no swap thread keeps reading the store or writing into a cache."""
    swaps = _record_swaps(monkeypatch)
    # 3 chunks a prompt, one read at a time, 0.2 s each: a swap takes 0.6 s, drafting milliseconds
    store = _slow_store(tiny_model, 0.2)
    eng = _eng(tiny_model, store=store)
    in_flight = []

    def fail_while_swapping(r):  # the first round to end while another request's swap runs fails
        running = [s for s in swaps if not s.done]
        if running:
            in_flight.extend(running)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        eng.generate(random_prompts(2, [200, 200]), 40, on_round=fail_while_swapping)
    assert in_flight  # the error came while another request's swap was still running
    assert all(s.done for s in swaps)  # every swap stopped before generate returned
    assert store.stats.cancelled > 0  # its pending reads were dropped, not waited for
    store.close()


def test_shared_prefix_from_the_store(tiny_model):
    """A second engine on the same store skips the prefill of the chunks it finds there; a batch
    whose second prompt shares the first one's prefix does too; another model never shares keys."""
    from lmcache_vericache.models import tiny_llama

    a = random_prompts(1, [300], seed=5)[0]
    b = a[:200] + random_prompts(1, [90], seed=6)[0]  # shares chunks 0-2 (192 tokens) with a
    ref = _eng(tiny_model).reference([a, b], 40)
    store = DualTierStore(C.get(SL[0], **SL[1]), MemoryTier(1 << 30), num_kv_heads=Runtime(tiny_model).num_kv_heads)
    [out_a] = _eng(tiny_model, store=store).generate([a], 40)
    keys = []  # stored chunks after each round: what the next round swaps in
    [out_b] = _eng(tiny_model, store=store).generate([b], 40, on_round=lambda r: keys.append(len(r.keys)))
    assert out_a.tokens == ref[0].tokens and out_b.tokens == ref[1].tokens
    assert out_a.stats.cached_chunks == 0 and out_b.stats.cached_chunks == 3
    assert out_b.stats.ttft_s > 0 and out_b.stats.recomputed_chunks == 0
    # the exact prefix was swapped in every round: the 3 cached chunks, then also the chunk the
    # tail and first tokens filled (compressed into the draft prefix and put into the store)
    assert out_b.stats.generated_chunks == 1 and keys[-1] == 4
    assert out_b.stats.bytes_moved == (3 + sum(keys[:-1])) * 64 * Runtime(tiny_model).kv_bytes_per_token()
    fresh = DualTierStore(C.get(SL[0], **SL[1]), MemoryTier(1 << 30), num_kv_heads=Runtime(tiny_model).num_kv_heads)
    both = _eng(tiny_model, store=fresh, draft_len="auto").generate([a, b], 40)
    assert [o.tokens for o in both] == [r.tokens for r in ref]
    assert [o.stats.cached_chunks for o in both] == [0, 3]
    other = tiny_llama(seed=1)
    [o] = _eng(other, store=store).generate([a], 5)
    assert o.stats.cached_chunks == 0 and _eng(other).chunk_keys(a) != _eng(tiny_model).chunk_keys(a)


def test_swap_is_really_used(tiny_model):
    """The verify buffer's prefix is poisoned after set-up; only the swap can make verification right."""
    prompts = random_prompts(1, [300])
    ref = _eng(tiny_model).reference(prompts, 30)
    [out] = _eng(tiny_model).generate(prompts, 30)
    assert out.tokens == ref[0].tokens
    assert out.stats.bytes_moved == out.stats.rounds * 256 * Runtime(tiny_model).kv_bytes_per_token()


def test_bad_input(tiny_model):
    eng = _eng(tiny_model)
    for prompts, n, err in [([], 5, "no prompts"), ([[]], 5, "empty"), ([1, 2, 999], 5, "outside"),
                            ([1, 2], 0, "max_new_tokens"), ([1, 2], 2.5, "max_new_tokens")]:
        with pytest.raises(ValueError, match=err):
            eng.generate(prompts, n)
    with pytest.raises(ValueError, match="draft_len"):
        eng.generate([1, 2], 3, draft_len="fast")
    with pytest.raises(ValueError, match="unknown compressor"):
        VeriCacheEngine(tiny_model, "nope")
    with pytest.raises(ValueError, match="store must be"):
        VeriCacheEngine(tiny_model, "int8", store="tape")
    with pytest.raises(ValueError, match="disk_path is required for capacity 'disk'"):
        VeriCacheEngine(tiny_model, "int8", store={"capacity": "disk"})
    with pytest.raises(ValueError, match="unknown key 'swap_dir'"):
        VeriCacheEngine(tiny_model, "int8", store={"swap_dir": "/tmp"})
    store = DualTierStore(C.get("int8"), MemoryTier(1 << 20), num_kv_heads=Runtime(tiny_model).num_kv_heads)
    with pytest.raises(ValueError, match="differs from the store"):
        VeriCacheEngine(tiny_model, "kivi", store=store)
    assert VeriCacheEngine(tiny_model, store=store).compressor is store.compressor
