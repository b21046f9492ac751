"""Capacity tiers: one file per medium, all behind :class:`CapacityTier`.

``RedisTier`` and ``RedisClusterTier`` are imported lazily (``from .redis import RedisTier``,
``from .redis_cluster import RedisClusterTier``) so the package does not need the redis client
unless a Redis tier is configured.
"""

from .base import Blob, CapacityTier, TierError
from .disk import DiskTier
from .memory import LRU, MemoryTier

__all__ = ["LRU", "Blob", "CapacityTier", "DiskTier", "MemoryTier", "TierError"]
