"""``codec.validate``, rule by rule: what a chunk from untrusted bytes must satisfy before
``decompress`` may read it (the rules are listed in ``compressors/codec.py``)."""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_vericache import compressors as C
from lmcache_vericache.compressors import base, codec
from lmcache_vericache.compressors.base import CompressedKV

CASES = [
    pytest.param(name, params, id=f"{name}-{'-'.join(f'{k}={v}' for k, v in params.items()) or 'default'}")
    for name in C.available()
    for params in C.examples(name)
]
SHAPE, HEADS = (2, 2, 32, 16), 2


def make(name: str = "int8", params: dict | None = None, shape=SHAPE, heads: int = HEADS,
         dtype: torch.dtype = torch.float32, start: int = 0, seed: int = 0) -> CompressedKV:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(*shape, generator=g).to(dtype)
    ckv = C.get(name, **(params or {})).compress(kv, heads, start=start)
    ckv.buffers = {k: v.clone() for k, v in ckv.buffers.items()}  # writable, ours
    return ckv


def edit_header(ckv: CompressedKV, **fields) -> bytes:
    """``ckv``'s bytes with header fields replaced, re-framed with a valid digest."""
    header, payload = codec.unframe(C.to_bytes(ckv))
    header.update(fields)
    return codec.frame(header, payload)


def rejected(x: CompressedKV | bytes, match: str, **kw) -> None:
    with pytest.raises(C.CodecError, match=match):
        C.validate(C.from_bytes(x) if isinstance(x, bytes) else x, **kw)


# -- valid chunks pass --------------------------------------------------------------------------

@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_method_passes_at_the_matrix_shape(name, params, dtype):
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 3, 256, 3 * 64, generator=g).to(dtype)
    queries = torch.randn(3, 9, 8, 64, generator=g)
    ckv = C.get(name, **params).compress(kv, 3, start=512, queries=queries)
    C.validate(ckv)
    C.validate(C.from_bytes(C.to_bytes(ckv)))


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("shape,heads", [((2, 1, 1, 8), 1), ((2, 5, 37, 24), 3), ((2, 2, 200, 32), 1)])
def test_every_method_passes_at_odd_shapes(name, params, shape, heads):
    """Derived layouts and kept counts match what compress writes (PyramidKV's per-layer
    budgets, KIVI's partial groups, PoissonComp's random counts, ...)."""
    try:
        ckv = make(name, params, shape=shape, heads=heads, start=3)
    except ValueError:
        pytest.skip("the method does not take this shape")
    C.validate(C.from_bytes(C.to_bytes(ckv)))


def test_compose_with_a_data_dependent_evictor_passes():
    for seed in range(5):
        ckv = make("compose", {"evict": "poissoncomp", "quant": "kivi", "quant_params": {"bits": 2, "residual": 0,
                                                                                       "group_size": 4}},
                   shape=(2, 3, 64, 16), seed=seed)
        C.validate(C.from_bytes(C.to_bytes(ckv)))


# -- size caps ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["none", "kivi", "streamingllm", "turboquant"])
def test_a_header_declaring_2_27_tokens_is_rejected_fast(name):
    blob = edit_header(make(name), shape=[2, 2, 2**27, 16])
    t0 = time.perf_counter()
    rejected(blob, "exceeds the cap")
    rejected(blob, "over 64x", max_full_bytes=2**62)
    assert time.perf_counter() - t0 < 0.05


def test_the_full_size_cap_is_a_parameter():
    ckv = make()
    C.validate(ckv, max_full_bytes=ckv.full_nbytes)
    rejected(ckv, "exceeds the cap", max_full_bytes=ckv.full_nbytes - 1)
    assert codec.MAX_FULL_BYTES == 1 << 30


def test_more_than_max_ratio_compression_is_refused_on_both_sides():
    ckv = make("streamingllm", {"keep_ratio": 1 / 128}, shape=(2, 1, 256, 64), heads=1)
    assert ckv.ratio > codec.MAX_RATIO
    rejected(ckv, "over 64x")
    with pytest.raises(C.CodecError, match="over 64x"):
        C.to_bytes(ckv)


