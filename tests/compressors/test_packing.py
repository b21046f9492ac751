"""Bit packing of low-bit codes and the shared asymmetric group quantizer."""

from __future__ import annotations

import pytest
import torch

from lmcache_vericache.compressors.packing import dequantize, pack, packed_nbytes, quantize, unpack


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 5, 7, 8, 9, 13, 24, 1001])
def test_round_trip_and_exact_byte_count(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.is_contiguous()
    assert packed.numel() == packed_nbytes(n, bits) == (n * bits + 7) // 8
    assert torch.equal(unpack(packed, bits, n), codes)


def test_three_bit_codes_really_pack_eight_into_three_bytes():
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes))  # code i at bit 3i, little endian
    assert pack(codes, 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]


@pytest.mark.parametrize("bits,expected", [(2, [0b11100100]), (4, [0x10, 0x02])])
def test_known_layouts(bits, expected):
    codes = torch.tensor([0, 1, 2, 3][: 4 if bits == 2 else 3], dtype=torch.uint8)
    assert pack(codes, bits).tolist() == expected


def test_pack_reads_any_shape_and_leaves_input_alone():
    codes = torch.randint(0, 4, (3, 5, 7), dtype=torch.uint8)
    before = codes.clone()
    packed = pack(codes, 2)
    assert torch.equal(codes, before)
    assert torch.equal(unpack(packed, 2, codes.numel()).view(codes.shape), codes)


def test_unpack_works_on_read_only_buffers():
    codes = torch.randint(0, 8, (37,), dtype=torch.uint8)
    raw = bytes(pack(codes, 3).numpy())
    ro = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    assert torch.equal(unpack(ro, 3, 37), codes)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(4, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="bytes"):
        unpack(torch.zeros(3, dtype=torch.uint8), 4, 8)  # 8 four-bit codes need 4 bytes
    with pytest.raises(ValueError, match="uint8"):
        unpack(torch.zeros(4, dtype=torch.int32), 4, 8)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantize_error_is_at_most_half_a_step(bits):
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0)) * 3 + 1
    q, mn, scale = quantize(x, bits, dim=-1)
    assert mn.dtype == scale.dtype == torch.float16 and mn.shape == scale.shape == (4, 16, 1)
    assert q.numel() == packed_nbytes(x.numel(), bits)
    back = dequantize(q, mn, scale, bits, tuple(x.shape), torch.float32)
    step = scale.float()
    # Half a step, plus the fp16 rounding of min and scale at the top of the range.
    assert ((back - x).abs() <= step / 2 + 2e-3 * x.abs().amax()).all()


def test_quantize_groups_along_the_given_axis():
    # Constant along dim 1, wildly different along dim 2: exact when grouped along dim 1 only.
    x = (torch.logspace(-2, 3, 8) * torch.tensor([1.0, -1.0]).repeat(4)).expand(2, 16, 8).contiguous()
    q, mn, scale = quantize(x, 2, dim=1)
    assert torch.allclose(dequantize(q, mn, scale, 2, (2, 16, 8), torch.float32), x, rtol=1e-3)
    q, mn, scale = quantize(x, 2, dim=2)
    assert not torch.allclose(dequantize(q, mn, scale, 2, (2, 16, 8), torch.float32), x, rtol=1e-1)


def test_constant_group_is_exact_up_to_fp16():
    x = torch.full((2, 3, 8), 0.75)
    q, mn, scale = quantize(x, 2, dim=-1)
    assert torch.equal(dequantize(q, mn, scale, 2, (2, 3, 8), torch.float32), x)
