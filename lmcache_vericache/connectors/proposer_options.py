"""Options of the compressed-KV proposer (:mod:`.proposer`).

vLLM forbids extra keys in the speculative config, so they come from ``--additional-config
'{"vericache_proposer": {...}}'`` or, key by key as a fallback, from ``VERICACHE_PROPOSER_<KEY>``
environment variables (``additional_config`` wins); a bad key or value raises ``ValueError`` naming
it as its source spells it, before any model work:

* ``compressor`` (str, default ``"int8"``) and ``compressor_params`` (JSON object): registry method
  (without the package's KV connector; with it, the store's compressor and chunk size apply);
* ``chunk_size`` (int, default 128): tokens compressed together, once the chunk is complete;
* ``window`` (int, default 0): newest tokens always kept exact besides the open chunk;
* ``max_draft`` (int, 1..k, default k): most tokens drafted per step;
* ``adaptive`` (bool, default true): the draft length of each step from measured costs and
  acceptance (:mod:`.draft_states`), 0 where drafting does not pay (also where its bytes bound
  rules it out); false: always ``max_draft``;
* ``draft_cache_bytes`` (int >= 0 or ``"auto"``, the default): most bytes the draft caches hold; a
  request whose cache would pass it is not drafted that step (:mod:`.draft_budget`);
* ``int8_draft``, ``codebook_draft``, ``triton_draft`` (bool or null, the default: auto): how a draft
  cache keeps its prefix (:mod:`~lmcache_vericache.engine.draft_cache`: int8 or TurboQuant codes
  read by the CPU kernels, stored chunks read by the Triton kernels on CUDA); ``true`` where that
  cannot be is a start-up error naming why;
* ``lmcache_store`` (JSON object or null, the default) and ``lmcache_chunk_size`` (int, default
  256): beside LMCache's MP server (vLLM's ``LMCacheMPConnector``), the VeriCache L2 adapter's
  ``adapter_params`` and the server's ``--chunk-size``: drafts read the compressed chunks the server
  stored (:mod:`.lmcache_source`). Ignored where the package's own KV connector runs (its store applies).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import compressors
from ..options import parse_options

CONFIG_KEY = "vericache_proposer"
ENV_PREFIX = "VERICACHE_PROPOSER_"


@dataclass(frozen=True)
class ProposerOptions:
    compressor: str = "int8"
    compressor_params: dict[str, Any] = field(default_factory=dict)
    chunk_size: int = 128
    window: int = 0
    max_draft: int | None = None  # None: num_speculative_tokens
    adaptive: bool = True
    draft_cache_bytes: int | str = "auto"
    int8_draft: bool | None = None
    codebook_draft: bool | None = None
    triton_draft: bool | None = None
    lmcache_store: dict[str, Any] | None = None
    lmcache_chunk_size: int = 256

    def validate(self) -> None:
        """Raises ``ValueError`` whose message starts with the offending option's name."""
        for name in ("int8_draft", "codebook_draft", "triton_draft"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true, false or null (auto), got {value!r}")
        b = self.draft_cache_bytes
        if b != "auto" and not (isinstance(b, int) and b >= 0):
            raise ValueError(f'draft_cache_bytes must be an int >= 0 or "auto", got {b!r}')
        if self.lmcache_store is not None:
            from .lmcache_source import store_config

            store_config(self.lmcache_store, where="lmcache_store", prefix=f"{CONFIG_KEY}.lmcache_store.")
        for name, low in (("chunk_size", 1), ("window", 0), ("max_draft", 1), ("lmcache_chunk_size", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        try:
            compressors.get(self.compressor, **self.compressor_params)
        except (ValueError, TypeError) as e:
            name = "compressor_params" if self.compressor in compressors.available() else "compressor"
            raise ValueError(f"{name}: {e}") from None

    @classmethod
    def load(cls, additional_config: Mapping[str, Any] | None, env: Mapping[str, str], k: int) -> ProposerOptions:
        """Options from ``additional_config[CONFIG_KEY]`` over ``VERICACHE_PROPOSER_*``; a bad key or
        value raises ``ValueError`` naming it as its source spells it."""
        given = (additional_config or {}).get(CONFIG_KEY) or {}
        if not isinstance(given, Mapping):
            raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a JSON object, got {given!r}")
        from_env = {var[len(ENV_PREFIX):].lower(): _parse_env(var, raw) for var, raw in env.items()
                    if var.startswith(ENV_PREFIX)}
        # Each source alone first, so a mistake is named the way its source spells it.
        parse_options(cls, from_env, where="environment", spell=lambda n: ENV_PREFIX + n.upper())
        opts = parse_options(cls, {**from_env, **given}, where="additional_config", prefix=f"{CONFIG_KEY}.")
        if opts.max_draft is not None and opts.max_draft > k:
            key = f"{CONFIG_KEY}.max_draft" if "max_draft" in given else ENV_PREFIX + "MAX_DRAFT"
            raise ValueError(f"{key}={opts.max_draft} exceeds num_speculative_tokens={k}")
        return opts


def _parse_env(var: str, raw: str) -> Any:
    """An environment value: JSON where it parses (numbers, booleans, objects), else the string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw

