"""INT4: asymmetric per-token group quantization (the plain 4-bit baseline).

Each head vector is split into groups of ``group_size`` channels; each group gets an fp16 minimum
and scale and 4-bit codes, two per byte. This is the group-wise round-to-nearest baseline used
throughout the KV-quantization literature (e.g. FlexGen, Sheng et al. 2023, arXiv 2303.06865;
the per-token baseline of KIVI, arXiv 2402.02750).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .base import KVCompressor, KVQuantizer
from .packing import decode_per_token, encode_per_token


@register
@dataclass
class Int4(KVCompressor, KVQuantizer):
    name = "int4"
    group_size: int = 32  # channels per (min, scale) group; the whole head when larger than head_dim

    examples = ({}, {"group_size": 64})
    finite_buffers = ("kmin", "kscale", "vmin", "vscale")

    def validate(self) -> None:
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return encode_per_token(keys, 4, self.group_size, "k") | encode_per_token(values, 4, self.group_size, "v")

    def decode(self, buffers, shape, dtype):
        return tuple(decode_per_token(buffers, p, 4, self.group_size, shape, dtype) for p in "kv")
