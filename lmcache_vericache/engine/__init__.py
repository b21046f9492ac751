"""Draft/verify engine: compressed-KV drafting, full-KV verification, swap overlapped with drafting.

>>> from lmcache_vericache.engine import VeriCacheEngine
>>> eng = VeriCacheEngine(model, "streamingllm", {"keep_ratio": 0.25}, draft_len="auto")
>>> [res] = eng.generate(prompt_ids, max_new_tokens=128)      # greedy; lossless
>>> res.tokens, res.stats.mean_accepted, res.stats.hidden_swap_fraction
>>> [ref] = eng.reference(prompt_ids, max_new_tokens=128)     # plain full-KV decoding, same runtime
"""

from .engine import VeriCacheEngine
from .horizon import Horizon
from .proposer import NgramProposer
from .request import RequestStats, Result
from .runtime import KVCache, Runtime, Segment
from .swap import FileSource, MemorySource, SwapIn, chunk_keys
from .verify import Sampling, accept

__all__ = [
    "FileSource", "Horizon", "KVCache", "MemorySource", "NgramProposer", "RequestStats", "Result", "Runtime",
    "Sampling", "Segment", "SwapIn", "VeriCacheEngine", "accept", "chunk_keys",
]
