"""Draft/verify engine: compressed-KV drafting, full-KV verification, swap overlapped with drafting.

Modules: ``vericache_engine`` (the facade: construct, generate, reference), ``config`` (its
options), ``admission`` (which requests get caches, their set-up), ``rounds`` (draft -> swap ->
verify -> commit), ``request`` (per-request state), ``residency`` (where the full KV lives),
``prefill`` (a new request's caches), ``cache`` (KV caches and the draft layout), ``runtime`` (the
forward), ``model`` / ``hf_model`` (the model interface and its Hugging Face adapter), ``swap``,
``verify``, ``horizon``, ``ngram`` (the prompt-lookup proposer).

>>> from lmcache_vericache.engine import VeriCacheEngine
>>> eng = VeriCacheEngine(model, "streamingllm", {"keep_ratio": 0.25}, draft_len="auto")
>>> [res] = eng.generate(prompt_ids, max_new_tokens=128)      # greedy; lossless
>>> res.tokens, res.stats.mean_accepted, res.stats.hidden_swap_fraction
>>> [ref] = eng.reference(prompt_ids, max_new_tokens=128)     # plain full-KV decoding, same runtime
>>> eng = VeriCacheEngine(model, "int8", store={"capacity": "redis",   # shared prefix cache
...                                           "redis_url": "redis://127.0.0.1:6379/0"})
"""

from .cache import KVCache
from .config import EngineConfig
from .hf_model import HfModel
from .horizon import Horizon
from .model import DecoderModel
from .ngram import NgramProposer
from .request import RequestStats, Result
from .runtime import Runtime, Segment
from .swap import Source, SwapIn
from .vericache_engine import VeriCacheEngine
from .verify import Sampling, accept

__all__ = [
    "DecoderModel", "EngineConfig", "HfModel", "Horizon", "KVCache", "NgramProposer", "RequestStats", "Result", "Runtime",
    "Sampling", "Segment", "Source", "SwapIn", "VeriCacheEngine", "accept",
]
