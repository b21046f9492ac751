"""INT8: symmetric per-token, per-head absmax quantization (the plain 8-bit baseline).

Each token's key (and value) vector of one head gets one fp16 scale ``absmax / 127``; codes are
``round(x / scale)`` in int8. As in LLM.int8()'s vector-wise quantization (Dettmers et al. 2022,
arXiv 2208.07339), without the outlier decomposition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .base import KVCompressor, KVQuantizer


def _quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127.0).clamp_min(1e-8).to(torch.float16)
    codes = (x.float() / scale.float()).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scale


@register
@dataclass
class Int8(KVCompressor, KVQuantizer):
    name = "int8"
    finite_buffers = ("ks", "vs")

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        kq, ks = _quant(keys)
        vq, vs = _quant(values)
        return {"kq": kq, "ks": ks, "vq": vq, "vs": vs}

    def int8_codes(self, buffers):
        return buffers["kq"], buffers["ks"], buffers["vq"], buffers["vs"]

    def decode(self, buffers, shape, dtype):
        k = (buffers["kq"].float() * buffers["ks"].float()).to(dtype)
        v = (buffers["vq"].float() * buffers["vs"].float()).to(dtype)
        return k, v
