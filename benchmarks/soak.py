"""Soak test of a shared store under faults: wrong tokens must stay 0 and every fault be counted.

Two worker processes each decode batches of 8 requests in a loop, sharing one Redis store (a
single server or a Redis Cluster). 6 prompts of each batch come from a small pool, so their chunks
are stored once and then read again and again; 2 are new, so new chunks are written all along. Each output is compared, token for token, with plain
full-KV decoding of the same prompt. Meanwhile a fault injector cycles through:

* ``kill``: SIGKILL a server (for a cluster: a master), restart it a few seconds later;
* ``corrupt``: flip a byte in stored full chunks, straight in Redis (a valid frame, a wrong digest);
* ``full``: cap the server's memory (``maxmemory``, ``noeviction``) so puts fail, then lift it.

Reported: requests, tokens compared, wrong tokens (goal 0), faults injected and how the workers
counted them (goal: every one), and each worker's memory high-water mark over time (goal: flat).

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--tier redis|redis_cluster] [--fault-every 20]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHUNK, PROMPT_TOKENS, NEW_TOKENS, BATCH, POOL, FRESH = 64, 320, 24, 8, 12, 2


def prompts(seed: int = 0) -> list[list[int]]:
    """A pool of prompts; pairs share their first 3 chunks (a shared system prompt, say)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    base = [torch.randint(0, 256, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(POOL // 2)]
    tails = [torch.randint(0, 256, (PROMPT_TOKENS - 3 * CHUNK,), generator=g).tolist() for _ in range(POOL // 2)]
    return base + [b[: 3 * CHUNK] + t for b, t in zip(base, tails)]


def worker(wid: int, store: dict, deadline: float, out: mp.Queue) -> None:
    import torch

    from lmcache_vericache.engine import VeriCacheEngine
    from lmcache_vericache.models import tiny_llama

    torch.set_num_threads(1)
    model = tiny_llama(seed=0)
    pool = prompts()
    ref = VeriCacheEngine(model, "int8", chunk_size=CHUNK, store="resident")
    expected = [r.tokens for r in ref.reference(pool, NEW_TOKENS)]
    rng = random.Random(wid)
    gen = torch.Generator().manual_seed(1000 + wid)
    totals = {"requests": 0, "tokens": 0, "wrong_tokens": 0, "recomputed_chunks": 0, "cached_chunks": 0,
              "errors": 0}
    rss, t0 = [], time.time()
    # offload: every round reads the full prefix from the shared store, so every fault is on the data path
    with VeriCacheEngine(model, "int8", chunk_size=CHUNK, draft_len=8, store=store, full_kv="offload") as eng:
        # The pool's chunks are the ones read again and again: the injector corrupts those.
        out.put(("keys", wid, time.time(), sorted({k for p in pool for k in eng.chunk_keys(p)}), {}))
        while time.time() < deadline:
            # Mostly prompts from the pool (their chunks are read again and again), plus FRESH new
            # prompts each batch (new chunks are written all along).
            batch = [pool[rng.randrange(POOL)] for _ in range(BATCH - FRESH)]
            # (a prompt whose leading chunks are cached does not store its tail: see README)
            batch += [torch.randint(0, 256, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(FRESH)]
            want = [expected[pool.index(p)] if p in pool else None for p in batch]
            fresh = [i for i, w in enumerate(want) if w is None]
            for i, r in zip(fresh, ref.reference([batch[i] for i in fresh], NEW_TOKENS)):
                want[i] = r.tokens
            try:
                results = eng.generate(batch, NEW_TOKENS)
            except Exception as e:  # never expected: a fault must cost speed, not an exception
                totals["errors"] += 1
                print(f"worker {wid}: generate raised {type(e).__name__}: {e}", file=sys.stderr)
                continue
            for w, res in zip(want, results):
                totals["requests"] += 1
                totals["tokens"] += len(w)
                totals["wrong_tokens"] += sum(a != b for a, b in zip(res.tokens, w)) + abs(len(res.tokens) - len(w))
                totals["recomputed_chunks"] += res.stats.recomputed_chunks
                totals["cached_chunks"] += res.stats.cached_chunks
            rss.append((round(time.time() - t0, 1), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024))
            out.put(("progress", wid, time.time(), dict(totals), dict(vars(eng.store.stats))))
        stats = dict(vars(eng.store.stats))
    out.put(("done", wid, time.time(), {**totals, "rss_mb": rss}, stats))


class Redis:
    """The shared store's servers, and the fault injector's handle on them."""

    def __init__(self, tier: str) -> None:
        import shutil

        import redis

        from lmcache_vericache.testing import servers

        self.tier, self.prefix, self._redis = tier, "soak:", redis
        if tier == "redis":
            self.server = servers.RedisServer(servers.server_binary())
            self.config = {"capacity": "redis", "redis_url": self.server.url, "redis_prefix": self.prefix}
        else:
            self.server = servers.RedisClusterProcesses(servers.server_binary(), shutil.which("redis-cli"))
            self.config = {"capacity": "redis_cluster", "redis_cluster_urls": self.server.url,
                           "redis_prefix": self.prefix}

    def clients(self) -> list:
        """A plain client of each master (of the one server)."""
        if self.tier == "redis":
            return [self._redis.Redis.from_url(self.server.url, socket_timeout=2)]
        return [self.server.client(p) for p in self.server.masters() if self.server.alive(p)]

    def kill_and_restart(self, log) -> None:
        if self.tier == "redis":
            log("kill", self.server.url)
            self.server.kill()
            time.sleep(4)
            from lmcache_vericache.testing import servers

            port = int(self.server.url.rsplit(":", 1)[1].split("/")[0])
            self.server = servers.RedisServer(servers.server_binary(), port=port)
            return
        port = random.choice([p for p in self.server.masters() if self.server.alive(p)])
        log("kill", f"master 127.0.0.1:{port}")
        self.server.kill(port)
        time.sleep(4)  # its replica takes over after cluster-node-timeout (1 s)
        self.server.restart(port)  # rejoins as a replica, empty

    def corrupt(self, log, targets: set[str], n: int = 3) -> int:
        """Flip a byte in ``n`` stored full chunks among ``targets`` (store keys)."""
        done = 0
        for c in self.clients():
            try:
                keys = [k for k in c.scan_iter(match=self.prefix + "*/full", count=1000)
                        if k.decode().removeprefix(self.prefix).strip("{").split("}")[0].split("/")[0] in targets]
                for key in random.sample(keys, min(n - done, len(keys))):
                    value = bytearray(c.get(key) or b"")
                    if len(value) > 64:
                        value[len(value) // 2] ^= 0x10
                        c.set(key, bytes(value))
                        done += 1
            except Exception as e:  # a node mid-failover
                print(f"corrupt: {e}", file=sys.stderr)
        log("corrupt", done)
        return done

    def fill(self, log, seconds: float = 6.0) -> None:
        clients = self.clients()
        log("full", len(clients))
        for c in clients:
            c.config_set("maxmemory-policy", "noeviction")
            c.config_set("maxmemory", max(1, int(c.info("memory")["used_memory"])))
        time.sleep(seconds)
        for c in clients:
            c.config_set("maxmemory", 0)

    def stop(self) -> None:
        self.server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--tier", choices=["redis", "redis_cluster"], default="redis_cluster")
    ap.add_argument("--fault-every", type=float, default=20.0, help="seconds between faults")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hot-bytes", type=int, default=32 << 20,
                    help="each worker's hot tier of compressed chunks (the bound its memory should reach)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    args = ap.parse_args()
    if args.minutes <= 0 or args.fault_every <= 0 or args.workers < 1:
        ap.error("--minutes and --fault-every must be > 0, --workers >= 1")

    shared = Redis(args.tier)
    shared.config["hot_bytes"] = args.hot_bytes
    deadline = time.time() + 60 * args.minutes
    queue: mp.Queue = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=worker, args=(w, shared.config, deadline, queue))
             for w in range(args.workers)]
    faults: list[dict] = []
    t_start = time.time()

    # How each fault shows in the workers' store counters (summed over workers).
    signs = {"kill": ("full_misses", "put_errors"), "full": ("put_errors",), "corrupt": ("corrupt",)}

    def counters() -> dict[str, int]:
        return {k: sum(v[1].get(k, 0) for v in {**latest, **done}.values()) for k in
                ("full_misses", "put_errors", "corrupt")}

    def log(kind: str, detail: object) -> None:
        if faults:  # what the previous fault moved, up to now
            faults[-1]["counted"] = sum(counters()[k] - faults[-1]["before"][k] for k in signs[faults[-1]["kind"]])
        faults.append({"t": round(time.time() - t_start, 1), "kind": kind, "detail": detail, "before": counters()})
        print(f"[{faults[-1]['t']:7.1f} s] fault: {kind} {detail}", file=sys.stderr)

    for p in procs:
        p.start()
    latest: dict[int, tuple] = {}
    targets: set[str] = set()
    done: dict[int, tuple] = {}
    next_fault, cycle = time.time() + args.fault_every, ["kill", "corrupt", "full"]
    try:
        while len(done) < len(procs):
            while not queue.empty():
                kind, wid, t, totals, stats = queue.get()
                if kind == "keys":
                    targets.update(totals)
                else:
                    (done if kind == "done" else latest)[wid] = (totals, stats)
            if len(latest) < len(procs):  # faults start once every worker is decoding
                next_fault = time.time() + args.fault_every
            elif time.time() >= next_fault and time.time() < deadline - 10:
                action = cycle[len(faults) % len(cycle)]
                if action == "corrupt":
                    shared.corrupt(log, targets)
                else:
                    {"kill": shared.kill_and_restart, "full": shared.fill}[action](log)
                next_fault = time.time() + args.fault_every
                left = max(0.0, deadline - time.time())
                total = {k: sum(v[0].get(k, 0) for v in latest.values()) for k in ("requests", "wrong_tokens")}
                print(f"  {left / 60:.1f} min left; {total['requests']} requests, "
                      f"{total['wrong_tokens']} wrong tokens so far", file=sys.stderr)
            if any(not p.is_alive() and p.exitcode for p in procs):
                raise SystemExit("a worker died")
            time.sleep(0.5)
    finally:
        for p in procs:
            p.join(timeout=60)
        shared.stop()

    if faults:
        faults[-1]["counted"] = sum(counters()[k] - faults[-1]["before"][k] for k in signs[faults[-1]["kind"]])
    totals = {k: sum(d[0][k] for d in done.values()) for k in
              ("requests", "tokens", "wrong_tokens", "recomputed_chunks", "cached_chunks", "errors")}
    stats = {k: sum(d[1][k] for d in done.values()) for k in next(iter(done.values()))[1]}
    injected = {k: sum(f["kind"] == k for f in faults) for k in cycle}
    corrupted = sum(f["detail"] for f in faults if f["kind"] == "corrupt")
    rss = {w: d[0]["rss_mb"] for w, d in done.items()}
    result = {
        "minutes": args.minutes, "tier": args.tier, "workers": args.workers, "batch": BATCH,
        "hot_bytes": args.hot_bytes,
        "cpu": platform.processor() or platform.machine(), **totals, "store": stats,
        "faults_injected": injected, "chunks_corrupted": corrupted, "faults": faults,
        "faults_seen_by_workers": sum(f.get("counted", 0) > 0 for f in faults),
        "counted": {"corrupt_detected": stats["corrupt"], "put_errors": stats["put_errors"],
                    "full_misses": stats["full_misses"], "recomputed_chunks": totals["recomputed_chunks"]},
        "rss_mb_first_last": {w: (r[0][1], r[-1][1]) if r else None for w, r in rss.items()},
        "rss_mb": rss,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("faults", "rss_mb")}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
