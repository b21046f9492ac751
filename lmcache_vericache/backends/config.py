"""The store's configuration: one flat, validated type that every entry point parses.

Python (:meth:`StoreConfig.parse`), ``vericache generate --store-config`` (JSON), LMCache YAML
(``vericache.<key>`` in ``extra_config``), the L2 adapter's ``adapter_params`` and vLLM's
``kv_connector_extra_config`` all go through :func:`~lmcache_vericache.options.parse_options`, so a
bad key gets the same message everywhere, named as the user wrote it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .. import compressors
from ..compressors.poissoncomp import is_poisson_sample
from ..options import parse_options
from .keys import HASH_SCHEMES, LAYOUT_2LTD, KeySpace

if TYPE_CHECKING:
    import torch

    from .store import DualTierStore
    from .tiers.base import CapacityTier

CAPACITY_TIERS = ("disk", "nixl", "redis", "redis_cluster", "lm", "memory")
MODES = ("exact", "verkv")
SKETCH_BITS = (2, 4, 8)


def check_kvfetch(epsilon: Any, delta: Any, sketch_bits: Any) -> None:
    """Raise ``ValueError`` (naming the option) unless these are valid KVFetch options."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
        raise ValueError(f"epsilon must be a number > 0, got {epsilon!r}")
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}")
    if sketch_bits is not None and (isinstance(sketch_bits, bool) or sketch_bits not in SKETCH_BITS):
        raise ValueError(f"sketch_bits must be null (exact keys) or one of {SKETCH_BITS}, got {sketch_bits!r}")


