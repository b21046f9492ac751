"""The full-chunk byte format: exact round trip, and every damaged input rejected."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from lmcache_vericache.backends.fullchunk import MAGIC, CorruptChunkError, decode_full, encode_full


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_round_trip_is_bit_exact(dtype):
    t = torch.randn(2, 3, 5, 12).to(dtype)
    blob = encode_full(t)
    for buf in (blob, bytearray(blob), memoryview(blob)):
        out = decode_full(buf)
        assert out.dtype == dtype and out.shape == t.shape
        assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_input_is_viewed_without_a_copy():
    """No copy for writable or read-only input (a fresh buffer per chunk costs page faults on the
    swap path); a reader that wrote into a read-only view would be caught by the next digest check."""
    t = torch.randn(2, 1, 4, 8)
    buf = bytearray(encode_full(t))
    viewed = decode_full(buf)
    buf[-20] ^= 0xFF  # a payload byte: the view sees it, so no copy was made
    assert not torch.equal(viewed, t)
    blob = encode_full(t)
    base = np.frombuffer(blob, dtype=np.uint8).ctypes.data
    assert base <= decode_full(blob).data_ptr() < base + len(blob)  # inside the immutable input
    viewed = decode_full(blob)
    viewed[0, 0, 0, 0] += 1  # what no reader may do: the immutable input changed under the view...
    with pytest.raises(CorruptChunkError, match="checksum"):
        decode_full(blob)  # ...and the next read refuses it instead of serving it


def test_non_contiguous_and_empty_tensors():
    t = torch.randn(2, 3, 8, 4).transpose(2, 3)
    assert torch.equal(decode_full(encode_full(t)), t)
    e = torch.empty(2, 0, 4, 4)
    assert decode_full(encode_full(e)).shape == e.shape


def test_every_truncation_is_rejected():
    blob = encode_full(torch.randn(2, 1, 4, 6))
    for n in range(len(blob)):
        with pytest.raises(CorruptChunkError):
            decode_full(blob[:n])
    with pytest.raises(CorruptChunkError):
        decode_full(blob + b"\0")


def test_every_single_byte_corruption_is_rejected():
    blob = encode_full(torch.randn(2, 1, 4, 6).bfloat16())
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(CorruptChunkError):
            decode_full(bad)


def test_clear_messages_for_wrong_format():
    blob = bytearray(encode_full(torch.zeros(2, 1, 2, 2)))
    with pytest.raises(CorruptChunkError, match="bad magic"):
        decode_full(b"VCKV" + bytes(blob[4:]))
    struct.pack_into("<H", blob, len(MAGIC), 99)
    with pytest.raises(CorruptChunkError, match="version 99"):
        decode_full(blob)
    assert issubclass(CorruptChunkError, ValueError)


def test_unsupported_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="unsupported dtype"):
        encode_full(torch.zeros(2, dtype=torch.complex64))
