"""Draft/verify engine: compressed-KV drafting, full-KV verification, swap overlapped with drafting.

Modules: ``scheduler`` (the engine: rounds), ``prefill`` (a new request's caches), ``cache`` (KV
caches and the draft layout), ``runtime`` (the forward), ``model`` / ``hf_model`` (the model
interface and its Hugging Face adapter), ``swap``, ``verify``, ``horizon``, ``proposer``, ``request``.

>>> from lmcache_vericache.engine import VeriCacheEngine
>>> eng = VeriCacheEngine(model, "streamingllm", {"keep_ratio": 0.25}, draft_len="auto")
>>> [res] = eng.generate(prompt_ids, max_new_tokens=128)      # greedy; lossless
>>> res.tokens, res.stats.mean_accepted, res.stats.hidden_swap_fraction
>>> [ref] = eng.reference(prompt_ids, max_new_tokens=128)     # plain full-KV decoding, same runtime
>>> eng = VeriCacheEngine(model, "int8", store={"capacity": "redis",   # shared prefix cache
...                                           "redis_url": "redis://127.0.0.1:6379/0"})
"""

from .cache import KVCache
from .hf_model import HfModel
from .horizon import Horizon
from .model import DecoderModel
from .proposer import NgramProposer
from .request import RequestStats, Result
from .runtime import Runtime, Segment
from .scheduler import VeriCacheEngine
from .swap import Source, SwapIn
from .verify import Sampling, accept

__all__ = [
    "DecoderModel", "HfModel", "Horizon", "KVCache", "NgramProposer", "RequestStats", "Result", "Runtime",
    "Sampling", "Segment", "Source", "SwapIn", "VeriCacheEngine", "accept",
]
