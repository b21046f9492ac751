"""Byte format of a :class:`CompressedKV`.

Layout (little endian)::

    b"VCKV" | u16 version | u32 header_len | header (msgpack) | buffers... | 16-byte blake2b digest

The header names every buffer with its dtype, shape, offset and length, so decoding is a zero-copy
``torch.frombuffer`` over the input. The digest covers everything before it. Any malformed,
truncated, wrong-version or corrupted input raises :class:`CodecError`; no data is returned.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from typing import Union

import msgpack
import torch

from .base import CompressedKV

MAGIC = b"VCKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
DIGEST_SIZE = 16

_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8,
        torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool,
    )
}

Buffer = Union[bytes, bytearray, memoryview]


class CodecError(ValueError):
    """Raised for any input that is not a valid, intact compressed chunk."""


def digest(*parts: Buffer) -> bytes:
    """The checksum used by every byte format of this package (blake2b, 16 bytes)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for p in parts:
        h.update(p)
    return h.digest()


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


def to_bytes(ckv: CompressedKV) -> bytes:
    """Serialize ``ckv`` (one copy of each buffer into the output)."""
    entries, views, offset = [], [], 0
    for name, buf in ckv.buffers.items():
        view = tensor_bytes(buf)
        entries.append([name, dtype_name(buf.dtype), list(buf.shape), offset, view.nbytes])
        views.append(view)
        offset += view.nbytes
    header = msgpack.packb(
        {
            "method": ckv.method,
            "params": ckv.params,
            "shape": list(ckv.shape),
            "heads": ckv.num_kv_heads,
            "dtype": dtype_name(ckv.dtype),
            "start": ckv.start,
            "buffers": entries,
        },
        use_bin_type=True,
    )
    out = bytearray(_PREFIX.pack(MAGIC, VERSION, len(header)))
    out += header
    for view in views:
        out += view
    out += digest(out)
    return bytes(out)


def from_bytes(data: Buffer) -> CompressedKV:
    """Parse and verify; buffers are zero-copy views into ``data`` (kept alive by them)."""
    mv = memoryview(data).cast("B")
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
        buffers = {}
        for name, dt, shape, off, nbytes in h["buffers"]:
            dtype = parse_dtype(dt)
            if off < 0 or data_start + off + nbytes > body_end:
                raise CodecError(f"buffer {name!r} lies outside the payload")
            count = 1
            for s in shape:
                count *= s
            elem = torch.empty((), dtype=dtype).element_size()
            if count * elem != nbytes:
                raise CodecError(f"buffer {name!r}: shape {shape} does not match {nbytes} bytes")
            raw = mv[data_start + off : data_start + off + nbytes]
            with warnings.catch_warnings():  # read-only input: callers must not write into views
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            buffers[name] = t.view(dtype).reshape(shape)
        return CompressedKV(
            method=h["method"],
            params=h["params"],
            shape=tuple(h["shape"]),
            num_kv_heads=h["heads"],
            dtype=parse_dtype(h["dtype"]),
            start=h["start"],
            buffers=buffers,
        )
    except CodecError:
        raise
    except Exception as e:  # malformed msgpack / missing fields / wrong types
        raise CodecError(f"malformed header: {e}") from e
