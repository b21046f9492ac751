"""Dual-tier store benchmark: tier throughput against the raw medium, and how much sooner the
compressed draft path is ready than the full path for an 8k-token prefix.

Data: 32 chunks of ``[2, 30, 256, 192]`` bf16 (SmolLM2-135M's KV shape, 256-token chunks), random
values: the tiers move opaque bytes, so content does not change I/O; it does change the ratio of
eviction methods (none) and of quantizers (negligibly). Each figure is the median of ``--repeats``
runs; baselines (plain file I/O, plain redis-py ``GET``/``SET``) run in the same process on the same
sizes right beside the tier. Disk figures are given twice: page cache warm, and cold
(``posix_fadvise(DONTNEED)`` on every file before each run).

    .venv/bin/python benchmarks/store.py [--chunks 32] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lmcache_vericache import compressors  # noqa: E402
from lmcache_vericache.backends import DiskTier, DualTierStore, TierError, encode_full  # noqa: E402
from lmcache_vericache.backends.store import FULL_SUFFIX  # noqa: E402
from lmcache_vericache.backends.tiers.lm import LMServerTier  # noqa: E402
from lmcache_vericache.backends.tiers.redis import RedisTier  # noqa: E402
from lmcache_vericache.testing import servers  # noqa: E402  (starts/stops the real Redis and lm:// servers)

SHAPE = (2, 30, 256, 192)  # [2, layers, tokens, kv_heads * head_dim]
HEADS = 3
METHODS = (("streamingllm", {"keep_ratio": 0.25}), ("kivi", {}))


def median_time(fn: Callable[[], object], repeats: int, before: Callable[[], None] | None = None) -> float:
    return median_times({"": (fn, before)}, repeats)[""]


def median_times(fns: dict[str, tuple[Callable[[], object], Callable[[], None] | None]], repeats: int) -> dict[str, float]:
    """Median wall time of each ``(fn, before)``, runs interleaved so that load from other
    processes and allocator state (glibc raises its mmap threshold after the first large frees)
    hit every variant alike; one untimed warm-up run each."""
    for fn, _ in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (fn, before) in fns.items():
            if before is not None:
                before()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def drop_cache(paths: list[Path]) -> None:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read_all(paths: list[Path]) -> None:
    for p in paths:  # each result dropped at once, as in every read variant here
        with open(p, "rb") as f:
            f.read()


def each(fn: Callable[[str], object], keys: list[str]) -> None:
    for k in keys:  # results dropped at once, like raw_read_all
        fn(k)


def raw_write(p: Path, data: bytes) -> None:
    with open(p, "wb") as f:
        f.write(data)


async def aiofiles_read_all(paths: list[Path]) -> None:
    import aiofiles

    for p in paths:
        async with aiofiles.open(p, "rb") as f:
            await f.read()


async def to_thread_get_all(tier: DiskTier, keys: list[str]) -> None:
    for k in keys:
        await asyncio.to_thread(tier.get, k)


def bench_files(blobs: list[bytes], workdir: Path, repeats: int, tier: DiskTier) -> list[dict]:
    """A file tier (disk, or NIXL over the same files) against plain file I/O of the same bytes."""
    total = sum(len(b) for b in blobs)
    raw_dir = workdir / f"raw-{tier.name}"
    raw_dir.mkdir()
    raw_paths = [raw_dir / f"{i}.bin" for i in range(len(blobs))]
    keys = [f"k{i}" for i in range(len(blobs))]
    tier_paths = [tier._file(k) for k in keys]
    rows = []

    def row(op, t_raw, t_tier):
        rows.append({"tier": tier.name, "op": op, "raw_GBps": total / t_raw / 1e9, "tier_GBps": total / t_tier / 1e9,
                     "tier_vs_raw": t_raw / t_tier})

    t = median_times({"raw": (lambda: [raw_write(p, b) for p, b in zip(raw_paths, blobs)], None),
                      "tier": (lambda: [tier.put(k, b) for k, b in zip(keys, blobs)], None)}, repeats)
    row("put", t["raw"], t["tier"])
    for cold in (False, True):
        variants = {"raw": (lambda: raw_read_all(raw_paths), (lambda: drop_cache(raw_paths)) if cold else None),
                    "tier": (lambda: each(tier.get, keys), (lambda: drop_cache(tier_paths)) if cold else None)}
        if tier.name == "disk":
            variants["aiofiles"] = (lambda: asyncio.run(aiofiles_read_all(raw_paths)), variants["raw"][1])
            variants["to_thread"] = (lambda: asyncio.run(to_thread_get_all(tier, keys)), variants["tier"][1])
        t = median_times(variants, repeats)
        tag = "cold" if cold else "page cache"
        row(f"get ({tag})", t["raw"], t["tier"])
        if tier.name == "disk":
            row(f"aiofiles read ({tag})", t["raw"], t["aiofiles"])
            row(f"get in asyncio.to_thread ({tag})", t["raw"], t["to_thread"])
    tier.close()
    return rows


def bench_redis(blobs: list[bytes], url: str, repeats: int) -> list[dict]:
    import redis

    total = sum(len(b) for b in blobs)
    client = redis.Redis.from_url(url)
    tier = RedisTier(url, prefix="bench-tier:")
    keys = [f"k{i}" for i in range(len(blobs))]
    t = median_times({"raw_set": (lambda: [client.set(f"bench-raw:{k}", b) for k, b in zip(keys, blobs)], None),
                      "tier_put": (lambda: [tier.put(k, b) for k, b in zip(keys, blobs)], None)}, repeats)
    t.update(median_times({"raw_get": (lambda: each(lambda k: client.get(f"bench-raw:{k}"), keys), None),
                           "tier_get": (lambda: each(tier.get, keys), None)}, repeats))
    client.flushall()
    client.close()
    tier.close()
    return [
        {"tier": "redis", "op": "put", "raw_GBps": total / t["raw_set"] / 1e9, "tier_GBps": total / t["tier_put"] / 1e9,
         "tier_vs_raw": t["raw_set"] / t["tier_put"]},
        {"tier": "redis", "op": "get", "raw_GBps": total / t["raw_get"] / 1e9, "tier_GBps": total / t["tier_get"] / 1e9,
         "tier_vs_raw": t["raw_get"] / t["tier_get"]},
    ]


def bench_lm(blobs: list[bytes], url: str, repeats: int) -> list[dict]:
    """No separate raw baseline: the tier is LMCache's wire protocol with a key frame and an ack."""
    total = sum(len(b) for b in blobs)
    tier = LMServerTier(url, namespace="bench")
    keys = [f"k{i}" for i in range(len(blobs))]
    t_put = median_time(lambda: [tier.put(k, b) for k, b in zip(keys, blobs)], repeats)
    t_get = median_time(lambda: each(tier.get, keys), repeats)
    tier.close()
    return [{"tier": "lm", "op": op, "raw_GBps": None, "tier_GBps": total / t / 1e9, "tier_vs_raw": None}
            for op, t in (("put", t_put), ("get", t_get))]


