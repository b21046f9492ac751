"""Byte format of a :class:`CompressedKV`, and what a reader may assume after :func:`validate`.

Layout (little endian)::

    b"VCKV" | u16 version | u32 header_len | header (msgpack) | buffers... | 16-byte BLAKE3 digest

The header is a msgpack map ``{"method": str, "params": map, "shape": [2, L, T, H*D], "heads": H,
"dtype": str, "start": int, "buffers": [[name, dtype, shape, offset, nbytes], ...], "pad": bin}``;
each buffer starts ``offset`` bytes into the payload (a multiple of ``ALIGN`` from the frame start,
so decoding is a zero-copy ``torch.frombuffer`` over the input). The digest covers everything
before it.

Chunks come from a shared store that other hosts write, so a reader checks two things:

1. :func:`from_bytes` checks the *framing*: magic, version, digest, a msgpack map with every field,
   buffer entries ``[str, known dtype, non-negative int shape, offset, nbytes]`` with distinct names
   that lie inside the payload and whose shape matches their byte count. Anything else raises
   :class:`CodecError`. A digest only proves the bytes are the ones the writer sent, not that the
   writer was sane.
2. :func:`validate` checks the *meaning*, and raises :class:`CodecError` naming the first problem:

   * ``method`` a registered name (str); ``params`` a map with str keys that
     ``compressors.get(method, **params)`` accepts;
   * ``shape`` four non-negative ints with ``shape[0] == 2`` and ``shape[1] <= MAX_LAYERS``;
     ``heads`` an int >= 1 dividing ``shape[3]``; ``dtype`` one of ``CHUNK_DTYPES`` (a model's KV
     dtype); ``start`` an int >= 0 with ``start + shape[2] < 2**63`` (absolute positions fit int64);
   * size: the declared full chunk (``full_nbytes``) is at most ``max_full_bytes`` (default
     ``MAX_FULL_BYTES``, 1 GiB) and at most ``MAX_RATIO`` (64) times the chunk's own stored payload
     bytes. The registered methods at their ``examples`` reach at most 25x (compose
     streamingllm 0.25 + int4 on fp32; 12.8x at the test shapes); a writer configured past 64x
     (e.g. ``keep_ratio`` < 1/64) gets a :class:`CodecError` from :func:`to_bytes` rather than
     writing chunks every reader rejects;
   * buffers: CPU, contiguous tensors, named ``L{layer}.{name}`` with ``layer < L``, and per layer
     exactly the names, dtypes and shapes the method's ``compress`` writes for that shape and
     dtype (see :meth:`KVCompressor.check`: derived by encoding zeros, or computed where encoding
     is costly (TurboQuant), and cached per method, parameters, shape and dtype in a bounded LRU).
     Evictors: ``pos`` is int32 ``[H, n]`` with ``n`` the method's per-layer count (1..T where it
     is data dependent: PoissonComp), positions in ``[0, T)`` and strictly ascending per head
     (PoissonComp: also equal across heads). Quantizers: scales, minima and norms are finite.
     Codes need no range check: unpacked codes are masked to ``bits`` bits, so they always index
     inside their codebook (TurboQuant) or 256-entry table (FP8). Stored values themselves (kept
     K/V, KIVI's residual, FP8 codes) are data and are not inspected. TurboQuant and RotateKV
     build a ``D x D`` matrix and accept ``head_dim <= 1024``.

   What it guarantees: for any input bytes ``b``, ``from_bytes(b)`` and then ``validate`` either
   raise :class:`CodecError` or return, and then ``compressors.decompress`` of the chunk succeeds,
   returns ``L`` layers of ``[H, n, D]`` keys/values in ``dtype`` with positions in
   ``[start, start + T)``, and allocates in proportion to ``full_nbytes`` (bounded as above).
   ``tests/compressors/test_fuzz.py`` checks this on 11,000 mutated chunks of every method.

   Cost: structural checks only (a pass over positions and scales; layouts come from the cache),
   far cheaper than decompressing a quantized chunk, so validate does not run ``decompress`` as a
   safety net (docs/benchmarks.md, "Store").

:func:`frame` / :func:`unframe` expose the framing alone (any header, valid digest) for tools and
tests that edit headers.
"""

