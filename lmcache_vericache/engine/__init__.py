"""Draft/verify engine: compressed-KV drafting, full-KV verification, swap overlapped with drafting.

>>> from lmcache_vericache.engine import VeriCacheEngine
>>> eng = VeriCacheEngine(model, "streamingllm", {"keep_ratio": 0.25}, draft_len="auto")
>>> [res] = eng.generate(prompt_ids, max_new_tokens=128)      # greedy; lossless
>>> res.tokens, res.stats.mean_accepted, res.stats.hidden_swap_fraction
>>> [ref] = eng.reference(prompt_ids, max_new_tokens=128)     # plain full-KV decoding, same runtime
>>> eng = VeriCacheEngine(model, "int8", store={"capacity": "redis",   # shared prefix cache
...                                           "redis_url": "redis://127.0.0.1:6379/0"})
"""

from .engine import VeriCacheEngine
from .horizon import Horizon
from .proposer import NgramProposer
from .request import RequestStats, Result
from .runtime import KVCache, Runtime, Segment
from .swap import Source, SwapIn
from .verify import Sampling, accept

__all__ = [
    "Horizon", "KVCache", "NgramProposer", "RequestStats", "Result", "Runtime", "Sampling", "Segment", "Source",
    "SwapIn", "VeriCacheEngine", "accept",
]
