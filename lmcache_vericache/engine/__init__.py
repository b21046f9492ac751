"""Draft/verify engine: compressed-KV drafting, full-KV verification, swap overlapped with drafting.

>>> from lmcache_vericache.engine import VeriCacheEngine
>>> eng = VeriCacheEngine(model, "streamingllm", {"keep_ratio": 0.25}, draft_len="auto")
>>> [res] = eng.generate(prompt_ids, max_new_tokens=128)      # greedy; lossless
>>> res.tokens, res.stats.mean_accepted, res.stats.hidden_swap_fraction
>>> [ref] = eng.reference(prompt_ids, max_new_tokens=128)     # plain full-KV decoding, same runtime
>>> store = DualTierStore.from_config({"compressor": "int8", "num_kv_heads": 3, "capacity": "redis",
...                                    "redis_url": "redis://127.0.0.1:6379/0"})
>>> eng = VeriCacheEngine(model, source=store)                 # shared prefix cache across processes
"""

from .engine import VeriCacheEngine
from .horizon import Horizon
from .proposer import NgramProposer
from .request import RequestStats, Result
from .runtime import KVCache, Runtime, Segment
from .swap import Source, SwapIn, chunk_keys, model_fingerprint
from .verify import Sampling, accept

__all__ = [
    "Horizon", "KVCache", "NgramProposer", "RequestStats", "Result", "Runtime", "Sampling", "Segment", "Source",
    "SwapIn", "VeriCacheEngine", "accept", "chunk_keys", "model_fingerprint",
]
