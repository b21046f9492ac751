"""Fuzzing the read path of untrusted chunks: for any bytes, ``from_bytes`` + ``validate`` raise
``CodecError``, or ``decompress`` succeeds and returns what the header promises, within the size
bound. 11,000 mutated chunks (fixed seeds) over every registered method at every example
parameter set: raw byte edits, byte edits with a recomputed digest, header edits re-framed with a
valid digest, and value edits re-serialized with ``to_bytes``.
"""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch

from lmcache_vericache import compressors as C
from lmcache_vericache.compressors import codec

SHAPE, HEADS = (2, 2, 32, 16), 2
CASE_LIMIT_S = 0.05
BUFFER_NAMES = ("pos", "k", "v", "kq", "ks", "vq", "vs", "kmin", "kscale", "vmin", "vscale", "kr", "vr",
                "knorm", "vnorm", "junk")
DTYPE_NAMES = (*codec._DTYPES, "complex64", "", "float")


def _bases() -> list[tuple[str, bytes]]:
    """One valid chunk per (method, example, dtype/start variant)."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(*SHAPE, generator=g)
    out = []
    for name in C.available():
        for i, params in enumerate(C.examples(name)):
            for dtype, start in ((torch.float32, 0), ((torch.bfloat16, torch.float16)[i % 2], 64)):
                blob = C.to_bytes(C.get(name, **params).compress(kv.to(dtype), HEADS, start=start))
                out.append((f"{name}{params}/{str(dtype)[6:]}/start={start}", blob))
    return out


BASES = _bases()


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Tiny tensors: one thread avoids pool wake-ups that dwarf the work (and noise in timings)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    for _, blob in BASES:  # warm the layout caches and lazily built tables
        ckv = C.from_bytes(blob)
        C.validate(ckv)
        C.decompress(ckv)
    yield
    torch.set_num_threads(n)


def _attempt(blob: bytes) -> tuple[bool, float]:
    """``(accepted, seconds)``; any exception other than CodecError from the parse escapes."""
    t0 = time.perf_counter()
    try:
        ckv = C.from_bytes(blob)
        C.validate(ckv)
    except C.CodecError:
        return False, time.perf_counter() - t0
    layers = C.decompress(ckv)
    elapsed = time.perf_counter() - t0
    # The memory bound, from the header: the declared full chunk is at most MAX_RATIO times the
    # chunk's own stored bytes (so at most that times the input), and under the cap.
    two, n_layers, n_tokens, hidden = ckv.shape
    full = two * n_layers * n_tokens * hidden * ckv.dtype.itemsize
    assert full <= codec.MAX_RATIO * ckv.nbytes <= codec.MAX_RATIO * len(blob) and full <= codec.MAX_FULL_BYTES
    # What decompress returns is what the header promises.
    assert len(layers) == n_layers
    head_dim = hidden // ckv.num_kv_heads
    for lk in layers:
        h, n, d = lk.keys.shape
        assert (h, d) == (ckv.num_kv_heads, head_dim) and 0 <= n <= n_tokens
        assert lk.values.shape == lk.keys.shape and lk.keys.dtype == lk.values.dtype == ckv.dtype
        assert lk.positions.shape == (h, n) and lk.positions.dtype == torch.int64
        if n:
            assert int(lk.positions.min()) >= ckv.start and int(lk.positions.max()) < ckv.start + n_tokens
    return True, elapsed


def _run(cases, label: str) -> dict[str, float]:
    """Run ``(description, blob)`` cases; fail on any escaping exception or a slow case."""
    stats = {"cases": 0, "accepted": 0, "max_ms": 0.0}
    for desc, blob in cases:
        try:
            accepted, elapsed = _attempt(blob)
            if elapsed > CASE_LIMIT_S:  # a scheduler hiccup is not slow code: a slow path is slow every time
                elapsed = min(elapsed, *(_attempt(blob)[1] for _ in range(2)))
        except Exception as e:
            pytest.fail(f"{label}: {desc}: {type(e).__name__}: {e}")
        assert elapsed < CASE_LIMIT_S, f"{label}: {desc}: {elapsed * 1e3:.1f} ms"
        stats["cases"] += 1
        stats["accepted"] += accepted
        stats["max_ms"] = max(stats["max_ms"], elapsed * 1e3)
    print(f"{label}: {stats}")
    return stats


# -- mutations ------------------------------------------------------------------------------------

def _weird(rng: random.Random, x=None):
    """A value of the wrong size or type, often derived from ``x``."""
    if isinstance(x, int) and not isinstance(x, bool) and rng.random() < 0.5:
        v = rng.choice([0, -x, x + 1, x - 1, 2 * x, 3 * x, x // 2, 10 * x, 1000 * x, x << 20, x << 40])
        return v if -(2**63) <= v < 2**64 else 2**64 - 1  # what msgpack can carry
    return rng.choice([
        -1, 0, 1, 2, 3, 7, 2**27, 2**31, 2**32 - 1, 2**62, 2**63 - 1, 2**64 - 1, -(2**63),
        0.5, -0.0, 1e300, float("inf"), float("nan"), True, False, None, "", "x", b"\0", [], [1], {}, {"a": 1},
    ])


def _fit(obj):
    """``obj`` with every int msgpack cannot carry replaced by the largest one it can."""
    if isinstance(obj, dict):
        return {k: _fit(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fit(v) for v in obj]
    if isinstance(obj, int) and not -(2**63) <= obj < 2**64:
        return 2**64 - 1
    return obj


def _mutate_params(rng: random.Random, params):
    if not isinstance(params, dict) or not params or rng.random() < 0.2:
        return rng.choice([{}, None, [], "p", {"bogus": 1}, *(dict(p) for n in C.available() for p in C.examples(n))])
    params = dict(params)
    key = rng.choice(list(params))
    r = rng.random()
    if r < 0.15:
        del params[key]
    elif r < 0.25:
        params[rng.choice(["bogus", "seed", "bits", "keep_ratio", "group_size", "evict", "quant"])] = _weird(rng)
    elif isinstance(params[key], dict) and rng.random() < 0.7:
        params[key] = _mutate_params(rng, params[key])
    elif isinstance(params[key], str):
        params[key] = rng.choice([*C.available(), "e5m2", "e4m3", "max", "avg", "key_norm", "error", "nope", 3])
    elif isinstance(params[key], float):
        params[key] = rng.choice([params[key] * 2, params[key] / 8, -params[key], 1.0, 1e-9, 0.0, 2, float("nan")])
    else:
        params[key] = _weird(rng, params[key])
    return params


def _reinterpret(rng: random.Random, entry: list) -> None:
    """Change a buffer entry's dtype, keeping its byte count (so only meaning can catch it)."""
    new = rng.choice(["uint8", "int8", "int16", "float16", "bfloat16", "int32", "float32", "int64", "float64",
                      "float8_e4m3fn", "bool"])
    size = codec.parse_dtype(new).itemsize
    if entry[4] % size == 0:
        entry[1], entry[2] = new, [entry[4] // size]


def _mutate_entry(rng: random.Random, h: dict, entries: list) -> None:
    i = rng.randrange(len(entries))
    e = entries[i] = list(entries[i])
    name, n_layers = e[0], h["shape"][1] if isinstance(h.get("shape"), list) and len(h["shape"]) > 1 else 2
    op = rng.randrange(12)
    if op == 0:
        del entries[i]
    elif op == 1:
        entries.append([rng.choice([name, name + "x", f"L{n_layers}.k"]), *e[1:]])
    elif op == 2:  # rename
        layer = rng.choice([0, 1, n_layers, 10**9, "01", "-1", "x"])
        e[0] = rng.choice([f"L{layer}.{rng.choice(BUFFER_NAMES)}", name.replace("L0", "L1").replace("L1.", "L0."),
                           name + ".", "pos", f"L{layer}", 7, None])
    elif op == 3:
        e[1] = rng.choice(DTYPE_NAMES)
    elif op == 4:
        _reinterpret(rng, e)
    elif op == 5:  # reshape, same element count
        shape = e[2]
        if isinstance(shape, list) and shape:
            n = 1
            for s in shape:
                n *= s
            e[2] = rng.choice([[n], list(reversed(shape)), [*shape, 1], [1, *shape], shape[:-1] + [1, shape[-1]],
                               [0, *shape] if n == 0 else [n // max(1, shape[-1]), shape[-1]]])
    elif op == 6:  # shape edit, byte count follows
        if isinstance(e[2], list) and e[2]:
            j = rng.randrange(len(e[2]))
            e[2][j] = rng.choice([0, 1, e[2][j] + 1, max(0, e[2][j] - 1), 2 * e[2][j]])
            n = 1
            for s in e[2]:
                n *= s
            e[4] = n * codec.parse_dtype(e[1]).itemsize
    elif op == 7:  # move the data: misaligned, aliasing another buffer, or past the end
        other = rng.choice(entries)
        e[3] = rng.choice([e[3] + 1, e[3] + 2, e[3] + 16, max(0, e[3] - 16), other[3], -1, 2**40, 2**64 - 1])
    elif op == 8:
        e[4] = _weird(rng, e[4])
    elif op == 9:  # swap two buffers' names (k <-> v swaps are harmless; the rest are not)
        j = rng.randrange(len(entries))
        entries[j] = list(entries[j])
        e[0], entries[j][0] = entries[j][0], e[0]
    elif op == 10:  # a positions buffer made of another buffer's bytes
        pos = [x for x in entries if isinstance(x[0], str) and x[0].endswith(".pos")]
        if pos:
            target = rng.choice(pos)
            target[1:] = e[1:]
            _reinterpret(rng, target)
            if target[4] % 4 == 0:
                target[1], target[2] = "int32", [h.get("heads", 2) if isinstance(h.get("heads"), int) else 2,
                                                 target[4] // 8]
                target[4] = 4 * target[2][0] * target[2][1] if target[2][0] > 0 else 0
    else:
        entries[i] = rng.choice([[], [name], "x", None, [name, e[1], e[2], e[3]], [*e, 0]])


def _mutate_header(rng: random.Random, h: dict):
    """One edit of a decoded header (in place where possible); returns the header to frame."""
    field = rng.choice(["method", "params", "params", "shape", "shape", "heads", "dtype", "start",
                        "buffers", "buffers", "buffers", "buffers", "whole"])
    if field == "method":
        h["method"] = rng.choice([*C.available(), "nope", "", "NONE", 3, None, ["int8"]])
    elif field == "params":
        h["params"] = _mutate_params(rng, h.get("params"))
    elif field == "shape":
        shape = h.get("shape")
        if isinstance(shape, list) and shape and rng.random() < 0.8:
            shape = list(shape)
            j = rng.randrange(len(shape))
            shape[j] = _weird(rng, shape[j])
        else:
            shape = rng.choice([[2, 2, 32], [2, 2, 32, 16, 1], [], 2**27, "2,2,32,16", None,
                                [2, 2, 2**27, 16], [2, 2**20, 32, 16], [2, 2, 32, 2**20]])
        h["shape"] = shape
    elif field == "heads":
        h["heads"] = _weird(rng, h.get("heads"))
    elif field == "dtype":
        h["dtype"] = rng.choice(DTYPE_NAMES + (None, 3))
    elif field == "start":
        h["start"] = _weird(rng, h.get("start"))
    elif field == "buffers":
        entries = h.get("buffers")
        if isinstance(entries, list) and entries and rng.random() < 0.9:
            _mutate_entry(rng, h, entries)
        else:
            h["buffers"] = rng.choice([[], None, {}, "x", [[]]])
    else:
        r = rng.random()
        if r < 0.4:
            del h[rng.choice(list(h))]
        elif r < 0.6:
            h[rng.choice(["extra", "version", "pad"])] = _weird(rng)
        else:
            return rng.choice([[], 0, "hdr", None, list(h.values())])
    return h


def _header_cases(n: int, seed: int):
    rng = random.Random(seed)
    for k in range(n):
        label, blob = BASES[k % len(BASES)]
        header, payload = codec.unframe(blob)
        header = copy.deepcopy(header)
        edits = rng.choice([1, 1, 1, 2, 3])
        for _ in range(edits):
            try:
                header = _mutate_header(rng, header)
            except (TypeError, ValueError, IndexError, KeyError, AttributeError, codec.CodecError):
                pass  # an edit that assumed what an earlier edit already broke: skip it
            if not isinstance(header, dict):
                break
        payload = bytes(payload)
        if rng.random() < 0.1:  # the payload shrinks or grows as well
            payload = payload[: rng.randrange(len(payload) + 1)] if rng.random() < 0.5 else payload + bytes(64)
        header = _fit(header)
        yield f"{label} header edit #{k}: {str(header)[:300]}", codec.frame(header, payload)


def _raw_cases(n: int, seed: int, redigest: bool):
    rng = random.Random(seed)
    for k in range(n):
        label, blob = BASES[k % len(BASES)]
        body = bytearray(blob[: -codec.DIGEST_SIZE] if redigest else blob)
        header_end = 10 + int.from_bytes(body[6:10], "little")
        op = rng.randrange(6)
        if op <= 1:  # bit flips / byte sets, mostly in the header when re-digested
            for _ in range(rng.choice([1, 1, 2, 4])):
                hi = header_end if (redigest and rng.random() < 0.7) else len(body)
                j = rng.randrange(min(hi, len(body)))
                if op == 0:
                    body[j] ^= 1 << rng.randrange(8)
                else:
                    body[j] = rng.randrange(256)
        elif op == 2:  # truncation
            del body[rng.randrange(len(body)):]
        elif op == 3:  # extension
            body += bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 16, 100])))
        elif op == 4:  # insertion / deletion inside
            j = rng.randrange(len(body))
            if rng.random() < 0.5:
                body[j:j] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20)))
            else:
                del body[j:j + rng.randrange(1, 20)]
        else:  # header_len field
            body[6:10] = rng.choice([0, 1, header_end - 11, header_end - 9, 2**31, 2**32 - 1]).to_bytes(4, "little")
        if body == (blob[: -codec.DIGEST_SIZE] if redigest else blob):  # a no-op edit (same byte written)
            body[rng.randrange(len(body))] ^= 0x80
        blob2 = bytes(body) + codec.digest(body) if redigest else bytes(body)
        yield f"{label} {'re-digested ' if redigest else ''}raw edit #{k} op={op}", blob2


