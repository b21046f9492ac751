"""Remote prefix caching end to end: two ``vericache generate`` processes share one real Redis-backed
store (``--store-config``). The first generates from prompt A (a long real stdlib prefix + a tail)
and stores its chunks; the second generates from prompt B (the same prefix, another tail): it takes
the prefix's compressed chunks from Redis instead of prefilling them, drafts while the full chunks
prefetch, and its output equals plain full-KV greedy decoding of B (``--reference``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_vericache.data import stdlib_source

pytestmark = pytest.mark.e2e
CHUNK = 256


def _prompt_files(tmp_path: Path) -> tuple[Path, Path]:
    # ~1.2k tokens of json/decoder.py, then two different real tails (~150 tokens each).
    src = stdlib_source("json/decoder.py")
    prefix = src[:src.index("\n", 4200) + 1]
    tails = [stdlib_source("textwrap.py")[:600], stdlib_source("json/encoder.py")[:600]]
    paths = [tmp_path / "a.py", tmp_path / "b.py"]
    for path, tail in zip(paths, tails):
        path.write_text(prefix + "\n\n" + tail)
    return paths[0], paths[1]


def _generate(prompt: Path, store_config: dict, n_new: int, *extra: str) -> dict:
    cmd = [sys.executable, "-c", "from lmcache_vericache.cli import main; raise SystemExit(main())", "generate",
           "--compressor", "streamingllm", "--compressor-params", '{"keep_ratio": 0.25}',
           "--prompt-file", str(prompt), "--prompt-tokens", "0", "--max-new-tokens", str(n_new),
           "--draft-len", "auto", "--store-config", json.dumps(store_config), "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_second_process_reuses_the_shared_prefix_losslessly(redis_server, tmp_path):  # noqa: F811
    store = {"capacity": "redis", "redis_url": redis_server.url, "redis_prefix": f"shared-{tmp_path.name}:"}
    path_a, path_b = _prompt_files(tmp_path)
    a = _generate(path_a, store, 32)
    b = _generate(path_b, store, 128, "--reference")

    common = next(i for i, (x, y) in enumerate(zip(a["prompt_tokens"], b["prompt_tokens"])) if x != y)
    shared = min(common // CHUNK, (len(b["prompt_tokens"]) - 1) // CHUNK)
    assert shared >= 4 and len(b["prompt_tokens"]) - shared * CHUNK > 100  # a long prefix and a real tail
    assert a["cached_chunks"] == 0 and a["store"]["puts"] == len(a["prompt_tokens"]) // CHUNK
    assert b["cached_chunks"] == shared  # B skipped the prefill of every chunk it shares with A
    assert b["store"]["compressed_hits"] >= shared and b["store"]["full_hits"] >= shared
    assert b["recomputed_chunks"] == 0
    assert b["identical"] is True and b["tokens"] == b["reference_tokens"] and len(b["tokens"]) == 128
    print(f"\nA: prefill {a['prefill_s']:.2f} s, first token {a['ttft_s']:.2f} s | "
          f"B: {b['cached_chunks']} chunks reused, set-up {b['prefill_s']:.2f} s, first token {b['ttft_s']:.2f} s, "
          f"{b['mean_accepted']:.1f} tokens/round, swap hidden {100 * b['hidden_swap_fraction']:.0f}%")