from __future__ import annotations

import struct
import warnings
from typing import Any

import blake3
import msgpack
import torch

from .base import CompressedKV

MAGIC = b"VCKV"
VERSION = 2  # 2: poissoncomp chunks hold per-head samples with their inclusion probabilities
_PREFIX = struct.Struct("<4sHI")
DIGEST_SIZE = 16
ALIGN = 16

MAX_FULL_BYTES = 1 << 30  # default cap on a chunk's declared full size (validate's max_full_bytes)
MAX_RATIO = 64  # most compression (full bytes / stored bytes) a valid chunk may declare
MAX_LAYERS = 1024  # most layers a chunk may declare (the largest models have ~130)
CHUNK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # dtypes a full chunk may have
_MAX_POSITION = 2**63 - 1
_FIELDS = ("method", "params", "shape", "heads", "dtype", "start", "buffers")

_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8,
        torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool,
    )
}

Buffer = bytes | bytearray | memoryview


class CodecError(ValueError):
    """Raised for any input that is not a valid, intact compressed chunk."""


def digest(*parts: Buffer) -> bytes:
    """The checksum used by every byte format of this package: BLAKE3, 16 bytes.

    BLAKE3 rather than hashlib's blake2b/sha256: full chunks are checksummed on every read, and here
    BLAKE3 runs at ~8 GB/s against 0.5-0.9 GB/s, which capped verified reads below disk speed.
    """
    h = blake3.blake3()
    for p in parts:
        h.update(p)
    return h.digest(DIGEST_SIZE)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CodecError(f"unsupported dtype {dtype}")
    return name


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CodecError(f"unknown dtype {name!r}") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor without a copy."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _frame(fields: dict[str, Any], parts: list[tuple[int, memoryview]], size: int) -> bytes:
    """The frame around ``fields`` (the header, less its pad) and a ``size``-byte payload made of
    ``parts`` (``(offset, bytes)``); the header is padded so the payload starts aligned."""
    for pad in range(2 * ALIGN):
        header = msgpack.packb({**fields, "pad": b"\0" * pad}, use_bin_type=True)
        if (_PREFIX.size + len(header)) % ALIGN == 0:
            break
    data_start = _PREFIX.size + len(header)
    out = bytearray(data_start + size)
    _PREFIX.pack_into(out, 0, MAGIC, VERSION, len(header))
    out[_PREFIX.size:data_start] = header
    for off, view in parts:
        out[data_start + off:data_start + off + view.nbytes] = view
    out += digest(out)
    return bytes(out)


def frame(header: Any, payload: Buffer = b"") -> bytes:
    """A well-formed frame (magic, version, digest) around any msgpack-able ``header`` (a map gets
    a fresh ``pad`` so the payload starts aligned) and ``payload``: the inverse of :func:`unframe`.
    For tools and tests that edit headers."""
    view = memoryview(payload).cast("B")
    if not isinstance(header, dict):
        h = msgpack.packb(header, use_bin_type=True)
        body = _PREFIX.pack(MAGIC, VERSION, len(h)) + h + view.tobytes()
        return body + digest(body)
    return _frame({k: v for k, v in header.items() if k != "pad"}, [(0, view)], view.nbytes)


def _unframe(mv: memoryview) -> tuple[dict[str, Any], int, int]:
    """Check the framing and digest of ``mv``: ``(header map, payload start, payload end)``."""
    if mv.nbytes < _PREFIX.size + DIGEST_SIZE:
        raise CodecError(f"truncated: {mv.nbytes} bytes is shorter than the fixed framing")
    magic, version, header_len = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}, not a compressed KV chunk")
    if version != VERSION:
        raise CodecError(f"unsupported codec version {version} (this build reads {VERSION})")
    body_end = mv.nbytes - DIGEST_SIZE
    if digest(mv[:body_end]) != bytes(mv[body_end:]):
        raise CodecError("checksum mismatch: chunk is corrupted or truncated")
    data_start = _PREFIX.size + header_len
    if data_start > body_end:
        raise CodecError("truncated header")
    try:
        h = msgpack.unpackb(mv[_PREFIX.size:data_start], raw=False)
    except Exception as e:  # malformed msgpack, bad utf-8, non-str map keys, trailing bytes
        raise CodecError(f"malformed header: {e}") from e
    if not isinstance(h, dict):
        raise CodecError(f"malformed header: a {type(h).__name__}, not a map")
    return h, data_start, body_end


