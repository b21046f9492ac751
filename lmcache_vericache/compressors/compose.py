"""Eviction then quantization: keep the tokens an eviction method picks, store them low-bit.

The two stages are independent registered methods built through the registry, e.g.
``get("compose", evict="streamingllm", quant="kivi", evict_params={"keep_ratio": 0.5},
quant_params={"bits": 2})``. Eviction and quantization multiply their savings; combining the two
for KV caches is studied e.g. in "No Token Left Behind" (Yang et al. 2024, arXiv 2402.18096), which
keeps evicted tokens at low precision instead. Positions are the evictor's; the quantizer sees only
the kept tokens of each layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import get, register
from .base import KVCompressor, KVQuantizer, TokenEvictor


@register
@dataclass
class Compose(KVCompressor):
    name = "compose"
    evict: str = "streamingllm"
    quant: str = "kivi"
    evict_params: dict[str, Any] = field(default_factory=dict)
    quant_params: dict[str, Any] = field(default_factory=dict)

    examples = (
        {"evict": "streamingllm", "quant": "kivi", "evict_params": {"keep_ratio": 0.5}, "quant_params": {"bits": 2}},
        {"evict": "streamingllm", "quant": "int4"},
    )

    def validate(self) -> None:
        for name in ("evict_params", "quant_params"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict, got {getattr(self, name)!r}")
        ev, qu = get(self.evict, **self.evict_params), get(self.quant, **self.quant_params)
        if not isinstance(ev, TokenEvictor) or isinstance(ev, KVQuantizer):
            raise ValueError(f"evict must name an eviction method, {self.evict!r} is not one")
        if not isinstance(qu, KVQuantizer) or isinstance(qu, TokenEvictor):
            raise ValueError(f"quant must name a quantization method, {self.quant!r} is not one")
        self._evictor, self._quantizer = ev, qu

    def evictor(self) -> TokenEvictor | None:
        return self._evictor

    def quantizer(self) -> KVQuantizer | None:
        return self._quantizer
