"""Registry errors and every kind of malformed codec input."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch

from lmcache_vericache import compressors as C
from lmcache_vericache.compressors import codec


@pytest.fixture
def blob() -> bytes:
    kv = torch.randn(2, 2, 64, 2 * 16)
    return C.to_bytes(C.get("int8").compress(kv, 2))


def test_available_lists_methods():
    names = C.available()
    assert "none" in names and "int8" in names and "streamingllm" in names
    assert names == sorted(names)


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown compressor 'nope'.*available"):
        C.get("nope")


def test_unknown_parameter_is_a_clear_error():
    with pytest.raises(ValueError, match="no parameter.*'bogus'"):
        C.get("streamingllm", bogus=1)


def test_bad_parameter_value_is_a_clear_error():
    with pytest.raises(ValueError, match="keep_ratio"):
        C.get("streamingllm", keep_ratio=1.5)


def test_wrong_kv_layout_is_rejected():
    with pytest.raises(ValueError, match="KV_2LTD"):
        C.get("int8").compress(torch.randn(2, 64, 32), 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        C.get("int8").compress(torch.randn(2, 1, 8, 30), 4)


def test_round_trip(blob):
    ckv = C.from_bytes(blob)
    assert ckv.method == "int8" and ckv.shape == (2, 2, 64, 32)


@pytest.mark.parametrize("cut", [0, 3, 9, 30, -17, -1])
def test_truncated_input_raises(blob, cut):
    with pytest.raises(C.CodecError):
        C.from_bytes(blob[:cut] if cut else b"")


def test_wrong_magic_raises(blob):
    with pytest.raises(C.CodecError, match="magic"):
        C.from_bytes(b"XXXX" + blob[4:])


def test_wrong_version_raises(blob):
    bad = blob[:4] + struct.pack("<H", codec.VERSION + 1) + blob[6:]
    with pytest.raises(C.CodecError, match="version"):
        C.from_bytes(bad)


@pytest.mark.parametrize("where", [10, 200, 1000, -20])
def test_corrupted_byte_raises(blob, where):
    bad = bytearray(blob)
    bad[where] ^= 0x01
    with pytest.raises(C.CodecError, match="checksum"):
        C.from_bytes(bytes(bad))


def _reframe(header: dict, payload: bytes = b"") -> bytes:
    """A well-checksummed frame around an arbitrary header: only header validation can catch it."""
    h = msgpack.packb(header, use_bin_type=True)
    body = struct.pack("<4sHI", codec.MAGIC, codec.VERSION, len(h)) + h + payload
    return body + codec.digest(body)


@pytest.mark.parametrize(
    "header",
    [
        {"method": "int8"},  # missing fields
        {"method": "int8", "params": {}, "shape": [2, 1, 4, 4], "heads": 1, "dtype": "float32", "start": 0,
         "buffers": [["L0.k", "float32", [4, 4], 0, 64]]},  # buffer beyond payload
        {"method": "int8", "params": {}, "shape": [2, 1, 4, 4], "heads": 1, "dtype": "float32", "start": 0,
         "buffers": [["L0.k", "float32", [4, 4], 0, 60]]},  # shape/bytes mismatch
        {"method": "int8", "params": {}, "shape": [2, 1, 4, 4], "heads": 1, "dtype": "complex7", "start": 0,
         "buffers": []},  # unknown dtype
    ],
)
def test_malformed_header_raises(header):
    with pytest.raises(C.CodecError):
        C.from_bytes(_reframe(header, b"\0" * 60))


def test_garbage_header_raises():
    body = struct.pack("<4sHI", codec.MAGIC, codec.VERSION, 5) + b"\xc1\xc1\xc1\xc1\xc1"
    with pytest.raises(C.CodecError, match="malformed"):
        C.from_bytes(body + codec.digest(body))
