"""Shared by the benchmarks: prompt prefixes served from a store, as the dual tier serves a shared
prefix, without paying their prefill in every run.

:func:`prefix_kvs` computes each prompt's exact KV once per model weights and dtype (chunk by chunk,
as a prefill does) and keeps it on disk; :func:`stored_prompts` puts the chunks of a batch of
prompts into a fresh memory store, which compresses them with the method under test. Causal
attention makes the KV of a shorter prefix the leading slice of a longer one's, so one file (of the
longest context a run asks for) serves every shorter context of that run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import blake3
import torch
from machine import say

from lmcache_vericache.backends import DualTierStore, StoreConfig
from lmcache_vericache.backends.keys import model_fingerprint
from lmcache_vericache.engine import Sampling, VeriCacheEngine

DEFAULT_DIR = Path.home() / ".cache/lmcache_vericache/bench-prefix"


def prefix_kvs(model: torch.nn.Module, dtype: str, prompts: dict[str, list[int]],
               cache_dir: Path = DEFAULT_DIR, chunk_size: int = 256) -> list[torch.Tensor]:
    """Exact KV ``[2, layers, tokens, heads*dim]`` (CPU) of each named prompt, in order. A file is
    named by the weights' digest, dtype, torch version, prefill chunk size, length, name and a
    digest of the token ids (a changed tokenizer, source file or kernel library is a new file,
    never stale KV); read back memory-mapped."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    fp = model_fingerprint(model)[:16]
    build = blake3.blake3(f"{torch.__version__}/{chunk_size}".encode()).hexdigest()[:8]
    paths = {name: cache_dir / (f"{fp}-{dtype}-{build}-{len(ids)}-{name.replace('/', '_')}-"
                                f"{blake3.blake3(repr(ids).encode()).hexdigest()[:12]}.pt")
             for name, ids in prompts.items()}
    todo = [name for name, path in paths.items() if not path.exists()]
    eng, t0 = VeriCacheEngine(model, "int8", store="resident", chunk_size=chunk_size), time.perf_counter()
    for j, name in enumerate(todo):
        left = f", about {(time.perf_counter() - t0) / j * (len(todo) - j) / 60:.1f} min left" if j else ""
        say(f"{dtype}: exact KV of {name} ({len(prompts[name])} tokens, {j + 1}/{len(todo)}; once, kept in "
            f"{cache_dir}){left}")
        [r] = eng.setup_requests([prompts[name]], 1, Sampling(), 0, draft=False)
        tmp = paths[name].with_suffix(f".tmp{os.getpid()}")
        torch.save(r.full.to_2ltd(0, len(prompts[name])).cpu().contiguous(), tmp)
        tmp.replace(paths[name])  # atomic: an interrupted run leaves no half file under the real name
    return [torch.load(paths[name], mmap=True, map_location="cpu") for name in prompts]


def stored_prompts(model: torch.nn.Module, method: str, params: dict, prompts: list[list[int]],
                   kvs: list[torch.Tensor], chunk_size: int = 256) -> DualTierStore:
    """A memory store holding every full chunk of ``prompts`` (KV: the leading entries of ``kvs``)
    and its ``method`` compression, keyed as the engine keys them. The caller closes it."""
    store = StoreConfig.parse(dict(compressor=method, compressor_params=params, memory_bytes=64 << 30,
                                   hot_bytes=8 << 30), where="benchmark store").with_heads(
        model.config.num_key_value_heads).build()
    keys_of = VeriCacheEngine(model, store=store, chunk_size=chunk_size).chunk_keys
    for ids, kv in zip(prompts, kvs):
        for i, key in enumerate(keys_of(ids)[:kv.shape[2] // chunk_size]):  # whole chunks the KV covers
            store.put(key, kv[:, :, i * chunk_size:(i + 1) * chunk_size].contiguous(), start=i * chunk_size)
    return store
