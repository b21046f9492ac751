"""Compressor throughput on a realistic chunk: SmolLM2 KV of one 256-token LMCache chunk of a real file
([2, 30, 256, 192]), fp32 and bf16.

Per method and example parameter set: compression ratio, encode (``compress``) and decode
(``decompress``) throughput in GB/s of full KV, medians over ``--reps``; and, in the same run, the
yardstick: a plain ``clone()`` of the same chunk (GB/s of full KV, so the same unit), timed interleaved
with each method so that both see the same load on a shared machine. Goal for pure
quantizers: encode and decode each >= 1 GB/s. Eviction methods get the chunk's observation-window
queries (the 32 tokens after it), as in ``vericache compressors``.

    .venv/bin/python benchmarks/compressors.py [--methods a,b] [--reps 7] [--dtypes fp32,bf16] [--threads N]

Prints a table and writes benchmarks/results/compressors.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from lmcache_vericache import compressors
from lmcache_vericache.cli.compressors import format_params
from lmcache_vericache.data import prompt_ids, stdlib_source
from lmcache_vericache.models import load_model, prefill_kv

CHUNK, WINDOW, GOAL_GBPS = 256, 32, 1.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OUT = Path(__file__).parent / "results" / "compressors.json"


def median_s(fns, reps: int) -> list[float]:
    """Median seconds of each of ``fns``, run interleaved rep by rep: the machine is shared, so the
    yardstick runs in the same moments as the method it is compared with."""
    for fn in fns:
        fn()  # warm-up: first-call allocations and lazy imports are not throughput
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", help="comma-separated method names (default: all registered)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, from: fp32, bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    names = compressors.available() if not args.methods else args.methods.split(",")
    dtypes = args.dtypes.split(",")
    bad = sorted(set(names) - set(compressors.available())) + sorted(set(dtypes) - set(DTYPES))
    if bad or args.reps < 1:
        raise SystemExit(f"unknown method/dtype {bad} or reps < 1; methods: {compressors.available()}")

    torch.set_grad_enabled(False)
    if args.threads > 0:  # on a busy shared machine, 1 thread is far less disturbed than 2
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2")
    kv_full, queries = prefill_kv(model, prompt_ids(tok, stdlib_source("argparse.py"), CHUNK + WINDOW), WINDOW)
    heads = model.config.num_key_value_heads
    del model

    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was
    copies, rows = {}, []
    for dname in dtypes:
        kv = kv_full[:, :, :CHUNK].to(DTYPES[dname]).contiguous()
        gb = kv.numel() * kv.element_size() / 1e9
        for name in names:
            for params in compressors.examples(name):
                comp = compressors.get(name, **params)
                ckv = comp.compress(kv, heads, queries=queries)
                copy, enc, dec = (gb / t for t in median_s(
                    [kv.clone, partial(comp.compress, kv, heads, queries=queries), partial(comp.decompress, ckv)],
                    args.reps))
                copies.setdefault(dname, []).append(copy)
                quant_only = comp.quantizer() is not None and comp.evictor() is None
                rows.append({
                    "dtype": dname, "method": name, "params": params, "ratio": ckv.ratio,
                    "encode_gbps": enc, "decode_gbps": dec, "copy_gbps": copy,
                    "encode_vs_copy": enc / copy, "decode_vs_copy": dec / copy,
                    "goal_met": (min(enc, dec) >= GOAL_GBPS) if quant_only else None,
                })
    copy_gbps = {d: statistics.median(c) for d, c in copies.items()}

    width = max(len(format_params(r["params"])) for r in rows)
    head = (f"{'dtype':<5} {'method':<12} {'params':<{width}} {'ratio':>6} {'enc GB/s':>8} {'dec GB/s':>8} "
            f"{'enc/copy':>8} {'dec/copy':>8} {'goal':>4}")
    load = (load_before, os.getloadavg()[0])
    print(f"chunk [2, 30, {CHUNK}, 192], median of {args.reps}, {torch.get_num_threads()} threads, load average "
          f"{load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} CPUs; copy (clone) GB/s, median over rows: "
          + ", ".join(f"{d} {g:.2f}" for d, g in copy_gbps.items()))
    print(head + "\n" + "-" * len(head))
    for r in rows:
        goal = "-" if r["goal_met"] is None else ("yes" if r["goal_met"] else "NO")
        print(f"{r['dtype']:<5} {r['method']:<12} {format_params(r['params']):<{width}} {r['ratio']:>6.2f} "
              f"{r['encode_gbps']:>8.3f} {r['decode_gbps']:>8.3f} {r['encode_vs_copy']:>8.3f} "
              f"{r['decode_vs_copy']:>8.3f} {goal:>4}")
    quant = [r for r in rows if r["goal_met"] is not None]
    met = sorted({f"{r['dtype']} {r['method']}({format_params(r['params'])})" for r in quant if r["goal_met"]})
    missed = sorted({f"{r['dtype']} {r['method']}({format_params(r['params'])})" for r in quant if not r["goal_met"]})
    print(f"goal (quantizers encode and decode >= {GOAL_GBPS} GB/s): met by {len(quant) - len(missed)}/{len(quant)}; "
          f"missed: {', '.join(missed) or 'none'}")

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "benchmark": "compressors", "chunk_shape": [2, 30, CHUNK, 192], "reps": args.reps, "statistic": "median",
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "platform": platform.platform(), "load_average": load},
        "copy_gbps": copy_gbps, "goal_gbps": GOAL_GBPS, "goal_met": met, "goal_missed": missed, "rows": rows,
    }, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
