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
from ..backends.lmcache.fused_planes import layout_name
from .worker_context import ChunkSource

#: ``lmcache_store`` keys that only the adapter reads (how the server untiles planes).
ADAPTER_ONLY = ("vllm_cpu_tiling", "vllm_cpu_block_size")


def store_config(params: Mapping[str, Any], where: str = "lmcache_store", prefix: str = "lmcache_store.") -> StoreConfig:
    """The store config of the adapter's ``adapter_params`` (validated; errors start with ``where``
    and name the key as ``prefix + key``)."""
    if not isinstance(params, Mapping):
        raise ValueError(f"{where} must be a JSON object (the L2 adapter's adapter_params), got {params!r}")
    return StoreConfig.parse({k: v for k, v in params.items() if k not in ADAPTER_ONLY}, where=where, prefix=prefix)


def lmcache_source(params: Mapping[str, Any], chunk_size: int, model_name: str, dtype: torch.dtype, isa: str,
                   num_kv_heads: int) -> ChunkSource:
    """The adapter's store and the key space of this vLLM's chunks in it (the module docstring)."""
    cfg = store_config(params).with_heads(num_kv_heads, where="lmcache_store")
    space = cfg.key_space(model=model_name, dtype=dtype, chunk_size=chunk_size, layout=layout_name(isa))
    return ChunkSource(cfg.build(), space, chunk_size)
