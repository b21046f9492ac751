"""``none``: keeps every token at full precision. The ratio-1 baseline and a sanity reference."""

from __future__ import annotations

from dataclasses import dataclass

from . import register
from .base import KVCompressor


@register
@dataclass
class Identity(KVCompressor):
    name = "none"
