"""GPU check stage ``engine``: the VeriCache engine on CUDA against its own full-KV greedy decoding
(``reference()``) on SmolLM2-135M, per drafter and dtype: identical tokens, rounds, accepted tokens per
round, time, and whether it drafted through the Triton kernels (``triton_draft``: int4 does on CUDA,
streamingllm has no kernel format and drafts dense).
``--model random-smollm2``: SmolLM2-135M's shape with random weights and a random prompt, for a machine
the model cannot reach (an offline GPU); the tokens must still equal ``reference()``'s, but acceptance
says nothing about a trained model's.

Through ``vericache generate --device cuda --reference --json`` where the CLI has ``--device``; else
through the Python API (the model moved to the device before ``VeriCacheEngine`` sees it). Each dtype
runs in its own process, so a hang or a crash costs only that run (``--budget-s`` shared by them).

    python benchmarks/gpu/engine_cuda.py [--dtypes float32,bfloat16]
    python benchmarks/gpu/engine_cuda.py --smoke      # CPU: 128 prompt tokens, 8 new, float32
    python benchmarks/gpu/engine_cuda.py --dry-run    # which path and commands, nothing run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from common import ROOT, StageError, run_stage, tail

sys.path.insert(0, str(ROOT))

KEEP = ("identical", "rounds", "mean_accepted", "compressor", "full_kv", "triton_draft", "draft_s", "verify_s",
        "prefill_s", "ttft_s", "divergence", "generate_s", "reference_s")


def cli_has_device() -> bool:
    """Whether ``vericache generate`` takes ``--device`` (read from its parser, nothing run)."""
    from lmcache_vericache.cli import generate

    parser = argparse.ArgumentParser()
    generate.add_parser(parser.add_subparsers())
    _, unknown = parser.parse_known_args(["generate", "--device", "cuda"])
    return "--device" not in unknown


# SmolLM2-135M's shape (its config.json) for ``--model random-smollm2``
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rope_theta=1e5, tie_word_embeddings=True, initializer_range=0.02)


def model_and_prompt(model_name: str, device: str, dtype: str, prompt_tokens: int) -> tuple[Any, list[int]]:
    import torch

    if model_name == "random-smollm2":
        from lmcache_vericache.models import tiny_llama

        model = tiny_llama(seed=0, **SMOLLM2_SHAPE).to(device=device, dtype=getattr(torch, dtype))
        gen = torch.Generator().manual_seed(0)
        return model, torch.randint(3, SMOLLM2_SHAPE["vocab_size"], (prompt_tokens,), generator=gen).tolist()
    from lmcache_vericache.cli.generate import DEFAULT_STDLIB
    from lmcache_vericache.data import prompt_ids, stdlib_source
    from lmcache_vericache.models import load_model

    model, tok = load_model("smollm2", dtype=getattr(torch, dtype), device=device)
    return model, prompt_ids(tok, stdlib_source(DEFAULT_STDLIB), prompt_tokens).tolist()


def api_run(model_name: str, device: str, dtype: str, prompt_tokens: int, new_tokens: int,
            compressor: str) -> dict[str, Any]:
    """What ``vericache generate --reference`` reports, through the Python API."""
    from lmcache_vericache.engine import VeriCacheEngine

    model, ids = model_and_prompt(model_name, device, dtype, prompt_tokens)
    eng = VeriCacheEngine(model, compressor, store={"capacity": "memory"})
    try:
        t0 = time.perf_counter()
        [res] = eng.generate([ids], new_tokens)
        seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        [ref] = eng.reference([ids], new_tokens)
        ref_s = time.perf_counter() - t0
    finally:
        eng.close()
    s = res.stats
    return {"identical": res.tokens == ref.tokens, "rounds": s.rounds, "mean_accepted": s.mean_accepted,
            "compressor": eng.compressor.name, "triton_draft": eng.triton_draft, "draft_s": s.draft_s, "verify_s": s.verify_s, "prefill_s": s.prefill_s,
            "ttft_s": s.ttft_s, "generate_s": round(seconds, 3), "reference_s": round(ref_s, 3)}


def command(path: str, model: str, device: str, dtype: str, prompt_tokens: int, new_tokens: int,
            compressor: str) -> list[str]:
    if path == "cli":
        return [sys.executable, "-c", "import sys; from lmcache_vericache.cli import main; sys.exit(main())",
                "generate", "--device", device, "--dtype", dtype, "--reference", "--json", "--compressor", compressor,
                "--prompt-tokens", str(prompt_tokens), "--max-new-tokens", str(new_tokens)]
    return [sys.executable, __file__, "--api-child", "--model", model, "--device", device, "--dtypes", dtype,
            "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens), "--compressors", compressor]


def one(cmd: list[str], timeout: float) -> dict[str, Any]:
    """One dtype's run in a child process: its JSON report (the fields in ``KEEP``), or its error."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"killed at its {timeout:.0f} s limit"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    # `vericache generate` exits 1 when the tokens differ, after printing its report
    if proc.returncode not in (0, 1) or not lines:
        return {"error": f"exit status {proc.returncode}\n{tail(proc.stderr)}"}
    report = json.loads(lines[-1])
    return {"seconds": round(time.perf_counter() - t0, 2), **{k: report[k] for k in KEEP if k in report}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    path = "cli" if args.model == "smollm2" and cli_has_device() else "api"
    out: dict[str, Any] = {"path": path, "model": args.model, "device": args.device, "prompt_tokens": args.prompt_tokens,
                           "new_tokens": args.new_tokens}
    cmds = {f"{c}/{dt}": command(path, args.model, args.device, dt, args.prompt_tokens, args.new_tokens, c)
            for c in args.compressors for dt in args.dtypes}
    if args.dry_run:
        return {**out, "dry_run": True, "commands": {dt: cmd[1:] for dt, cmd in cmds.items()}}
    deadline, out["runs"] = time.monotonic() + args.budget_s, {}
    for i, (dt, cmd) in enumerate(cmds.items()):  # what is left, shared by the dtypes still to run
        out["runs"][dt] = one(cmd, (deadline - time.monotonic()) / (len(cmds) - i))
    bad = [f"{dt}: {r['error'].splitlines()[-1] if 'error' in r else 'tokens differ from reference()'}"
           for dt, r in out["runs"].items() if "error" in r or not r.get("identical")]
    if bad:
        raise StageError("; ".join(bad), out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", choices=("smollm2", "random-smollm2"), default="smollm2",
                    help="random-smollm2: SmolLM2's shape, random weights (no model on the machine)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    ap.add_argument("--compressors", default="streamingllm,int4",
                    help="drafters, comma-separated (default streamingllm,int4: dense, and through the kernels on CUDA)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=85, help="the whole stage's seconds (default 85)")
    ap.add_argument("--smoke", action="store_true", help="CPU: 128 prompt tokens, 8 new, float32")
    ap.add_argument("--dry-run", action="store_true", help="print the path and commands, run nothing")
    ap.add_argument("--api-child", action="store_true", help=argparse.SUPPRESS)  # one API run, its JSON on stdout
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.dtypes, args.prompt_tokens, args.new_tokens = "cpu", "float32", 128, 8
    args.dtypes, args.compressors = args.dtypes.split(","), args.compressors.split(",")
    if args.api_child:
        print(json.dumps(api_run(args.model, args.device, args.dtypes[0], args.prompt_tokens, args.new_tokens,
                                 args.compressors[0])))
        return 0
    return run_stage("engine", lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
