"""Attention of a decode token or verify block over the entries before it, per path: PyTorch's CPU flash kernel
(the baseline, same run) against the package's dense kernel (`engine/kernels/dense_attention.cpp`)
with fp32 arithmetic and, on CPUs with AVX512-BF16, with bf16 pair dot products (`dpbf16`).

Shapes are SmolLM2-135M's (3 KV heads, head size 64, 3 query heads per KV head) at a verify block of
``--block`` tokens (51 rows per KV head for 17; ``--block 1``: a decode step). The KV is DRAM-resident, not cache-hot: each call
reads one of ``--caches`` distinct caches in turn (8k entries of bf16 KV are 6 MB per layer, the
L2/L3 caches hold a few), and the paths are interleaved call by call so machine noise hits them
alike. Prints a line per context and saves JSON (medians, ratio against flash, CPU flags).

    .venv/bin/python benchmarks/attention.py                # 1k-8k, bf16 and fp32
    .venv/bin/python benchmarks/attention.py --contexts 8192 --dtypes bfloat16 --reps 200
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import interleaved_medians_ms, machine_info, save_rows, say  # noqa: E402

from lmcache_vericache.engine import kernels  # noqa: E402
from lmcache_vericache.engine.runtime import _flash_lse  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _paths(mod, q: torch.Tensor, dtype: torch.dtype, scale: float) -> dict[str, Callable]:
    """name -> f(k, v) for each path this CPU has."""
    paths = {"flash": partial(_flash_lse, q.to(dtype), scale=scale),
             "kernel_fp32": partial(mod.dense_attention, q, scale=scale, dpbf16=False)}
    if dtype == torch.bfloat16 and mod.dpbf16:
        paths["kernel_dpbf16"] = partial(mod.dense_attention, q, scale=scale, dpbf16=True)
    if dtype == torch.bfloat16 and mod.amx:
        paths["kernel_amx"] = partial(mod.dense_attention, q, scale=scale, amx=True)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--block", type=int, default=17, help="verify block tokens (rows = 3 x block per KV head)")
    p.add_argument("--heads", type=int, default=3, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64, choices=[64, 128])
    p.add_argument("--caches", type=int, default=40, help="distinct caches read in turn (DRAM-resident KV)")
    p.add_argument("--reps", type=int, default=100, help="calls per path and context")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--name", default="attention")
    args = p.parse_args(argv)
    for name in ("block", "heads", "caches", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if min(args.contexts) < 1:
        p.error("--contexts must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    mod = kernels.build("dense_attention")
    if mod is None:
        p.error("the dense kernel cannot be built here (see the warning above)")

    rows_per_head = 3 * args.block
    out: dict = {"args": vars(args), **machine_info(), "dpbf16_available": bool(mod.dpbf16), "rows": []}
    jobs = [(d, s) for d in args.dtypes for s in args.contexts]
    for n, (dtype, ctx) in enumerate(jobs):
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(ctx)
        scale = args.head_dim ** -0.5
        q = torch.randn(args.heads, rows_per_head, args.head_dim, generator=g).to(dt).float()
        kv = [(torch.randn(args.heads, ctx, args.head_dim, generator=g).to(dt),
               torch.randn(args.heads, ctx, args.head_dim, generator=g).to(dt)) for _ in range(args.caches)]
        paths = _paths(mod, q, dt, scale)
        med = interleaved_medians_ms(paths, args.reps, kv)
        row = {"dtype": dtype, "context": ctx, "rows_per_head": rows_per_head, "median_ms": med,
               "speedup_vs_flash": {name: med["flash"] / ms for name, ms in med.items() if name != "flash"}}
        out["rows"].append(row)
        say(f"[{n + 1}/{len(jobs)}] {dtype} {ctx}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items())
            + " | vs flash " + ", ".join(f"{k} {v:.2f}x" for k, v in row["speedup_vs_flash"].items()))
    save_rows(RESULTS, args.name, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
