"""The proposer's chunk source beside LMCache's MP server: the VeriCache L2 adapter's store.

A vLLM that reaches LMCache through its ``LMCacheMPConnector`` (not this package's KV connector)
has its prefix chunks stored by the server, through the package's L2 adapter
(:mod:`lmcache_vericache.backends.lmcache.l2_adapter`), which keeps vLLM-on-CPU's planes
token-major with a compressed copy. With the proposer option ``lmcache_store`` (the adapter's
``adapter_params``) and ``lmcache_chunk_size`` (the server's ``--chunk-size``), the proposer opens
the same store (a shared disk path, Redis, ...) and reads those compressed copies to draft, keyed
as the adapter keys them: the server's ``blake3`` prefix chain, vLLM's model name (or ``model_id``),
the KV dtype, and the layout of planes untiled from this vLLM's attention ISA. A chunk the store
does not have (or whose tiling differs: another key) is compressed from vLLM's KV as without a store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..backends import StoreConfig
from ..backends import fused_planes as fp
from ..backends.keys import LAYOUT_2LTD
from ..backends.store import DualTierStore
from .worker_context import ChunkSource

#: ``lmcache_store`` keys that only the adapter reads (how the server untiles planes), and their defaults.
ADAPTER_ONLY = (("vllm_cpu_tiling", "auto"), ("vllm_cpu_block_size", 128))


def store_config(params: Mapping[str, Any], where: str = "lmcache_store", prefix: str = "lmcache_store.") -> StoreConfig:
    """The store config of the adapter's ``adapter_params``, validated (errors start with ``where``
    and name the key as ``prefix + key``): its capacity tier must be one the server shares
    (not ``memory``) and its planes must be stored token-major (not ``vllm_cpu_tiling: none``)."""
    if not isinstance(params, Mapping):
        raise ValueError(f"{where} must be a JSON object (the L2 adapter's adapter_params), got {params!r}")
    tiling = {k: params.get(k, default) for k, default in ADAPTER_ONLY}
    fp.check_tiling(tiling["vllm_cpu_tiling"], tiling["vllm_cpu_block_size"], where=where)
    if tiling["vllm_cpu_tiling"] == "none":
        raise ValueError(f"{where}: {prefix}vllm_cpu_tiling is 'none': the server stores planes full-only, "
                         "with nothing to draft from")
    cfg = StoreConfig.parse({k: v for k, v in params.items() if k not in dict(ADAPTER_ONLY)}, where=where, prefix=prefix)
    if cfg.capacity == "memory":
        raise ValueError(f"{where}: {prefix}capacity is 'memory' (the default): a store private to this "
                         "process, never the server's; give the server's disk / redis / ... tier")
    return cfg


def open_store(params: Mapping[str, Any], num_kv_heads: int | None) -> tuple[StoreConfig, DualTierStore]:
    """The adapter's store, opened at start-up (a bad config fails there, not in a step)."""
    cfg = store_config(params)
    if num_kv_heads is not None:
        cfg = cfg.with_heads(num_kv_heads, where="lmcache_store", prefix="lmcache_store.")
    return cfg, cfg.build()


def planes_layout(device: torch.device, isa: str | None, block_size: int) -> str:
    """The layout the adapter stores this vLLM's objects under: vLLM-on-CPU's fused planes untiled
    from ``isa`` over ``block_size``-token blocks; another device's split K/V planes as they come."""
    return fp.layout_name(isa or "none", block_size) if device.type == "cpu" else LAYOUT_2LTD


def lmcache_source(cfg: StoreConfig, store: DualTierStore, chunk_size: int, model_name: str, dtype: torch.dtype,
                   layout: str) -> ChunkSource:
    """The store's chunks of this vLLM (TP = PP = 1, no cache salt) as the adapter keys them (the
    module docstring)."""
    space = cfg.key_space(model=model_name, dtype=dtype, chunk_size=chunk_size,
                          layout=fp.qualified(layout, fp.kv_rank(1, 0)))
    return ChunkSource(store, space, chunk_size)