@dataclass(frozen=True)
class StoreConfig:
    """Settings of a :class:`~lmcache_vericache.backends.store.DualTierStore` and of its keys.

    ``model_id`` and ``hash_scheme`` fill the :class:`~lmcache_vericache.backends.keys.KeySpace`;
    left out, each host uses its own (engine: a digest of the weights and ``blake3``; LMCache
    in-process: its ``model_name`` and its ``pre_caching_hash_algorithm``; L2 adapter: the
    ``ObjectKey``'s model name and ``blake3``). Hosts share chunks when these agree.
    """

    compressor: str = "int8"
    num_kv_heads: int | None = None  # required where the host does not know the model (L2 adapter)
    compressor_params: dict[str, Any] = field(default_factory=dict)
    capacity: str = "memory"
    disk_path: str | None = None
    disk_fsync: bool = False
    disk_max_bytes: int | None = None  # bound of the disk/nixl tier (LRU eviction); None: unbounded
    redis_url: str | None = None
    # Startup nodes of the redis_cluster tier, comma-separated redis://[user:pw@]host:port (any
    # live one is enough; list several so a restart finds one). redis_prefix applies to it too.
    redis_cluster_urls: str | None = None
    redis_prefix: str = "vericache:"
    redis_timeout_s: float = 5.0  # socket timeout of the redis / redis_cluster tiers
    lm_url: str | None = None  # LMCache server, lm://host:port
    lm_namespace: str = "vericache"
    memory_bytes: int = 4 << 30  # bound of the capacity tier when capacity == "memory"
    hot_bytes: int = 1 << 30
    max_concurrent_reads: int = 4
    model_id: str | None = None
    hash_scheme: str | None = None
    # Name of an environment variable holding a shared secret (>= 16 bytes): values are then
    # MAC-tagged, and values written without it are rejected. The secret itself never sits in a
    # config file.
    mac_key_env: str | None = None
    # Decoding over this store's chunks (docs/verkv.md). "exact": VeriCache, output identical to
    # full-KV decoding. "verkv": certified approximate (KVFetch attention, no verification forward;
    # not identical). kvfetch_draft: the exact mode drafts with KVFetch attention. Both need
    # poissoncomp chunks. epsilon / delta: the certificate's tolerance and failure probability;
    # sketch_bits: bits of the key sketch KVFetch weighs non-resident tokens with (None: exact keys).
    mode: str = "exact"
    kvfetch_draft: bool = False
    epsilon: float = 0.05
    delta: float = 0.1
    sketch_bits: int | None = 2

    def __repr__(self) -> str:
        """The dataclass repr, with passwords in URLs as ``***``."""
        from .tiers.base import redact

        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown.update({k: ",".join(map(redact, v.split(","))) for k, v in shown.items()
                      if k.endswith(("_url", "_urls")) and isinstance(v, str)})
        return f"StoreConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def parse(cls, values: Mapping[str, Any], *, where: str = "store config", prefix: str = "") -> StoreConfig:
        """Validated config from flat keys; errors name the key as ``prefix + key`` and say ``where``."""
        return parse_options(cls, values, where=where, prefix=prefix)

    def validate(self) -> None:
        """Raises ``ValueError`` whose message starts with the offending key's name."""
        try:
            compressors.get(self.compressor, **self.compressor_params)
        except (ValueError, TypeError) as e:
            name = "compressor_params" if self.compressor in compressors.available() else "compressor"
            raise ValueError(f"{name}: {e}") from None
        for name in ("num_kv_heads", "disk_max_bytes", "memory_bytes", "hot_bytes", "max_concurrent_reads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.capacity not in CAPACITY_TIERS:
            raise ValueError(f"capacity must be one of {CAPACITY_TIERS}, got {self.capacity!r}")
        if self.capacity in ("disk", "nixl") and not self.disk_path:
            raise ValueError(f"disk_path is required for capacity {self.capacity!r}")
        if self.capacity == "redis" and not self.redis_url:
            raise ValueError("redis_url is required for capacity 'redis'")
        if self.capacity == "redis_cluster":
            self._validate_cluster()
        if self.capacity == "lm" and not self.lm_url:
            raise ValueError("lm_url is required for capacity 'lm'")
        if self.hash_scheme is not None and self.hash_scheme not in HASH_SCHEMES:
            raise ValueError(f"hash_scheme must be one of {HASH_SCHEMES}, got {self.hash_scheme!r}")
        if self.model_id is not None and not self.model_id:
            raise ValueError("model_id must not be empty")
        if self.mac_key_env is not None and not self.mac_key_env:
            raise ValueError("mac_key_env must not be empty")
        self._validate_verkv()

    @property
    def uses_kvfetch(self) -> bool:
        """Whether decoding attends with KVFetch (verkv mode, or the exact mode's KVFetch drafter)."""
        return self.mode == "verkv" or self.kvfetch_draft

    def _validate_verkv(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.kvfetch_draft, bool):
            raise ValueError(f"kvfetch_draft must be true or false, got {self.kvfetch_draft!r}")
        check_kvfetch(self.epsilon, self.delta, self.sketch_bits)
        if self.uses_kvfetch and not is_poisson_sample(self.compressor, self.compressor_params):
            what = "mode 'verkv'" if self.mode == "verkv" else "kvfetch_draft"
            raise ValueError(f"{what} needs compressor 'poissoncomp' (its chunks carry the inclusion "
                             f"probabilities KVFetch uses), got {self.compressor!r}")

    def _validate_cluster(self) -> None:
        from .tiers.base import redact

        if not self.redis_cluster_urls or not self.redis_cluster_urls.strip(" ,"):
            raise ValueError("redis_cluster_urls is required for capacity 'redis_cluster' (comma-separated "
                             "redis://host:port of one or more cluster nodes)")
        for url in self.redis_cluster_urls.split(","):
            if not url.strip().startswith(("redis://", "rediss://")):
                raise ValueError(f"redis_cluster_urls: {redact(url.strip())!r} is not a redis:// or rediss:// URL")
        if "{" in self.redis_prefix or "}" in self.redis_prefix:
            raise ValueError(f"redis_prefix {self.redis_prefix!r} must not contain '{{' or '}}' with capacity "
                             "'redis_cluster' (a hash tag in it would put every key in one slot)")

    def key_space(self, *, model: str, dtype: torch.dtype | str, chunk_size: int, layout: str = LAYOUT_2LTD,
                  scheme: str = "blake3", shard: str = "") -> KeySpace:
        """The key space of a host: its own facts, overridden by ``model_id`` / ``hash_scheme``."""
        return KeySpace(model=self.model_id or model, dtype=str(dtype), chunk_size=chunk_size,
                        compressor=self.compressor, compressor_params=dict(self.compressor_params),
                        layout=layout, scheme=self.hash_scheme or scheme, shard=shard)

    def with_heads(self, num_kv_heads: int, *, where: str = "store config", prefix: str = "") -> StoreConfig:
        """This config with the model's KV head count filled in; a different configured count raises."""
        if self.num_kv_heads is not None and self.num_kv_heads != num_kv_heads:
            raise ValueError(f"{where}: {prefix}num_kv_heads = {self.num_kv_heads} disagrees with the "
                             f"model's {num_kv_heads} KV heads")
        from dataclasses import replace

        return replace(self, num_kv_heads=num_kv_heads)

    def build_capacity(self) -> CapacityTier:
        if self.capacity == "disk":
            from .tiers.disk import DiskTier

            return DiskTier(self.disk_path, fsync=self.disk_fsync,  # type: ignore[arg-type]
                            max_bytes=self.disk_max_bytes)
        if self.capacity == "nixl":
            from .tiers.nixl import NixlTier

            return NixlTier(self.disk_path, fsync=self.disk_fsync,  # type: ignore[arg-type]
                            max_bytes=self.disk_max_bytes)
        if self.capacity == "redis":
            from .tiers.redis import RedisTier

            return RedisTier(self.redis_url, prefix=self.redis_prefix, socket_timeout=self.redis_timeout_s)  # type: ignore[arg-type]
        if self.capacity == "redis_cluster":
            from .tiers.redis_cluster import RedisClusterTier

            return RedisClusterTier(self.redis_cluster_urls, prefix=self.redis_prefix,
                                    socket_timeout=self.redis_timeout_s)  # type: ignore[arg-type]
        if self.capacity == "lm":
            from .tiers.lm import LMServerTier

            return LMServerTier(self.lm_url, namespace=self.lm_namespace)  # type: ignore[arg-type]
        from .tiers.memory import MemoryTier

        return MemoryTier(self.memory_bytes)

    def build(self) -> DualTierStore:
        """A new store (the caller owns and closes it). Needs ``num_kv_heads``."""
        from .store import DualTierStore

        if self.num_kv_heads is None:
            raise ValueError("store config: num_kv_heads is required (the host does not know the model)")
        # The secret is read where the store runs (a config may be printed elsewhere).
        if self.mac_key_env is not None and len(os.environ.get(self.mac_key_env, "")) < 16:
            raise ValueError(f"store config: mac_key_env names {self.mac_key_env!r}, which must be set to a "
                             "secret of at least 16 bytes")
        return DualTierStore(compressors.get(self.compressor, **self.compressor_params), self.build_capacity(),
                             num_kv_heads=self.num_kv_heads, hot_bytes=self.hot_bytes,
                             max_concurrent_reads=self.max_concurrent_reads,
                             mac_key=os.environ[self.mac_key_env].encode() if self.mac_key_env else None)
