"""Flat, validated configuration of a :class:`DualTierStore`; LMCache adapters map their
namespaced YAML keys onto these names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import DualTierStore
    from .tiers.base import CapacityTier

CAPACITY_TIERS = ("disk", "nixl", "redis", "lm", "memory")


@dataclass(frozen=True)
class StoreConfig:
    compressor: str
    num_kv_heads: int
    compressor_params: dict[str, Any] = field(default_factory=dict)
    capacity: str = "disk"
    disk_path: str | None = None
    disk_fsync: bool = False
    redis_url: str | None = None
    redis_prefix: str = "vericache:"
    lm_url: str | None = None  # LMCache server, lm://host:port
    lm_namespace: str = "vericache"
    memory_bytes: int = 4 << 30  # bound of the capacity tier when capacity == "memory"
    hot_bytes: int = 1 << 30
    max_concurrent_reads: int = 4

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoreConfig:
        if not isinstance(d, dict):
            raise ValueError(f"store config must be a dict, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ValueError(f"unknown store config key(s) {unknown}; valid keys: {sorted(fields)}")
        missing = sorted(n for n, f in fields.items() if _required(f) and n not in d)
        if missing:
            raise ValueError(f"missing store config key(s) {missing}")
        for name, value in d.items():
            _check_type(name, value, fields[name].type)
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        from .. import compressors

        compressors.get(self.compressor, **self.compressor_params)  # raises ValueError naming the problem
        for name in ("num_kv_heads", "memory_bytes", "hot_bytes", "max_concurrent_reads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"store config {name} must be > 0, got {getattr(self, name)}")
        if self.capacity not in CAPACITY_TIERS:
            raise ValueError(f"store config capacity must be one of {CAPACITY_TIERS}, got {self.capacity!r}")
        if self.capacity in ("disk", "nixl") and not self.disk_path:
            raise ValueError(f"store config capacity {self.capacity!r} needs disk_path")
        if self.capacity == "redis" and not self.redis_url:
            raise ValueError("store config capacity 'redis' needs redis_url")
        if self.capacity == "lm" and not self.lm_url:
            raise ValueError("store config capacity 'lm' needs lm_url")

    def build_capacity(self) -> CapacityTier:
        if self.capacity == "disk":
            from .tiers.disk import DiskTier

            return DiskTier(self.disk_path, fsync=self.disk_fsync)  # type: ignore[arg-type]
        if self.capacity == "nixl":
            from .tiers.nixl import NixlTier

            return NixlTier(self.disk_path, fsync=self.disk_fsync)  # type: ignore[arg-type]
        if self.capacity == "redis":
            from .tiers.redis import RedisTier

            return RedisTier(self.redis_url, prefix=self.redis_prefix)  # type: ignore[arg-type]
        if self.capacity == "lm":
            from .tiers.lm import LMServerTier

            return LMServerTier(self.lm_url, namespace=self.lm_namespace)  # type: ignore[arg-type]
        from .tiers.memory import MemoryTier

        return MemoryTier(self.memory_bytes)

    def build(self) -> DualTierStore:
        from .. import compressors
        from .store import DualTierStore

        return DualTierStore(
            compressors.get(self.compressor, **self.compressor_params),
            self.build_capacity(),
            num_kv_heads=self.num_kv_heads,
            hot_bytes=self.hot_bytes,
            max_concurrent_reads=self.max_concurrent_reads,
        )


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


_TYPES = {"str": str, "int": int, "bool": bool, "dict[str, Any]": dict, "str | None": (str, type(None))}


def _check_type(name: str, value: Any, annotation: str) -> None:
    expected = _TYPES[annotation]
    # bool is an int subclass: reject True where a size is expected, and 1 where a flag is.
    if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
        raise ValueError(f"store config {name} must be {annotation}, got {type(value).__name__} {value!r}")
