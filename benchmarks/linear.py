"""The linear layers of one forward, per path: PyTorch's ``F.linear`` (the baseline, same run)
against the package's few-rows kernel (`engine/kernels/linear.cpp`), at the row counts of decode
steps and verify blocks (batch x block tokens).

Shapes are SmolLM2-135M's (hidden 576, MLP 1536, 9 query / 3 KV heads of 64; 30 layers: q, k, v,
o, gate, up, down), each layer with its own weights so they stream from memory as in a real
forward; the two paths alternate repeat by repeat so machine noise hits them alike. Prints a line
per (dtype, rows) and saves JSON (medians, ratio, GFLOP/s, CPU flags).

    .venv/bin/python benchmarks/linear.py
    .venv/bin/python benchmarks/linear.py --rows 1 8 136 --dtypes bfloat16 --reps 15
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import interleaved_medians_ms, machine_info, save_rows, say  # noqa: E402

from lmcache_vericache.engine import kernels  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, MLP, KV = 576, 1536, 192
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]


def _forward(linear, weights: list[list[torch.Tensor]], x: dict[int, torch.Tensor]) -> None:
    """Every layer's weights applied to the input of their width."""
    for layer in weights:
        for w in layer:
            linear(x[w.shape[1]], w)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 17, 34, 68, 136, 256])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=9, help="forwards per path and row count")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--name", default="linear")
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.layers < 1 or args.reps < 1:
        p.error("--rows, --layers and --reps must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    mod = kernels.build("linear")
    if mod is None:
        p.error("the linear kernel cannot be built here (see the warning above)")

    out: dict = {"args": vars(args), **machine_info(), "rows": []}
    jobs = [(d, m) for d in args.dtypes for m in args.rows]
    g = torch.Generator().manual_seed(0)
    for n, (dtype, rows) in enumerate(jobs):
        dt = getattr(torch, dtype)
        weights = [[torch.randn(o, i, generator=g).to(dt) for o, i in SHAPES] for _ in range(args.layers)]
        x = {i: torch.randn(rows, i, generator=g).to(dt) for i in (HIDDEN, MLP)}  # the weights' dtype, as the engine passes x
        paths = {"torch": partial(_forward, F.linear, weights, x), "kernel": partial(_forward, mod.linear, weights, x)}
        med = interleaved_medians_ms(paths, args.reps)
        flops = 2 * rows * args.layers * sum(o * i for o, i in SHAPES)
        row = {"dtype": dtype, "rows": rows, "median_ms": med, "speedup_vs_torch": med["torch"] / med["kernel"],
               "gflops": {name: flops / ms / 1e6 for name, ms in med.items()}}
        out["rows"].append(row)
        say(f"[{n + 1}/{len(jobs)}] {dtype} {rows} rows: torch {med['torch']:.1f} ms, kernel {med['kernel']:.1f} ms"
            f" ({row['speedup_vs_torch']:.2f}x; {row['gflops']['kernel']:.0f} GFLOP/s)")
    save_rows(RESULTS, args.name, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
