"""KIVI: tuning-free asymmetric 2/4-bit KV quantization.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024
(arXiv 2402.02750). Keys have outlier *channels*, so they are quantized per channel: each channel
of each group of ``group_size`` consecutive tokens gets its own (min, scale). Values are quantized
per token, in groups of ``group_size`` channels. The most recent tokens stay in full precision
(the paper's residual window): keys only enter the quantized part in whole token groups, so the
key residual holds the last ``residual`` tokens plus the tokens that do not fill a group, and the
value residual holds exactly the last ``residual`` tokens (both trimmed to the tokens present).

Within a stored chunk the residual window is the chunk's tail: the chunk is quantized once when
it is stored, so its last tokens play the role of the paper's streaming residual. The drafter
additionally keeps the sequence's newest tokens at full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .base import KVCompressor, KVQuantizer
from .packing import decode_per_token, dequantize, encode_per_token, quantize
from .params import check_choice


@register
@dataclass
class KIVI(KVCompressor, KVQuantizer):
    name = "kivi"
    bits: int = 2
    group_size: int = 32  # tokens per key group and channels per value group
    residual: int = 32  # newest tokens of the chunk kept in full precision

    examples = ({"bits": 2}, {"bits": 4}, {"bits": 2, "residual": 0, "group_size": 16})
    finite_buffers = ("kmin", "kscale", "vmin", "vscale")

    def validate(self) -> None:
        check_choice("bits", self.bits, (2, 4))
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")
        if not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"residual must be an int >= 0, got {self.residual!r}")

    def split(self, n: int) -> tuple[int, int]:
        """Quantized token counts ``(keys, values)`` out of ``n``; the rest is the residual."""
        n_v = n - min(self.residual, n)
        return n_v // self.group_size * self.group_size, n_v

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        h, n, d = keys.shape
        n_k, n_v = self.split(n)
        kq, kmin, kscale = quantize(keys[:, :n_k].reshape(h, n_k // self.group_size, self.group_size, d), self.bits, dim=2)
        out = {"kq": kq, "kmin": kmin, "kscale": kscale, "kr": keys[:, n_k:].contiguous()}
        out |= encode_per_token(values[:, :n_v], self.bits, self.group_size, "v")
        out["vr"] = values[:, n_v:].contiguous()
        return out

    def decode(self, buffers, shape, dtype):
        h, n, d = shape
        n_k, n_v = self.split(n)
        k, v = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        g = (h, n_k // self.group_size, self.group_size, d)
        # Written in place into the outputs: a concatenation would copy everything once more.
        dequantize(buffers["kq"], buffers["kmin"], buffers["kscale"], self.bits, g, dtype, out=k[:, :n_k].view(g))
        decode_per_token(buffers, "v", self.bits, self.group_size, (h, n_v, d), dtype, out=v[:, :n_v])
        k[:, n_k:], v[:, n_v:] = buffers["kr"], buffers["vr"]
        return k, v