def bench_prefix(kvs: list[torch.Tensor], make_capacity: Callable[[], object], tier_name: str, method: str,
                 params: dict, repeats: int, cold_paths: Callable[[], list[Path]] | None) -> dict:
    """Time to all compressed chunks of the prefix (hot, and from the capacity tier as a second
    instance sees it) vs time to the first and to all verified full chunks via prefetch."""
    keys = [f"p{i}" for i in range(len(kvs))]
    writer = DualTierStore(compressors.get(method, **params), make_capacity(), num_kv_heads=HEADS)
    t0 = time.perf_counter()
    for i, (k, kv) in enumerate(zip(keys, kvs)):
        writer.put(k, kv, start=i * SHAPE[2])
    t_put = time.perf_counter() - t0
    ratio = statistics.median(writer.get_compressed(k).ratio for k in keys)
    t_hot = median_time(lambda: writer.get_compressed_prefix(keys), repeats)

    def fresh() -> DualTierStore:
        return DualTierStore(compressors.get(method, **params), make_capacity(), num_kv_heads=HEADS)

    def timed(fn: Callable[[DualTierStore], object], cold: bool) -> float:
        out = []
        for _ in range(repeats):
            store = fresh()
            if cold and cold_paths is not None:
                drop_cache(cold_paths())
            t = time.perf_counter()
            fn(store)
            out.append(time.perf_counter() - t)
            store.close()
        return statistics.median(out)

    row = {"tier": tier_name, "method": method, "params": params, "ratio": ratio,
           "store_put_s_per_chunk": t_put / len(kvs), "compressed_hot_s": t_hot}
    for cold in ((False, True) if cold_paths else (False,)):
        tag = "_cold" if cold else ""
        row[f"compressed_from_tier{tag}_s"] = timed(lambda s: s.get_compressed_prefix(keys), cold)
        row[f"first_full{tag}_s"] = timed(lambda s: s.prefetch(keys).wait(0), cold)
        row[f"all_full{tag}_s"] = timed(lambda s: s.prefetch(keys).wait(), cold)
        row[f"full_vs_compressed_hot{tag}"] = row[f"all_full{tag}_s"] / t_hot
        row[f"full_vs_compressed_tier{tag}"] = row[f"all_full{tag}_s"] / row[f"compressed_from_tier{tag}_s"]
    t_get_full = median_time(lambda: each(writer.get_full, keys), repeats)
    row["get_full_verified_GBps"] = len(kvs) * kvs[0].numel() * 2 / t_get_full / 1e9
    writer.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="4 chunks, 2 repeats (smoke run)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "store.json"))
    args = ap.parse_args()
    if args.quick:
        args.chunks, args.repeats = 4, 2
    g = torch.Generator().manual_seed(0)
    kvs = [torch.randn(SHAPE, generator=g).bfloat16() for _ in range(args.chunks)]
    blobs = [encode_full(kv) for kv in kvs]

    binary = servers.server_binary()
    server = servers.RedisServer(binary) if binary else None
    lm = servers.LMServer()
    workdir = Path(tempfile.mkdtemp(prefix="vericache-bench-", dir=os.environ.get("BENCH_DIR")))
    try:
        tiers = bench_files(blobs, workdir, args.repeats, DiskTier(workdir / "disk"))
        try:
            from lmcache_vericache.backends.tiers.nixl import NixlTier

            tiers += bench_files(blobs, workdir, args.repeats, NixlTier(workdir / "nixl"))
        except TierError as e:  # nixl-cu12 is an optional extra
            print(f"skipping the nixl tier: {e}")
        if server:
            tiers += bench_redis(blobs, server.url, args.repeats)
        tiers += bench_lm(blobs, lm.url, args.repeats)
        prefix = []
        for method, params in METHODS:
            d = workdir / f"store-{method}"
            prefix.append(bench_prefix(
                kvs, lambda d=d: DiskTier(d), "disk", method, params, args.repeats,
                lambda d=d: [DiskTier(d)._file(f"p{i}{FULL_SUFFIX}") for i in range(args.chunks)]))
            if server:
                prefix.append(bench_prefix(
                    kvs, lambda m=method: RedisTier(server.url, prefix=f"bench-{m}:"), "redis", method, params,
                    args.repeats, None))
            prefix.append(bench_prefix(
                kvs, lambda m=method: LMServerTier(lm.url, namespace=f"bench-{m}"), "lm", method, params,
                args.repeats, None))
    finally:
        lm.stop()
        if server:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    result = {
        "setup": {"chunks": args.chunks, "chunk_shape": list(SHAPE), "dtype": "bfloat16",
                  "chunk_bytes": kvs[0].numel() * 2, "data": "random (torch.randn, seed 0)", "repeats": args.repeats,
                  "statistic": "median", "redis": binary, "cpus": os.cpu_count(), "python": platform.python_version(),
                  "torch": torch.__version__, "workdir_fs": os.environ.get("BENCH_DIR", tempfile.gettempdir())},
        "tiers": tiers,
        "prefix": prefix,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_tables(result)
    print(f"\nsaved {args.out}")


def print_tables(r: dict) -> None:
    s = r["setup"]
    print(f"\n{s['chunks']} chunks x {s['chunk_shape']} {s['dtype']} ({s['chunk_bytes'] / 1e6:.1f} MB each), "
          f"median of {s['repeats']}")
    print(f"\n{'tier':<6} {'op':<36} {'raw GB/s':>9} {'tier GB/s':>10} {'tier/raw':>9}")
    for row in r["tiers"]:
        raw = "-" if row["raw_GBps"] is None else f"{row['raw_GBps']:.2f}"
        rel = "-" if row["tier_vs_raw"] is None else f"{row['tier_vs_raw']:.0%}"
        print(f"{row['tier']:<6} {row['op']:<36} {raw:>9} {row['tier_GBps']:>10.2f} {rel:>9}")
    print("\n8k-token prefix: compressed draft path vs full path (s; x = all full / compressed)")
    print(f"{'tier':<6} {'method':<13} {'ratio':>5} {'put/chunk':>9} {'ckv hot':>8} {'ckv tier':>9} {'1st full':>9} "
          f"{'all full':>9} {'x hot':>7} {'x tier':>7} {'verified GB/s':>13}")
    for row in r["prefix"]:
        for cold in ("", "_cold"):
            if f"all_full{cold}_s" not in row:
                continue
            print(f"{row['tier'] + ('*' if cold else ''):<6} {row['method']:<13} {row['ratio']:>5.2f} "
                  f"{row['store_put_s_per_chunk']:>9.3f} {row['compressed_hot_s']:>8.4f} "
                  f"{row[f'compressed_from_tier{cold}_s']:>9.4f} {row[f'first_full{cold}_s']:>9.4f} "
                  f"{row[f'all_full{cold}_s']:>9.4f} {row[f'full_vs_compressed_hot{cold}']:>7.0f} "
                  f"{row[f'full_vs_compressed_tier{cold}']:>7.1f} {row['get_full_verified_GBps']:>13.2f}")
    print("* disk page cache dropped before each run (cold)")


if __name__ == "__main__":
    main()
