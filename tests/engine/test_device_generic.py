"""The engine off the CPU, tested without a GPU: the ``meta`` device takes the non-CPU branches (an op
mixing a meta tensor with a CPU one raises, a host read has no data), and the device-generic path
forced on CPU tensors must give the CPU path's tokens."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch
from engine_helpers import random_prompts
from torch.utils._python_dispatch import TorchDispatchMode

from lmcache_vericache.cli import main
from lmcache_vericache.engine import VeriCacheEngine, prefill, request, rounds, vericache_engine, verify
from lmcache_vericache.engine.pinned_pool import PinnedPool
from lmcache_vericache.engine.runtime import Runtime, Segment
from lmcache_vericache.models import tiny_llama

TRANSFERS = {"aten::copy_", "aten::_to_copy", "aten::_foreach_copy_", "aten::lift_fresh"}


class DeviceOps(TorchDispatchMode):
    """Counts aten ops (views apart: they launch nothing) and fails any op other than a transfer
    that reads a CPU tensor beside a meta one."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view:
            self.views += 1
        else:
            self.ops[func.name()] += 1
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        devices = {a.device.type for a in flat if a.dim() > 0}
        if {"meta", "cpu"} <= devices and func._schema.name not in TRANSFERS:
            raise AssertionError(f"{func} mixes a CPU tensor into the device path")
        return func(*args, **kwargs)

    @property
    def launches(self) -> int:
        return sum(self.ops.values())


def _decode_ops(layers: int, batch: int, batched: bool) -> DeviceOps:
    """Ops of one decode step (one token per request) at ``batch`` over 100-entry caches, on meta."""
    rt = Runtime(tiny_llama(num_hidden_layers=layers).to("meta"), batched=batched)
    segments = []
    for _ in range(batch):
        cache = rt.new_cache(128)
        cache.n = 100
        segments.append(Segment(cache, 1))
    with DeviceOps() as ops:
        rt.forward(torch.zeros(batch, dtype=torch.long), torch.arange(batch), segments)
    return ops


def test_decode_step_ops_are_bounded_per_layer():
    """Non-CPU attention is one call per layer for the batch: the ops of a batch-64 decode step grow
    with the layers (<= 45 each) plus a constant (<= 40), and not at all with the batch; the
    per-segment path (the CPU's) takes hundreds per layer at batch 64."""
    two, four = _decode_ops(2, 64, True), _decode_ops(4, 64, True)
    per_layer = (four.launches - two.launches) / 2
    constant = two.launches - 2 * per_layer
    assert per_layer <= 45 and constant <= 40, (per_layer, constant)
    assert _decode_ops(2, 8, True).launches == two.launches  # independent of the batch
    assert two.ops["aten::scaled_dot_product_attention"] == 2
    per_segment = _decode_ops(2, 64, False)
    assert per_segment.launches > 10 * two.launches, (per_segment.launches, two.launches)


@pytest.fixture
def host_reads(monkeypatch):
    """Host reads of device tensors, counted; on meta (no data) they read zeros: token 0 everywhere."""
    reads = []

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        reads.append(tuple(t.shape))
        return torch.zeros(t.shape, dtype=t.dtype)

    for mod in (verify, request, rounds, prefill, vericache_engine):
        monkeypatch.setattr(mod, "host", fake)
    return reads


def test_meta_engine_prefill_draft_verify(host_reads):
    """The engine on meta: prefill, draft steps and verify blocks of a batch run on the device path
    (no CPU tensor meets a device one) and read the host once per forward, not once per token."""
    model = tiny_llama().to("meta")
    eng = VeriCacheEngine(model, "streamingllm", store="resident", chunk_size=64, draft_len=4, model_id="meta-test",
                          device="meta")
    assert eng.rt.batched and eng.int8_draft is False
    forwards = []
    forward = eng.rt.forward
    eng.rt.forward = lambda *a, **k: forwards.append(1) or forward(*a, **k)
    prompts = random_prompts(3, [20, 33, 41])
    with DeviceOps() as ops:
        results = eng.generate(prompts, 11)
    # token 0 everywhere: the first from the prefill, then every draft accepted, 5 tokens a round
    assert [r.tokens for r in results] == [[0] * 11] * 3
    assert all(r.stats.rounds == 2 and r.stats.accepted == [4, 4] for r in results)
    assert ops.ops["aten::scaled_dot_product_attention"] > 0
    # per request at set-up: its observation-window queries and its first token; then one per forward
    assert len(host_reads) == len(forwards) + 3, (len(host_reads), len(forwards))
    eng.close()


@pytest.mark.parametrize("full_kv", ["resident", "offload"])
def test_device_generic_path_is_lossless_on_cpu(full_kv, one_thread):
    """The batched (non-CPU) attention forced on CPU tensors: generate's tokens equal reference()'s
    in the same path and the C++ kernel path's, over a compressed prefix, lock step and staggered."""
    prompts = random_prompts(3, [150, 200, 90])
    kernel = VeriCacheEngine(tiny_llama(), "streamingllm", {"keep_ratio": 0.3}, chunk_size=64, draft_len=4,
                             full_kv=full_kv)
    expected = [r.tokens for r in kernel.reference(prompts, 24)]
    kernel.close()
    eng = VeriCacheEngine(tiny_llama(), "streamingllm", {"keep_ratio": 0.3}, chunk_size=64, draft_len=4,
                          full_kv=full_kv)
    eng.rt.batched = True
    assert [r.tokens for r in eng.reference(prompts, 24)] == expected
    results = eng.generate(prompts, 24)
    assert [r.tokens for r in results] == expected
    assert sum(r.stats.rounds for r in results) > len(results)  # drafted and verified, not one round each
    eng.close()


def test_device_option_is_checked():
    model = tiny_llama()
    with pytest.raises(ValueError, match="model's weights are on cpu"):
        VeriCacheEngine(model, store="resident", device="meta")
    with pytest.raises(ValueError, match="device must be"):
        VeriCacheEngine(model, store="resident", device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            VeriCacheEngine(model, store="resident", device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_cli_device_cuda_without_cuda_fails_fast(capsys):
    t0 = time.perf_counter()
    assert main(["generate", "--device", "cuda"]) == 2
    assert time.perf_counter() - t0 < 1.0
    assert "--device cuda" in capsys.readouterr().err


class _Event:
    def __init__(self):
        self.done = False


def test_the_pinned_pool_lends_a_bounded_set_of_slabs_again_only_after_their_copy():
    """The one pinned pool (engine swaps, connector loads and saves): at most ``slabs`` lent; one given
    back with its copy's event is lent again only once that event completed."""
    pool = PinnedPool(64, 2, alloc=lambda n: torch.zeros(n, dtype=torch.uint8), ready=lambda e: e.done)
    a, b = pool.acquire(), pool.acquire()
    assert {a, b} == {0, 1} and pool.acquire(timeout=0.05) is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    event = _Event()
    pool.release(a, after=event)
    waiter.join(0.2)
    assert waiter.is_alive()  # a's copy still running: nothing lent
    event.done = True
    waiter.join(5)
    assert got == [a]
    pool.release(b)
    slab, view = pool.stage(torch.arange(6, dtype=torch.float32).view(2, 3))
    assert slab == b and view.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="does not fit"):
        pool.view(slab, (100,), torch.float32)
    with pytest.raises(TimeoutError):
        pool.stage(torch.zeros(2), timeout=0.01)