def unframe(data: Buffer) -> tuple[dict[str, Any], memoryview]:
    """Check the framing and digest: ``(header map, payload)``, no meaning checked. See :func:`frame`."""
    mv = memoryview(data).cast("B")
    h, start, end = _unframe(mv)
    return h, mv[start:end]


def _check_size(full: int, stored: int, cap: int | None) -> None:
    if cap is not None and full > cap:
        raise CodecError(f"declared full chunk of {full} bytes exceeds the cap of {cap} bytes")
    if full > MAX_RATIO * stored:
        raise CodecError(
            f"declared full chunk of {full} bytes is over {MAX_RATIO}x the {stored} stored bytes "
            f"(ratio {full / max(1, stored):.1f}; no registered method at sane settings compresses that much)"
        )


def to_bytes(ckv: CompressedKV) -> bytes:
    """Serialize ``ckv`` (one copy of each buffer into the output).

    Every buffer starts at a multiple of ``ALIGN`` bytes from the frame start, so the reader can
    view it as its dtype without a copy. Raises :class:`CodecError` for a chunk compressed more
    than ``MAX_RATIO`` times, which :func:`validate` would reject.
    """
    _check_size(ckv.full_nbytes, ckv.nbytes, None)
    entries, views, offset = [], [], 0
    for name, buf in ckv.buffers.items():
        view = tensor_bytes(buf)
        entries.append([name, dtype_name(buf.dtype), list(buf.shape), offset, view.nbytes])
        views.append((offset, view))
        offset = _align(offset + view.nbytes)
    fields = {
        "method": ckv.method,
        "params": ckv.params,
        "shape": list(ckv.shape),
        "heads": ckv.num_kv_heads,
        "dtype": dtype_name(ckv.dtype),
        "start": ckv.start,
        "buffers": entries,
    }
    return _frame(fields, views, offset)


def _read_buffers(entries: list, payload: torch.Tensor, data_start: int, body_end: int) -> dict[str, torch.Tensor]:
    """The buffers of a header's entry list, as views into ``payload`` (the bytes from ``data_start``)."""
    buffers: dict[str, torch.Tensor] = {}
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 5:
            raise CodecError(f"malformed header: buffer entry {entry!r} is not [name, dtype, shape, offset, nbytes]")
        name, dt, shape, off, nbytes = entry
        if not isinstance(name, str):
            raise CodecError(f"malformed header: buffer name {name!r} is not a str")
        if name in buffers:
            raise CodecError(f"malformed header: buffer {name!r} listed twice")
        dtype = parse_dtype(dt)
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise CodecError(f"buffer {name!r}: shape {shape!r} is not a list of non-negative ints")
        if not (_is_int(off) and _is_int(nbytes)) or off < 0 or nbytes < 0 or data_start + off + nbytes > body_end:
            raise CodecError(f"buffer {name!r} lies outside the payload")
        count = 1
        for s in shape:
            count *= s
        if count * dtype.itemsize != nbytes:
            raise CodecError(f"buffer {name!r}: shape {shape} does not match {nbytes} bytes")
        raw = payload[off:off + nbytes]
        if nbytes and (data_start + off) % dtype.itemsize:
            raw = raw.clone()  # misaligned for a typed view
        buffers[name] = raw.view(dtype).reshape(shape)
    return buffers


