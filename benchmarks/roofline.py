"""The best speed-up VeriCache can have over full-KV decoding on this machine, from its measured limits.

A decode step of a batch reads the weights once and every cached K/V entry once, and per token does
2 flops per weight and 4 per (query head, cached entry, head dimension). On a CPU it takes at least
``max(bytes / bandwidth, flops / compute)``; both rates are measured here, with every thread, each
the best of its repeats: bandwidth from a 1 GiB read, compute the fastest of a compiled fp32 FMA loop
(the CPU's peak), a 3072^3 fp32 GEMM and, for a bf16 model, a 512^3 bf16 GEMM (kernels that widen
bf16 to fp32 run at the fp32 rate; CPUs with bf16 arithmetic run faster). A round of VeriCache is L draft steps over the
draft KV and one verify of L + 1 tokens over the full KV: the verify reads what a full step reads but
does L + 1 tokens' flops. With every draft accepted a round emits L + 1 tokens, so

    speed-up <= max over L <= 32 of (L + 1) t_full / (L t_draft + t_verify(L + 1)),

each t at its limit. Under a KV budget (more requests at once than full-KV decoding fits) each
emitted token still costs a verified token's flops plus, in a round of L drafts, L / (L + 1) of a
draft step's; at L = 1 (the cheapest) VeriCache's throughput at any batch is at most compute / (a
verified token's flops + half a drafted one's), memory traffic not counted: ``budget_throughput_bound``
is that against full-KV decoding's rate at the row's batch.

Every choice leans toward VeriCache, so what exceeds these numbers cannot happen on this machine
against a full-KV decoder that runs at its limits: compute is the fastest rate measured, bandwidth
the best of its repeats (a higher one lowers every bound), and integer products are not counted at
all. The package's own kernels run below the limits on both sides (benchmarks/decode.py measures
the real steps; a measured ratio can exceed these bounds when its full-KV step is further from its
limit than VeriCache's steps are). Drafters: ``int8`` reads every entry's codes (``--int8-bytes``
of fp32's bytes: codes plus per-token scales; its integer products free), ``codebook`` TurboQuant
k4 v3's (``--codebook-bytes``: 3.5 bits of codes and the norms; its products free too), ``evict25`` attends over
a quarter of the entries at full precision, ``no_kv`` reads no KV at all (the weights and their
flops only: what no drafter that runs the model can beat, as every draft step reads the weights).

    .venv/bin/python benchmarks/roofline.py                 # SmolLM2-135M, 1k-8k, batch 1/8, fp32 + bf16

Prints a table, writes benchmarks/results/<name>.json (the rates, CPU flags, every row).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from machine import interleaved_times_s, machine_info, save_rows, say

from lmcache_vericache.engine import kernels
from lmcache_vericache.models import ensure_smollm2

OUT = Path(__file__).parent / "results"
MAX_L = 32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def best_s(fn, reps: int) -> float:
    """The fastest of ``reps`` calls after a warm-up: a machine's limit is what it reaches at its
    best (a shared host's noise only slows a call down)."""
    return min(interleaved_times_s({"fn": fn}, reps)["fn"])


def fma_peak_gflop_s(reps: int) -> float | None:
    """fp32 FMA throughput of every thread (``fma_peak.cpp``, built as the package's kernels are);
    ``None`` where it cannot be built (the GEMM rates stand in)."""
    mod = kernels.build("fma_peak", source=Path(__file__).parent / "fma_peak.cpp")
    if mod is None:
        say("no FMA peak (no compiler?): the GEMM rates stand in")
        return None
    iters = 20_000_000
    return mod.fma_flops(iters) / best_s(lambda: mod.fma_flops(iters), reps) / 1e9


def measure_rates(reps: int) -> dict:
    """Read bandwidth (GB/s), GEMM rates (GFLOP/s, fp32 and bf16) and the fp32 FMA peak, with every
    thread, each the best of ``reps``."""
    x = torch.ones(256 * 2**20)  # 1 GiB: far past every cache
    read = x.numel() * 4 / best_s(x.sum, reps) / 1e9
    rates = {}
    # bf16 at 512: where PyTorch has no fast bf16 GEMM (AVX2) it runs at ~1 GFLOP/s, minutes at 3072
    for dtype, n in ((torch.float32, 3072), (torch.bfloat16, 512)):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        rates[str(dtype).removeprefix("torch.")] = 2 * n**3 / best_s(lambda a=a, b=b: a @ b, reps) / 1e9
    return dict(read_gb_s=read, gemm_gflop_s=rates, fma_peak_gflop_s=fma_peak_gflop_s(reps))


def model_shape(path: Path) -> dict:
    """Parameters read per step and the attention shape, from a Hugging Face ``config.json``."""
    c = json.loads((path / "config.json").read_text())
    hidden, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    kv_heads, head_dim = c.get("num_key_value_heads", heads), c.get("head_dim", hidden // heads)
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * c["intermediate_size"]
    return dict(params=layers * per_layer + c["vocab_size"] * hidden, layers=layers, heads=heads,
                kv_heads=kv_heads, head_dim=head_dim)


def bound(m: dict, rates: dict, dtype: str, batch: int, context: int, entries: float, kv_bytes: float) -> dict:
    """Step times at the limits (ms) and the speed-up bound for a drafter whose step does float
    attention over ``entries`` of the cached entries and reads ``kv_bytes`` of the full KV's bytes."""
    size = DTYPE_BYTES[dtype]
    compute = max(rates.get("fma_peak_gflop_s") or 0, rates["gemm_gflop_s"]["float32"], rates["gemm_gflop_s"][dtype]) * 1e9
    bandwidth = rates["read_gb_s"] * 1e9
    weights = m["params"] * size
    kv = batch * context * m["layers"] * m["kv_heads"] * m["head_dim"] * 2 * size
    linear = 2 * m["params"]
    attention = 4 * context * m["heads"] * m["head_dim"] * m["layers"]
    token = linear + attention  # one token's flops over the full KV

    def t(nbytes: float, flops: float) -> float:
        return max(nbytes / bandwidth, flops / compute)

    full = t(weights + kv, batch * token)
    draft = t(weights + kv * kv_bytes, batch * (linear + attention * entries))

    def speedup(L: int) -> float:  # a round of L drafts and a verify of L + 1 tokens, all accepted
        return (L + 1) * full / (L * draft + t(weights + kv, batch * (L + 1) * token))

    best_l = max(range(1, MAX_L + 1), key=speedup)
    # Under a KV budget VeriCache runs more requests at once, but every emitted token still costs a
    # verified token's flops plus L / (L + 1) of a drafted one's, half at L = 1: at most this at any batch.
    ceiling = compute / (token + (linear + attention * entries) / 2)
    return dict(t_full_ms=1e3 * full, t_draft_ms=1e3 * draft, t_verify_per_token_ms=1e3 * batch * token / compute,
                full_bound_by="bytes" if (weights + kv) / bandwidth >= batch * token / compute else "flops",
                bound=speedup(best_l), bound_L=best_l,
                full_tok_s=batch / full, vericache_ceiling_tok_s=ceiling, budget_throughput_bound=ceiling * full / batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,2048,4096,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--int8-bytes", type=float, default=0.266,
                    help="int8 draft KV bytes as a fraction of the fp32 KV's (measured by decode.py: 0.266)")
    ap.add_argument("--codebook-bytes", type=float, default=0.125,
                    help="TurboQuant k4 v3 draft KV bytes as a fraction of the fp32 KV's (decode.py: 0.125)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--name", default="roofline")
    args = ap.parse_args()
    contexts, batches = [int(x) for x in args.contexts.split(",")], [int(x) for x in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    if bad := [d for d in dtypes if d not in DTYPE_BYTES]:
        ap.error(f"--dtypes: {bad} not in {sorted(DTYPE_BYTES)}")
    if min(contexts + batches) < 1 or not 0 < args.int8_bytes <= 1 or not 0 < args.codebook_bytes <= 1 or args.reps < 1:
        ap.error("contexts and batches must be >= 1, --int8-bytes and --codebook-bytes in (0, 1], --reps >= 1")

    m = model_shape(ensure_smollm2())
    say(f"measuring read bandwidth, GEMM rates and the FMA peak ({args.reps} reps each, under a minute; "
        "the FMA loop compiles once, about half a minute)")
    rates = measure_rates(args.reps)
    say(f"read {rates['read_gb_s']:.1f} GB/s, GEMM fp32 {rates['gemm_gflop_s']['float32']:.1f} / bf16 "
        f"{rates['gemm_gflop_s']['bfloat16']:.1f} GFLOP/s, FMA peak {rates['fma_peak_gflop_s'] or 0:.1f} GFLOP/s "
        f"({torch.get_num_threads()} threads)")
    rows = []
    for dtype in dtypes:
        # int8 codes against this dtype's KV: bytes relative to fp32 scaled to the dtype's size
        # (attended entries in float, KV bytes) per drafter; int8's integer products are not counted
        drafters = {"int8": (0.0, args.int8_bytes * 4 / DTYPE_BYTES[dtype]),
                    "codebook": (0.0, args.codebook_bytes * 4 / DTYPE_BYTES[dtype]), "evict25": (0.25, 0.25),
                    "no_kv": (0.0, 0.0)}
        for batch in batches:
            for context in contexts:
                for name, (entries, kv_bytes) in drafters.items():
                    rows.append(dict(dtype=dtype, batch=batch, context=context, drafter=name,
                                     **bound(m, rates, dtype, batch, context, entries, kv_bytes)))
    print(f"{'dtype':9} {'batch':>5} {'ctx':>5}  full step (limit)   " + "  ".join(f"{d:>14}" for d in drafters))
    for i in range(0, len(rows), len(drafters)):
        r = rows[i]
        cells = "  ".join(f"x{x['bound']:.2f} (L={x['bound_L']:2d})" for x in rows[i:i + len(drafters)])
        print(f"{r['dtype']:9} {r['batch']:5d} {r['context']:5d}  {r['t_full_ms']:6.1f} ms ({r['full_bound_by']:5})   {cells}")
    save_rows(OUT, args.name, dict(meta=dict(machine_info(), model=m, rates=rates, int8_bytes=args.int8_bytes,
                                             codebook_bytes=args.codebook_bytes, max_L=MAX_L), rows=rows))


if __name__ == "__main__":
    main()
