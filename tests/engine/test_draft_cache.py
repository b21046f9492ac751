"""The draft cache protocol over every prefix kind, from one list (:data:`DRAFT_KINDS`): a new kind
gets every test. Each kind's caches come from :meth:`DraftCaches.choose` with its option forced, over
the same real chunks of a tiny model's KV; where this host cannot hold a kind (no Triton interpreter,
a kernel that did not build) its tests skip saying why."""

from __future__ import annotations

import pytest
import torch

from lmcache_vericache import compressors
from lmcache_vericache.engine import Runtime, Segment
from lmcache_vericache.engine.draft_cache import DRAFT_KINDS, DraftCaches, DraftPrefix

C, CHUNKS, TAIL = 32, 4, 5  # chunk size, chunks in the prefix, exact tokens after it

# kind -> (compressor, its params, DraftCaches.choose options)
CASES = {
    "dense": ("int8", {}, {"int8": False, "codebook": False, "triton": False}),
    "int8": ("int8", {}, {"int8": True}),
    "codebook": ("turboquant", {"k_bits": 4, "v_bits": 3}, {"codebook": True}),
    "chunked": ("int4", {}, {"triton": True}),
    "certified": ("poissoncomp", {}, {"kvfetch": {"epsilon": 0.05, "delta": 0.1, "sketch_bits": None}}),
}


def test_every_kind_has_a_case():
    assert set(CASES) == set(DRAFT_KINDS)


@pytest.fixture(scope="module")
def rt():
    from lmcache_vericache.models import tiny_llama

    return Runtime(tiny_llama(seed=3, head_dim=32))  # the CPU kernels take head sizes 16-128


@pytest.fixture(scope="module")
def prompt(rt):
    """A prompt's exact KV (a full cache) and its chunks in KV_2LTD."""
    g = torch.Generator().manual_seed(0)
    n = C * CHUNKS + TAIL
    tokens = torch.randint(0, 256, (n + 1,), generator=g)
    full = rt.new_cache(n + 16)
    rt.forward(tokens[:n], torch.arange(n), [Segment(full, n)])
    chunks = [full.to_2ltd(i * C, (i + 1) * C).contiguous() for i in range(CHUNKS)]
    return tokens, full, chunks


def caches_of(rt, kind) -> DraftCaches:
    name, params, opts = CASES[kind]
    try:
        caches = DraftCaches.choose(rt, compressors.get(name, **params), C, **opts)
    except ValueError as e:
        pytest.skip(f"{kind} draft caches cannot be made on this host: {e}")
    assert caches.kind == kind
    return caches


def laid_out(rt, kind, prompt, chunks: int = CHUNKS):
    """A draft cache of the first ``chunks`` chunks plus the exact tail, as the engine lays it out."""
    caches = caches_of(rt, kind)
    _, full, kv = prompt
    ckvs = [caches.compressor.compress(kv[i], rt.num_kv_heads, start=i * C) for i in range(chunks)]
    cache = caches.new()
    caches.append(cache, ckvs, room=(CHUNKS - chunks) * C + TAIL + 8, full=kv[:chunks] if kind == "certified" else None)
    cache.write_suffix(0, *full.suffix(chunks * C, CHUNKS * C + TAIL))
    cache.n = CHUNKS * C + TAIL - chunks * C
    return caches, cache, ckvs


@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_append_length_and_bytes(rt, prompt, kind):
    caches, cache, ckvs = laid_out(rt, kind, prompt)
    if kind == "dense":
        assert cache.packed is None and cache.base == [CHUNKS * C] * rt.num_layers
    else:
        assert isinstance(cache.packed, DraftPrefix) and cache.base == [0] * rt.num_layers
        assert all(cache.packed.length(li) == CHUNKS * C for li in range(rt.num_layers))
        assert cache.packed.nbytes > 0
    # One byte count: the dense buffers plus a prefix not held in an arena (charged on its own).
    dense = cache.capacity * rt.kv_bytes_per_token()
    owned = cache.packed is not None and not type(cache.packed).arena_backed
    assert caches.nbytes(cache) == dense + (cache.packed.nbytes if owned else 0)
    # What a draft step reads of a chunk, measured without touching a shared arena.
    before = caches.arena.capacity if caches.arena is not None else None
    assert 0 < caches.read_ratio() <= 1
    assert (caches.arena.capacity if caches.arena is not None else None) == before
    # One sizing rule: room for the chunks' dense entries and what follows them.
    assert caches.need(rt.new_cache(0), ckvs, TAIL) == (CHUNKS * C if kind == "dense" else 0) + TAIL


@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_clone_is_independent_and_release_empties(rt, prompt, kind):
    caches, cache, _ = laid_out(rt, kind, prompt, chunks=CHUNKS - 1)
    twin = cache.clone()
    _, _, kv = prompt
    more = [caches.compressor.compress(kv[-1], rt.num_kv_heads, start=(CHUNKS - 1) * C)]
    caches.append(twin, more, full=kv[-1:] if kind == "certified" else None)
    length = (lambda c: c.base[0]) if kind == "dense" else (lambda c: c.packed.length(0))
    assert length(cache) == (CHUNKS - 1) * C and length(twin) == CHUNKS * C
    twin.release()
    cache.release()


@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_draft_step_attends_its_prefix_like_the_decompressed_chunks(rt, prompt, kind):
    """A draft forward over each kind gives the logits of one over the chunks decompressed (the dense
    kind), up to the kernels' rounding; KVFetch (certified) reads full KV for the tokens it fetches,
    so it is held to the exact cache instead."""
    tokens, full, _ = prompt
    n = CHUNKS * C + TAIL
    _, cache, _ = laid_out(rt, kind, prompt)
    if kind == "certified":
        ref_cache = full.clone()
    else:
        ref_cache = laid_out(rt, "dense", prompt)[1] if kind != "dense" else full.clone()
    logits = []
    for c in (cache, ref_cache):
        out, _ = rt.forward(tokens[n:n + 1], torch.tensor([n]), [Segment(c, 1)])
        logits.append(out[0])
    if kind == "dense":  # int8 dequantized against exact KV: close, not equal
        assert torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=0) > 0.99
        return
    cos = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=0)
    assert cos > 0.999 if kind != "certified" else cos > 0.99, f"{kind}: cosine {cos:.5f}"


def test_chunked_kind_under_the_triton_interpreter():
    """The chunked kind's tests on the CPU, through Triton's interpreter (set before Triton is
    imported, hence a fresh process); on a CUDA host they ran above."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("ran in this process")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "chunked and not interpreter or warm_up"], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_chunked_warm_up_launches_every_split_variant(rt):
    """The kernel variants a chunked draft may launch (split counts up to the widest table, row
    blocks) run once at start-up; here through the interpreter on the CPU."""
    from lmcache_vericache.engine.chunk_prefix import warm_up

    caches = caches_of(rt, "chunked")
    assert warm_up(caches.arena, max_chunks=5, rows=(2, 64)) == 2 * 3  # splits 1, 2, 4
    assert caches.warm_up(4096) == 0  # off CUDA nothing is compiled
