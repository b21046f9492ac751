"""Requests and throughput under one KV budget: full-KV decoding vs VeriCache's offload mode.

The budget holds ``--full-requests`` full-KV caches (prompt + new tokens). Full-KV decoding serves
the ``--requests`` prompts in waves of that many (all it can hold at once); VeriCache in offload mode
(``kv_budget_bytes`` = the same budget) keeps only draft caches resident plus a small pool of verify
buffers, admits as many requests as fit and swaps each one's full prefix in from the store for its
verifications. Reported: requests held at once, peak resident KV, decode tokens/s (prefill excluded)
and whether every request's tokens equal full-KV greedy decoding. On a CPU the budget stands in for
accelerator memory.

    .venv/bin/python benchmarks/budget.py                        # 2k context, budget of 8, 24 requests
    .venv/bin/python benchmarks/budget.py --context 8192 --dtype bfloat16 --prefix stored

``--prefix stored``: the prompts' prefixes are served from a store (their exact KV computed once and
kept on disk, benchmarks/prefixes.py): both sides read them instead of prefilling (a prompt is
``context`` cached positions plus its last token, so the windows are not the computed mode's);
``computed`` (default) prefills them.

Writes benchmarks/results/budget.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from decode import FILES as DECODE_FILES
from decode import divergences
from machine import machine_info, say
from prefixes import DEFAULT_DIR, prefix_kvs, stored_prompts

from lmcache_vericache import compressors
from lmcache_vericache.data import stdlib_source
from lmcache_vericache.engine import VeriCacheEngine
from lmcache_vericache.models import load_model

FILES = DECODE_FILES + ["tkinter/__init__.py", "pickletools.py"]  # the decode benchmark's first: shared prefix KV
OUT = Path(__file__).parent / "results"


def prompts(tok, n_tokens: int, count: int) -> dict[str, list[int]]:
    """``count`` different real prompts, by name: ``n_tokens`` windows of large stdlib files, every
    file's first window first (the decode benchmark's prompts, whose stored KV it shares), then the
    next windows."""
    ids = {f: tok(stdlib_source(f), add_special_tokens=False)["input_ids"] for f in FILES}
    out = {}
    for w in range(max(len(x) for x in ids.values()) // n_tokens):
        out |= {f if w == 0 else f"{f}@{w * n_tokens}": x[w * n_tokens:(w + 1) * n_tokens]
                for f, x in ids.items() if len(x) >= (w + 1) * n_tokens}
        if len(out) >= count:
            return dict(list(out.items())[:count])
    raise ValueError(f"only {len(out)} windows of {n_tokens} tokens in the stdlib files, need {count}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--full-requests", type=int, default=8, help="full-KV caches the budget holds")
    ap.add_argument("--requests", type=int, default=24, help="requests offered")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--compressor", default="streamingllm", help="the method (its first example unless --params)")
    ap.add_argument("--params", type=json.loads, default=None, help="the method's parameters, JSON")
    ap.add_argument("--prefix", default="computed", choices=["computed", "stored"],
                    help="stored: prompt prefixes served from a store (exact KV cached on disk)")
    ap.add_argument("--kv-cache-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--draft-len", default="auto")
    ap.add_argument("--verify-buffers", type=int, default=None, help="offload pool size (default: the engine's)")
    ap.add_argument("--name", default="budget")
    args = ap.parse_args()
    params = compressors.examples(args.compressor)[0] if args.params is None else args.params
    compressors.get(args.compressor, **params)  # unknown names and bad params fail before the model loads
    if min(args.context, args.full_requests, args.requests, args.new_tokens) < 1:
        ap.error("--context, --full-requests, --requests and --new-tokens must be positive")
    draft_len = args.draft_len if args.draft_len == "auto" else int(args.draft_len)

    model, tok = load_model("smollm2", dtype=getattr(torch, args.dtype))
    stored = args.prefix == "stored"
    named = prompts(tok, args.context + stored, args.requests)  # stored: + the last prompt token
    ps = list(named.values())
    store = None
    if stored:
        kvs = prefix_kvs(model, args.dtype, {k: v[:-1] for k, v in named.items()}, args.kv_cache_dir)
        say(f"putting {len(ps)} prompts' chunks into a memory store ({args.compressor})")
        store = stored_prompts(model, args.compressor, params, ps, kvs)
    eng = VeriCacheEngine(model, args.compressor, params, draft_len=draft_len)
    full_bytes = (len(ps[0]) + args.new_tokens + eng.config.max_draft_len + 2) * eng.rt.kv_bytes_per_token()  # as the engine sizes it
    budget = args.full_requests * full_bytes
    VeriCacheEngine(model, "int8", store="resident").reference(ps[:1], 4)  # warm-up

    base = VeriCacheEngine(model, store=store) if stored else VeriCacheEngine(model, "int8", store="resident")
    ref, base_s = [], 0.0
    for i in range(0, len(ps), args.full_requests):  # full-KV decoding: waves of what the budget holds
        say(f"full-KV wave {i // args.full_requests + 1}: requests {i}-{min(i + args.full_requests, len(ps)) - 1}")
        t0 = time.perf_counter()
        wave = base.reference(ps[i:i + args.full_requests], args.new_tokens, stored_prefix=stored)
        base_s += time.perf_counter() - t0 - sum(r.stats.prefill_s for r in wave)
        ref += wave

    say(f"VeriCache offload, {args.compressor}, kv_budget_bytes={budget}")
    vc = VeriCacheEngine(model, None if stored else args.compressor, None if stored else params,
                         draft_len=draft_len, kv_budget_bytes=budget, verify_buffers=args.verify_buffers, store=store)
    t0 = time.perf_counter()
    out = vc.generate(ps, args.new_tokens)
    vc_s = time.perf_counter() - t0 - sum(o.stats.prefill_s for o in out)
    run = vc.last_run
    tokens = sum(len(o.tokens) for o in out)
    row = dict(context=args.context, dtype=args.dtype, method=args.compressor, params=params, prefix=args.prefix,
               ratio=round(statistics.mean(o.stats.compression_ratio for o in out), 2),
               budget_bytes=budget, full_cache_bytes=full_bytes, requests=args.requests,
               full_kv_at_once=args.full_requests, vericache_at_once=run["max_active"],
               vericache_mode=run["full_kv"], verify_buffers=run["verify_buffers"],
               peak_kv_bytes=run["peak_kv_bytes"], full_tok_s=sum(len(r.tokens) for r in ref) / base_s,
               vericache_tok_s=tokens / vc_s,
               identical=all(o.tokens == r.tokens for o, r in zip(out, ref)),
               tokens_per_round=statistics.mean(o.stats.mean_accepted for o in out),
               hidden_swap=statistics.mean(o.stats.hidden_swap_fraction for o in out))
    row.update(divergences(out, ref))  # greedy: where outputs differ, the baseline's margin there
    row["requests_ratio"] = row["vericache_at_once"] / row["full_kv_at_once"]
    row["throughput_ratio"] = row["vericache_tok_s"] / row["full_tok_s"]
    worst = max((d["margin"] for d in row["divergences"]), default=0.0)
    print(f"budget {budget / 2**20:.0f} MiB ({args.full_requests} full-KV requests of {args.context} tokens): "
          f"full-KV {args.full_requests} at once, {row['full_tok_s']:.1f} tok/s | VeriCache {args.compressor} "
          f"{run['full_kv']}: {run['max_active']} at once (x{row['requests_ratio']:.2f}), peak "
          f"{run['peak_kv_bytes'] / 2**20:.0f} MiB, {row['vericache_tok_s']:.1f} tok/s "
          f"(x{row['throughput_ratio']:.2f}), identical {row['identical']}"
          f"{'' if row['identical'] else f' (differing at margins <= {worst:g})'}, "
          f"{row['tokens_per_round']:.1f} tokens/round, swap hidden {100 * row['hidden_swap']:.0f}%", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(dict(meta=dict(**machine_info(), new_tokens=args.new_tokens,
                                                                     draft_len=args.draft_len), rows=[row]), indent=1))


if __name__ == "__main__":
    main()