def _value_cases(n: int, seed: int):
    """Valid headers, edited values: out-of-range / unsorted / duplicate positions, non-finite
    scales, random bytes in any buffer."""
    rng = random.Random(seed)
    for k in range(n):
        label, blob = BASES[k % len(BASES)]
        ckv = C.from_bytes(blob)
        ckv.buffers = {name: b.clone() for name, b in ckv.buffers.items()}
        names = [n for n, b in sorted(ckv.buffers.items()) if b.numel()]
        pos = [n for n in names if n.endswith(".pos")]
        meta = [n for n in names if n.split(".", 1)[1] in ("ks", "vs", "kmin", "kscale", "vmin", "vscale",
                                                             "knorm", "vnorm")]
        r = rng.random()
        name = rng.choice(pos if pos and r < 0.4 else meta if meta and r < 0.7 else names)
        b = ckv.buffers[name]
        flat = b.view(-1)
        if name.endswith(".pos"):
            op = rng.randrange(6)
            j = rng.randrange(flat.numel())
            if op == 0:
                flat[j] = rng.choice([-1, SHAPE[2], SHAPE[2] + 1, 2**31 - 1, -(2**31), 10**6])
            elif op == 1 and b.shape[1] > 1:
                i = rng.randrange(1, b.shape[1])
                b[:, i] = b[:, i - 1]  # duplicate
            elif op == 2:
                b.copy_(b.flip(-1))  # descending
            elif op == 3 and b.shape[0] > 1:
                b[0, rng.randrange(b.shape[1])] = rng.randrange(SHAPE[2])  # heads differ
            elif op == 4:
                b.copy_(b[:, torch.randperm(b.shape[1], generator=torch.Generator().manual_seed(k))])
            else:
                flat[j] = rng.randrange(SHAPE[2])
        elif b.is_floating_point() and rng.random() < 0.7:
            flat[rng.randrange(flat.numel())] = rng.choice([float("inf"), -float("inf"), float("nan"), 0.0, -1.0,
                                                            6.0e4, 1e-8])
        else:
            raw = flat.view(torch.uint8) if b.element_size() == 1 else b.view(-1).view(torch.uint8)
            for _ in range(rng.choice([1, 4, 32])):
                raw[rng.randrange(raw.numel())] = rng.randrange(256)
        yield f"{label} value edit #{k} of {name}", C.to_bytes(ckv)


# -- the tests --------------------------------------------------------------------------------------

def test_valid_chunks_of_every_method_are_accepted():
    stats = _run(((label, blob) for label, blob in BASES), "valid")
    assert stats["accepted"] == len(BASES) == stats["cases"]


def test_fuzz_raw_bytes():
    stats = _run(_raw_cases(2000, seed=1, redigest=False), "raw")
    assert stats["cases"] == 2000 and stats["accepted"] == 0  # the digest catches every edit


def test_fuzz_raw_bytes_with_a_recomputed_digest():
    stats = _run(_raw_cases(2500, seed=2, redigest=True), "raw, re-digested")
    assert stats["cases"] == 2500 and stats["accepted"] > 100  # payload edits are valid chunks


@pytest.mark.parametrize("seed", [3, 4])
def test_fuzz_header_edits(seed):
    stats = _run(_header_cases(2500, seed=seed), f"header edits (seed {seed})")
    assert stats["cases"] == 2500 and stats["accepted"] > 50  # harmless edits (start, k<->v) pass


def test_fuzz_value_edits():
    stats = _run(_value_cases(1500, seed=5), "value edits")
    assert stats["cases"] == 1500 and 0 < stats["accepted"] < stats["cases"]
