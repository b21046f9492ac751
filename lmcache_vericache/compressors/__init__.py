"""KV compressors: one method per file, all behind one interface and one registry.

>>> from lmcache_vericache import compressors
>>> compressors.available()            # method names
>>> compressors.examples("kivi")       # its example parameter sets: [{"bits": 2}, ...]
>>> c = compressors.get("kivi", bits=2)
>>> ckv = c.compress(kv, num_kv_heads=3)  # kv: [2, L, T, H*D]
>>> layers = c.decompress(ckv)            # per layer: keys, values, positions
>>> ckv = compressors.from_bytes(blob)    # untrusted bytes: framing and digest checked ...
>>> compressors.validate(ckv)             # ... and meaning (CodecError otherwise; see codec.py)
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from .base import CompressedKV, CompressionContext, KVCompressor, KVQuantizer, LayerKV, TokenEvictor
from .codec import CodecError, from_bytes, to_bytes, validate

_REGISTRY: dict[str, type[KVCompressor]] = {}

# One module per method; importing it registers the class.
_METHOD_MODULES = (
    "identity",
    "streamingllm",
    "snapkv",
    "h2o",
    "pyramidkv",
    "kvzip",
    "poissoncomp",
    "int8",
    "int4",
    "fp8",
    "kivi",
    "turboquant",
    "rotatekv",
    "compose",
)


def register(cls: type[KVCompressor]) -> type[KVCompressor]:
    """Class decorator adding a method to the registry under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"compressor name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    for mod in _METHOD_MODULES:
        importlib.import_module(f"{__name__}.{mod}")


def available() -> list[str]:
    """Names of every registered method."""
    _load_all()
    return sorted(_REGISTRY)


def _method(name: str) -> type[KVCompressor]:
    _load_all()
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return cls


def examples(name: str) -> list[dict[str, Any]]:
    """The example parameter sets of method ``name`` (copies; the first is its default use), as
    ``get(name, **params)`` takes them. Unknown names raise ``ValueError``."""
    return [dict(params) for params in _method(name).examples]


def get(name: str, **params: Any) -> KVCompressor:
    """Build method ``name`` with ``params``; unknown names or bad parameters raise ``ValueError``."""
    cls = _method(name)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(params) - fields
    if unknown:
        raise ValueError(f"compressor {name!r} has no parameter(s) {sorted(unknown)}; valid: {sorted(fields)}")
    try:
        return cls(**params)
    except TypeError as e:
        raise ValueError(f"bad parameters for compressor {name!r}: {e}") from e


def decompress(ckv: CompressedKV) -> list[LayerKV]:
    """Reconstruct a chunk with the method recorded in it (untrusted chunks: ``validate`` first)."""
    return get(ckv.method, **ckv.params).decompress(ckv)


__all__ = [
    "CodecError",
    "CompressedKV",
    "CompressionContext",
    "KVCompressor",
    "KVQuantizer",
    "LayerKV",
    "TokenEvictor",
    "available",
    "decompress",
    "examples",
    "from_bytes",
    "get",
    "register",
    "to_bytes",
    "validate",
]
