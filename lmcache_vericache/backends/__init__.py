"""The storage core: the dual-tier store, its tiers, the chunk formats and the one key scheme.

The LMCache glue lives in :mod:`lmcache_vericache.backends.lmcache` (imports ``lmcache``); nothing
here imports it, nor vLLM.
"""

from .config import StoreConfig
from .fullchunk import CorruptChunkError, decode_full, encode_full
from .keys import KeySpace, folder_fingerprint, model_fingerprint, prefix_hashes
from .prefetch import PrefetchHandle
from .store import DualTierStore, StoreStats
from .tiers import CapacityTier, DiskTier, MemoryTier, TierError

__all__ = [
    "CapacityTier",
    "CorruptChunkError",
    "DiskTier",
    "DualTierStore",
    "KeySpace",
    "MemoryTier",
    "PrefetchHandle",
    "StoreConfig",
    "StoreStats",
    "TierError",
    "decode_full",
    "encode_full",
    "folder_fingerprint",
    "model_fingerprint",
    "prefix_hashes",
]
