"""Dual-tier store: compressed chunks served at once, full chunks prefetched from a capacity tier."""

from .config import StoreConfig
from .fullchunk import CorruptChunkError, decode_full, encode_full
from .store import DualTierStore, PrefetchHandle, StoreStats
from .tiers import CapacityTier, DiskTier, MemoryTier, TierError

__all__ = [
    "CapacityTier",
    "CorruptChunkError",
    "DiskTier",
    "DualTierStore",
    "MemoryTier",
    "PrefetchHandle",
    "StoreConfig",
    "StoreStats",
    "TierError",
    "decode_full",
    "encode_full",
]