def test_examples_stay_well_under_the_ratio_cap():
    """MAX_RATIO's margin: the examples compress at most ~25x (fp32), at any shape."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 4, 256, 256, generator=g)
    worst = max(C.get(n, **p).compress(kv, 4).ratio for n in C.available() for p in C.examples(n))
    assert 20 < worst < codec.MAX_RATIO / 2


# -- header fields --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,match", [
    ({"method": "nope"}, "unknown method"),
    ({"method": 3}, "unknown method"),
    ({"method": "streamingllm"}, "positions must be int32"),
    ({"params": None}, "params must be a map"),
    ({"params": {"bogus": 1}}, "bad parameters.*bogus"),
    ({"params": {"seed": "x"}}, "bad parameters"),
    ({"shape": [2, 2, 32]}, "4 non-negative ints"),
    ({"shape": [2, -2, 32, 16]}, "4 non-negative ints"),
    ({"shape": [2, True, 32, 16]}, "4 non-negative ints"),
    ({"shape": [2, 2.0, 32, 16]}, "4 non-negative ints"),
    ({"shape": [3, 2, 32, 16]}, "first dimension must be 2"),
    ({"shape": [2, codec.MAX_LAYERS + 1, 1, 2]}, "MAX_LAYERS"),
    ({"heads": 0}, "heads must be"),
    ({"heads": 3}, "heads must be"),
    ({"heads": True}, "heads must be"),
    ({"heads": "2"}, "heads must be"),
    ({"dtype": "int8"}, "dtype must be"),
    ({"dtype": "float64"}, "dtype must be"),
    ({"dtype": "float8_e4m3fn"}, "dtype must be"),
    ({"start": -1}, "start must be"),
    ({"start": 2**63 - 1}, "start must be"),
    ({"start": 0.5}, "start must be"),
    ({"start": None}, "start must be"),
])
def test_bad_header_fields_are_rejected(fields, match):
    rejected(edit_header(make("turboquant" if "seed" in str(fields) else "int8"), **fields), match)


def test_header_edits_that_keep_meaning_pass():
    ckv = make()
    C.validate(C.from_bytes(edit_header(ckv, start=10**12)))  # a later chunk of a long prefix
    header, payload = codec.unframe(C.to_bytes(ckv))
    swapped = [[{"L0.kq": "L0.vq", "L0.vq": "L0.kq"}.get(e[0], e[0]), *e[1:]] for e in header["buffers"]]
    C.validate(C.from_bytes(codec.frame({**header, "buffers": swapped}, payload)))  # keys <-> values


# -- buffers --------------------------------------------------------------------------------------

def _edited(ckv: CompressedKV, edit) -> CompressedKV:
    edit(ckv.buffers)
    return ckv


@pytest.mark.parametrize("edit,match", [
    (lambda b: b.pop("L1.ks"), r"layer 1: buffers"),
    (lambda b: b.update({"L0.junk": torch.zeros(4)}), r"layer 0: buffers"),
    (lambda b: b.update({"junk": torch.zeros(4)}), "unexpected buffer 'junk'"),
    (lambda b: b.update({"L2.kq": b["L0.kq"]}), "unexpected buffer 'L2.kq'"),
    (lambda b: b.update({"L00.kq": b.pop("L0.kq")}), "unexpected buffer 'L00.kq'"),
    (lambda b: b.update({"L0.pos": torch.zeros(2, 32, dtype=torch.int32)}), r"layer 0: buffers"),
    (lambda b: b.update({"L0.ks": b["L0.ks"].float()}), r"L0.ks: torch.float32"),
    (lambda b: b.update({"L0.kq": b["L0.kq"].reshape(2, 8, 32)}), r"L0.kq: torch.int8 \(2, 8, 32\)"),
    (lambda b: b.update({"L0.kq": b["L0.kq"][:, :16].contiguous()}), r"L0.kq: torch.int8 \(2, 16, 8\)"),
    (lambda b: b.update({"L0.kq": b["L0.kq"].transpose(0, 1).contiguous().transpose(0, 1)}), "not a contiguous"),
    (lambda b: b.update({3: b["L0.kq"]}), "not a str name"),
    (lambda b: b.update({"L0.kq": b"abc"}), "not a str name and a tensor"),
])
def test_buffers_must_be_exactly_the_methods(edit, match):
    rejected(_edited(make("int8"), edit), match)


def test_buffers_must_be_exactly_the_methods_from_bytes_too():
    ckv = make("kivi", {"bits": 2, "residual": 0, "group_size": 16})
    header, payload = codec.unframe(C.to_bytes(ckv))
    for i, e in enumerate(header["buffers"]):
        if e[0] == "L1.kq":  # same bytes, another shape: only the layout check sees it
            header["buffers"][i] = [e[0], "uint8", [1, e[4]], e[3], e[4]]
    rejected(codec.frame(header, payload), r"L1.kq: torch.uint8 \(1, ")


def test_kept_count_must_be_the_methods():
    ckv = make("streamingllm", {"keep_ratio": 0.5})
    for name in ("L1.pos", "L1.k", "L1.v"):  # one token fewer, consistently
        ckv.buffers[name] = ckv.buffers[name][:, 1:].contiguous()
    rejected(ckv, "layer 1: 15 kept tokens where the method keeps 16")


@pytest.mark.parametrize("name", ["streamingllm", "snapkv", "h2o", "pyramidkv", "kvzip", "poissoncomp", "compose"])
@pytest.mark.parametrize("bad,match", [
    (lambda p: p.__setitem__((0, -1), 32), r"span \[\d+, 32\], outside the chunk's \[0, 32\)"),
    (lambda p: p.__setitem__((1, 0), -1), r"span \[-1, \d+\]"),
    (lambda p: p.__setitem__((0, 1), p[0, 0].item()), "not strictly ascending"),
    (lambda p: p.copy_(p.flip(-1)), "not strictly ascending"),
])
def test_positions_must_be_in_the_chunk_and_ascending(name, bad, match):
    ckv = make(name, C.examples(name)[0])
    bad(ckv.buffers["L0.pos"])
    rejected(ckv, match)


def test_poissoncomp_counts_are_bounded_and_the_sample_is_consistent():
    ckv = make("poissoncomp", {"keep_ratio": 0.25})
    C.validate(ckv)
    for name in ("L0.pos", "L0.k", "L0.v", "L0.in"):  # none: not one
        ckv.buffers[name] = ckv.buffers[name][:, :0].contiguous()
    rejected(ckv, "0 kept tokens, not within 1..32")
    other = make("poissoncomp", {"keep_ratio": 0.25})
    other.buffers["L1.in"] = other.buffers["L1.in"][:, :-1].contiguous()
    rejected(other, "buffer L1.in")
    sure = make("poissoncomp", {"keep_ratio": 0.25})
    sure.buffers["L0.in"].zero_()  # the sinks and local tokens (r = 1) are no longer in the sample
    rejected(sure, "kept for sure")


@pytest.mark.parametrize("name,params,buffer", [
    ("int8", {}, "L0.ks"), ("fp8", {}, "L1.vs"), ("int4", {}, "L0.kmin"), ("int4", {}, "L1.vscale"),
    ("kivi", {"residual": 0, "group_size": 16}, "L0.kscale"), ("kivi", {"residual": 0, "group_size": 16}, "L0.vmin"),
    ("rotatekv", {}, "L1.kscale"), ("turboquant", {}, "L0.knorm"), ("turboquant", {}, "L1.vnorm"),
    ("compose", {"evict": "streamingllm", "quant": "int4"}, "L1.kscale"),
])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_scales_must_be_finite(name, params, buffer, value):
    ckv = make(name, params)
    ckv.buffers[buffer].view(-1)[3] = value
    rejected(ckv, f"buffer '{buffer.split('.')[1]}' holds non-finite values")


# -- per-method hooks -----------------------------------------------------------------------------

@pytest.mark.parametrize("params", C.examples("turboquant"))
@pytest.mark.parametrize("shape", [(2, 5, 8), (1, 32, 64), (3, 7, 24), (2, 0, 16)])
def test_turboquant_computed_layout_is_what_encode_writes(params, shape):
    q = C.get("turboquant", **params)
    z = torch.zeros(shape)
    assert q.layout(shape, torch.float32) == {k: (b.dtype, tuple(b.shape)) for k, b in q.encode(z, z).items()}


@pytest.mark.parametrize("name", ["turboquant", "rotatekv"])
def test_rotation_methods_refuse_huge_head_dims_fast(name):
    with pytest.raises(ValueError, match="head_dim"):
        C.get(name).compress(torch.zeros(2, 1, 1, 2048), 1)
    ckv = CompressedKV(name, C.get(name).params(), (2, 1, 1, 2048), 1, torch.float16, 0,
                       {"L0.kq": torch.zeros(200, dtype=torch.uint8)})
    t0 = time.perf_counter()
    rejected(ckv, "head_dim <= 1024")
    assert time.perf_counter() - t0 < 0.05


def test_turboquant_seed_must_fit_a_torch_seed():
    with pytest.raises(ValueError, match="seed"):
        C.get("turboquant", seed=2**64 - 1)
    with pytest.raises(ValueError, match="bits"):
        C.get("turboquant", bits=2.0)


def test_layout_cache_is_bounded():
    for t in range(1, base._LAYOUTS._size + 50):
        ckv = CompressedKV("int8", {}, (2, 1, t, 1), 1, torch.float16, 0,
                           {"L0.kq": torch.zeros(1, t, 1, dtype=torch.int8),
                            "L0.vq": torch.zeros(1, t, 1, dtype=torch.int8),
                            "L0.ks": torch.ones(1, t, 1, dtype=torch.float16),
                            "L0.vs": torch.ones(1, t, 1, dtype=torch.float16)})
        C.validate(ckv)
    assert len(base._LAYOUTS._data) <= base._LAYOUTS._size


# -- framing --------------------------------------------------------------------------------------

def test_frame_and_unframe_are_inverse():
    ckv = make("kivi")
    blob = C.to_bytes(ckv)
    header, payload = codec.unframe(blob)
    assert header["method"] == "kivi" and header["shape"] == list(SHAPE)
    assert codec.frame(header, payload) == blob


@pytest.mark.parametrize("edit,match", [
    (lambda e: e.append(list(e[0])), "listed twice"),
    (lambda e: e[0].__setitem__(0, 5), "not a str"),
    (lambda e: e[0].__setitem__(2, [-1, -8]), "non-negative ints"),
    (lambda e: e[0].__setitem__(2, [True, 64]), "non-negative ints"),
    (lambda e: e[0].__setitem__(3, 1.0), "outside the payload"),
    (lambda e: e.__setitem__(0, e[0][:4]), "not \\[name, dtype, shape, offset, nbytes\\]"),
])
def test_from_bytes_rejects_malformed_buffer_entries(edit, match):
    header, payload = codec.unframe(C.to_bytes(make()))
    edit(header["buffers"])
    with pytest.raises(C.CodecError, match=match):
        C.from_bytes(codec.frame(header, payload))