def from_bytes(data: Buffer) -> CompressedKV:
    """Parse and verify the framing (see the module docstring); buffers are zero-copy views into
    ``data`` (kept alive by them). Call :func:`validate` before trusting what the header says."""
    mv = memoryview(data).cast("B")
    h, data_start, body_end = _unframe(mv)
    missing = [f for f in _FIELDS if f not in h]
    if missing:
        raise CodecError(f"malformed header: missing field(s) {missing}")
    entries = h["buffers"]
    if not isinstance(entries, list):
        raise CodecError(f"malformed header: buffers is a {type(entries).__name__}, not a list")
    if not isinstance(h["shape"], list):
        raise CodecError(f"malformed header: shape is a {type(h['shape']).__name__}, not a list")
    # One tensor over the whole payload; each buffer is a slice of it (a quantized chunk has
    # hundreds of buffers, and a frombuffer per buffer costs more than the slicing).
    with warnings.catch_warnings():  # read-only input: callers must not write into views
        warnings.simplefilter("ignore", UserWarning)
        payload = (torch.frombuffer(mv, dtype=torch.uint8, offset=data_start, count=body_end - data_start)
                   if body_end > data_start else torch.empty(0, dtype=torch.uint8))
    try:
        buffers = _read_buffers(entries, payload, data_start, body_end)
    except CodecError:
        raise
    except Exception as e:  # e.g. a shape torch cannot make
        raise CodecError(f"malformed header: {e}") from e
    return CompressedKV(
        method=h["method"],
        params=h["params"],
        shape=tuple(h["shape"]),
        num_kv_heads=h["heads"],
        dtype=parse_dtype(h["dtype"]),
        start=h["start"],
        buffers=buffers,
    )


def validate(ckv: CompressedKV, *, max_full_bytes: int | None = None) -> None:
    """Raise :class:`CodecError` unless ``ckv`` is a chunk its method could have written, within the
    size caps; then ``decompress(ckv)`` succeeds. The rules are in the module docstring.

    ``max_full_bytes``: cap on the declared full-chunk size, default ``MAX_FULL_BYTES``."""
    from . import available, get  # the registry package imports this module

    cap = MAX_FULL_BYTES if max_full_bytes is None else max_full_bytes
    if not isinstance(ckv, CompressedKV):
        raise CodecError(f"not a CompressedKV: {type(ckv).__name__}")
    method, params, shape, heads, start = ckv.method, ckv.params, ckv.shape, ckv.num_kv_heads, ckv.start
    if not isinstance(method, str) or method not in available():
        raise CodecError(f"unknown method {method!r}")
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise CodecError(f"params must be a map with str keys, got {params!r}")
    if not (isinstance(shape, (tuple, list)) and len(shape) == 4 and all(_is_int(s) and s >= 0 for s in shape)):
        raise CodecError(f"shape must be 4 non-negative ints, got {shape!r}")
    two, n_layers, n_tokens, hidden = shape
    if two != 2:
        raise CodecError(f"shape {tuple(shape)} is not [2, L, T, H*D]: first dimension must be 2")
    if n_layers > MAX_LAYERS:
        raise CodecError(f"{n_layers} layers is more than MAX_LAYERS={MAX_LAYERS}")
    if not _is_int(heads) or heads < 1 or hidden % heads:
        raise CodecError(f"heads must be an int >= 1 dividing the hidden size {hidden}, got {heads!r}")
    if not isinstance(ckv.dtype, torch.dtype) or ckv.dtype not in CHUNK_DTYPES:
        raise CodecError(f"dtype must be one of {[dtype_name(d) for d in CHUNK_DTYPES]}, got {ckv.dtype!r}")
    if not _is_int(start) or start < 0 or start + n_tokens > _MAX_POSITION:
        raise CodecError(f"start must be an int >= 0 with start + {n_tokens} tokens < 2**63, got {start!r}")
    buffers = ckv.buffers
    if not isinstance(buffers, dict):
        raise CodecError(f"buffers must be a dict, got {type(buffers).__name__}")
    for name, buf in buffers.items():
        if not isinstance(name, str) or not isinstance(buf, torch.Tensor):
            raise CodecError(f"buffer {name!r}: not a str name and a tensor")
        if buf.device.type != "cpu" or buf.layout != torch.strided or not buf.is_contiguous():
            raise CodecError(f"buffer {name!r} is not a contiguous CPU tensor")
    _check_size(ckv.full_nbytes, ckv.nbytes, cap)
    try:
        compressor = get(method, **params)
    except Exception as e:
        raise CodecError(f"bad parameters for {method!r}: {e}") from e
    try:
        compressor.check(ckv)
    except CodecError:
        raise
    except Exception as e:  # ValueError from the rules; anything else means the same: not its output
        raise CodecError(f"{method}: {e}") from e
