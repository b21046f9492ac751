"""``vericache compressors``: every registered method on the real SmolLM2 KV of a real file.

Prefills ``--tokens`` tokens of the file plus a ``--window`` of observation tokens, compresses the
first ``--tokens`` chunk by chunk (256-token LMCache chunks, each with its ``start``) with every
method at each of its example parameter sets, and prints ratio, K/V reconstruction error and the
error of the window queries' attention output (see ``lmcache_vericache.kv_metrics``).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("compressors", help="compress real SmolLM2 KV with every method; ratios and errors",
                              description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--file", help="text file to prefill (default: a Python stdlib file)")
    src.add_argument("--stdlib", default=None, metavar="NAME",
                     help="standard library file, relative to the stdlib folder (default: argparse.py)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens compressed (default 1024)")
    p.add_argument("--window", type=int, default=32, help="observation queries after them, kept full (default 32)")
    p.add_argument("--methods", default=None, help="comma-separated method names (default: all registered)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")


def format_params(params: dict) -> str:
    """``{"bits": 2}`` -> ``bits=2``, compact for tables."""
    return ",".join(f"{k}={v}" for k, v in params.items()) or "(defaults)"


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from .. import compressors
    from ..data import prompt_ids, stdlib_path
    from ..kv_metrics import CHUNK_SIZE, evaluate
    from ..models import load_model, prefill_kv

    names = compressors.available()
    chosen = names if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown or not chosen:
        print(f"vericache compressors: unknown method(s) {unknown}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    if args.tokens <= 0 or args.window <= 0:
        print("vericache compressors: --tokens and --window must be > 0", file=sys.stderr)
        return 2
    try:
        path = Path(args.file) if args.file else stdlib_path(args.stdlib or "argparse.py")
        text = path.read_text(encoding="utf-8")
        model, tok = load_model("smollm2")
        ids = prompt_ids(tok, text, args.tokens + args.window)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"vericache compressors: {e}", file=sys.stderr)
        return 2

    torch.set_grad_enabled(False)
    kv, queries = prefill_kv(model, ids, window=args.window)
    heads = model.config.num_key_value_heads
    rows = []
    for name in chosen:
        for params in compressors.examples(name):
            m = evaluate(compressors.get(name, **params), kv, heads, queries)
            rows.append({"method": name, "params": params, **m})

    if args.json:
        print(json.dumps({"file": str(path), "tokens": args.tokens, "window": args.window,
                          "chunk_size": CHUNK_SIZE, "rows": rows}, indent=1))
        return 0
    print(f"SmolLM2-135M fp32 KV of {path.name}: {args.tokens} tokens compressed in {CHUNK_SIZE}-token chunks, "
          f"last {args.window} tokens' queries over compressed + full window")
    width = max(len("params"), *(len(format_params(r["params"])) for r in rows))
    head = f"{'method':<14} {'params':<{width}} {'ratio':>6} {'kept':>5} {'K err':>7} {'V err':>7} {'attn err':>8}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['method']:<14} {format_params(r['params']):<{width}} {r['ratio']:>6.2f} {r['kept']:>5.2f} "
              f"{r['k_err']:>7.4f} {r['v_err']:>7.4f} {r['attn_err']:>8.4f}")
    return 0
