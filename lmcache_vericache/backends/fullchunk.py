"""Byte format of a full (exact) KV chunk.

Layout (little endian)::

    b"VCFC" | u16 version | u8 ndim | u8 len(dtype) | dtype name | u64 shape[ndim] | raw tensor bytes
            | 16-byte digest (``codec.digest``) of everything before it

Verification only ever sees bit-exact full chunks, so :func:`decode_full` checks the framing, the
exact length and the digest before returning anything, and raises :class:`CorruptChunkError` for
any bad input.
"""

from __future__ import annotations

import struct
import warnings

import torch

from ..compressors.codec import DIGEST_SIZE, CodecError, digest, dtype_name, parse_dtype, tensor_bytes

MAGIC = b"VCFC"
VERSION = 1
_PREFIX = struct.Struct("<4sHBB")

Buffer = bytes | bytearray | memoryview


class CorruptChunkError(ValueError):
    """The bytes are not an intact full chunk (truncated, corrupted, wrong format or version)."""


def encode_full(t: torch.Tensor) -> bytes:
    """Serialize a CPU (or device) tensor: one copy of its bytes into the output."""
    try:
        name = dtype_name(t.dtype).encode()
    except CodecError as e:
        raise ValueError(str(e)) from None
    if t.dim() > 255:
        raise ValueError(f"too many dimensions: {t.dim()}")
    header = _PREFIX.pack(MAGIC, VERSION, t.dim(), len(name)) + name + struct.pack(f"<{t.dim()}Q", *t.shape)
    payload = tensor_bytes(t)
    return b"".join((header, payload, digest(header, payload)))


def decode_full(buf: Buffer, *, check_digest: bool = True) -> torch.Tensor:
    """Verify and parse (``check_digest=False``: framing and length only, for bytes the caller wrote
    itself and held immutable since, see ``DualTierStore``). The tensor views ``buf`` without a copy:
    a writable ``buf`` must not be reused by the caller, and a read-only one (``bytes``, e.g. the
    memory tier's value, which every reader of that key shares) must not be written through the
    tensor. Every reader in this package only copies a full chunk out (into a cache, a paged block,
    a LocalCPU object). Not copying matters on the swap path: a fresh buffer per chunk costs a page
    fault per page, which can cost more than the copies themselves (docs/benchmarks.md)."""
    mv = memoryview(buf).cast("B")
    size = mv.nbytes
    if size < _PREFIX.size + DIGEST_SIZE:
        raise CorruptChunkError(f"truncated: {size} bytes is shorter than the fixed framing")
    magic, version, ndim, name_len = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptChunkError(f"bad magic {bytes(magic)!r}, not a full KV chunk")
    if version != VERSION:
        raise CorruptChunkError(f"unsupported full-chunk version {version} (this build reads {VERSION})")
    shape_at = _PREFIX.size + name_len
    data_at = shape_at + 8 * ndim
    if data_at + DIGEST_SIZE > size:
        raise CorruptChunkError(f"truncated header: {size} bytes")
    try:
        dtype = parse_dtype(bytes(mv[_PREFIX.size:shape_at]).decode())
    except (CodecError, UnicodeDecodeError) as e:
        raise CorruptChunkError(f"bad dtype in header: {e}") from None
    shape = struct.unpack_from(f"<{ndim}Q", mv, shape_at)
    numel = 1
    for s in shape:
        numel *= s
    expected = data_at + numel * torch.empty((), dtype=dtype).element_size() + DIGEST_SIZE
    if size != expected:
        raise CorruptChunkError(f"length {size} does not match shape {list(shape)} {dtype} ({expected} bytes)")
    body = size - DIGEST_SIZE
    if check_digest and digest(mv[:body]) != bytes(mv[body:]):
        raise CorruptChunkError("checksum mismatch: chunk is corrupted")
    raw = mv[data_at:body]
    if not raw.nbytes:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # read-only input: callers must not write into the view
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
