"""FP8: per-token, per-head scaled 8-bit floating point (the plain FP8 baseline).

Each head vector of a token is divided by one fp16 scale ``absmax / max_finite`` (so its largest entry
maps to the format's largest finite value and nothing overflows) and cast to
``torch.float8_e4m3fn`` (default; 3 mantissa bits) or ``torch.float8_e5m2`` (2 mantissa bits, wider
range). The formats are those of Micikevicius et al., "FP8 Formats for Deep Learning" (2022,
arXiv 2209.05433), as used for vLLM's fp8 KV cache; the per-token scale is finer than vLLM's
per-tensor one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from . import register
from .base import KVCompressor, KVQuantizer
from .params import check_choice

_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _quant(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    # Rounding the scale to fp16 (relative error <= 2^-11) must never shrink it, or the largest entry
    # would overflow (float8_e4m3fn has no inf: it becomes NaN), hence the 2^-10 margin. The floor
    # (smallest normal fp16) keeps a zero vector away from a 0 division.
    fmax = torch.finfo(fp8).max
    scale = (x.abs().amax(-1, keepdim=True) * ((1 + 2**-10) / fmax)).clamp_min_(2**-14).to(torch.float16)
    return (x * (1.0 / scale.float())).to(fp8), scale


@cache
def _table(fmt: str) -> torch.Tensor:
    """float32 value of each of the 256 fp8 bit patterns."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(_FORMATS[fmt]).float()


def _dequant(q: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A 256-entry lookup: torch's fp8 -> float cast is scalar code on CPU, much slower.
    x = table.index_select(0, q.view(torch.uint8).reshape(-1).long()).view(q.shape)
    return x.mul_(scale.float()).to(dtype)


@register
@dataclass
class FP8(KVCompressor, KVQuantizer):
    name = "fp8"
    format: str = "e4m3"  # "e4m3" (float8_e4m3fn) or "e5m2" (float8_e5m2)

    examples = ({}, {"format": "e5m2"})
    finite_buffers = ("ks", "vs")  # codes need no check: any byte indexes the 256-entry table

    def validate(self) -> None:
        check_choice("format", self.format, tuple(_FORMATS))

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        fp8 = _FORMATS[self.format]
        kq, ks = _quant(keys, fp8)
        vq, vs = _quant(values, fp8)
        return {"kq": kq, "ks": ks, "vq": vq, "vs": vs}

    def decode(self, buffers, shape, dtype):
        table = _table(self.format)
        return tuple(_dequant(buffers[f"{p}q"], buffers[f"{p}s"], table, dtype) for p in "kv")
