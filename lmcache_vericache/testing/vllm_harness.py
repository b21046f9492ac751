"""Run one offline vLLM engine on a list of jobs, in its own process, and report JSON.

Tests and ``benchmarks/vllm_e2e.py`` start each engine configuration through :func:`run_engine`
(a child ``python -m lmcache_vericache.testing.vllm_harness``): vLLM spawns workers (it needs a
``__main__`` guard), a failed start must not take the caller down, and every process it starts
ends with the child. Per job: the generated token ids, wall time, per-request time to first and
last token, cached prompt tokens, and the change of vLLM's spec-decode counters (a job with
``"reset_prefix_cache": true`` starts with vLLM's prefix cache emptied); optionally the proposer's
own stats, the VeriCache KV connector's counters (``"connector_stats": true``) and the runtime's
logits of a probe sequence computed inside the worker (``LLM.apply_model``). With ``on_progress``,
the child appends a JSON line per stage (engine started, each job done) that the parent hands to
the callback while it waits (long benchmarks report progress per job).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0",
              "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # apply_model ships a function to the worker


def run_engine(spec: dict[str, Any], workdir: Path, *, env: dict[str, str] | None = None,
               timeout: float = 600, on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``spec`` (``{"llm": LLM kwargs, "jobs": [...], "probe_ids": [...]?, "stats": bool?}``) in a
    child process. Returns its report; a failed run raises ``RuntimeError`` with the log's tail.
    ``on_progress`` (optional) is called in this process with each stage the child reports:
    ``{"stage": "started", "seconds": engine start}``, then ``{"stage": "job", "name", "seconds",
    "new_tokens"}`` per job, as they happen (polled every second)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out, log = workdir / "spec.json", workdir / "report.json", workdir / "engine.log"
    progress = workdir / "progress.jsonl"
    progress.unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**spec, "out": str(out), **({"progress": str(progress)} if on_progress else {})}))
    out.unlink(missing_ok=True)
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", __name__, str(spec_path)], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **ENGINE_ENV, **(env or {})}, start_new_session=True)
        try:
            rc = _wait(proc, timeout, progress, on_progress)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except BaseException:  # interrupted (Ctrl-C, SIGTERM turned into an exception): no engine outlives it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            raise
        # The engine core and workers are in the child's session: none outlives the run, whatever
        # its end (a timeout, a failed child, a shutdown that left one behind).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(30)
    if rc != 0 or not out.is_file():
        text = log.read_text(errors="replace")
        # The root cause is logged by a worker, far above the tail: lift its "...Error: ..." lines.
        causes = dict.fromkeys(ln.split("] ", 1)[-1] for ln in text.splitlines() if "Error: " in ln)
        raise RuntimeError(f"vLLM run failed ({rc}): " + " | ".join(list(causes)[:6]) + f"\nlog {log}:\n{text[-4000:]}")
    return json.loads(out.read_text())


def _wait(proc: subprocess.Popen, timeout: float, progress: Path,
          on_progress: Callable[[dict[str, Any]], None] | None) -> int:
    """``proc.wait(timeout)``; meanwhile each new line of ``progress`` goes to ``on_progress``."""
    if on_progress is None:
        return proc.wait(timeout)
    deadline, seen = time.monotonic() + timeout, 0

    def drain() -> None:
        nonlocal seen
        if progress.is_file():
            lines = progress.read_text().splitlines()
            for ln in lines[seen:]:
                with contextlib.suppress(ValueError):
                    on_progress(json.loads(ln))
            seen = len(lines)

    while True:
        try:
            rc = proc.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            drain()
            return rc
        except subprocess.TimeoutExpired:
            drain()
            if time.monotonic() >= deadline:
                raise


def _report_progress(spec: dict[str, Any], **entry: Any) -> None:
    """Append one stage's line to the spec's progress file (when the parent asked for one)."""
    if spec.get("progress"):
        with open(spec["progress"], "a") as f:
            f.write(json.dumps(entry) + "\n")


def _counters(llm) -> dict[str, float]:
    vals: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            vals[m.name] = vals.get(m.name, 0) + m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals.setdefault(m.name, [0] * len(m.values))
            vals[m.name] = [a + b for a, b in zip(vals[m.name], m.values)]
    return vals


def _delta(after: dict, before: dict) -> dict:
    return {k: ([a - b for a, b in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list) else v - before.get(k, 0))
            for k, v in after.items()}


def proposer_stats(model) -> dict[str, Any] | None:
    """``LLM.apply_model`` helper: the proposer's counters, live draft states and the step costs
    measured during the job (their samples start afresh for the next job)."""
    p = getattr(model, "_vericache_proposer", None)
    return None if p is None else p.report(reset_costs=True)


def _latencies(outs: list) -> dict[str, list[float]]:
    """Per request: time to first token and to last token (s from arrival), from vLLM's request stats."""
    stats = [getattr(o, "metrics", None) for o in outs]
    if not all(getattr(m, "first_token_latency", 0) for m in stats):
        return {}
    return {"ttft_s": [m.first_token_latency for m in stats],
            "last_token_s": [m.first_token_latency + m.last_token_ts - m.first_token_ts for m in stats]}


def _main(spec_path: str) -> None:
    from functools import partial

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from lmcache_vericache.connectors.vericache_connector import connector_stats
    from lmcache_vericache.connectors.vllm_model import runtime_logits
    from lmcache_vericache.testing.vllm_harness import proposer_stats  # by reference, not __main__'s copy

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    llm = LLM(**{"disable_log_stats": False, "gpu_memory_utilization": 0.3, **spec["llm"]})
    report: dict[str, Any] = {"start_s": time.perf_counter() - t0, "jobs": {}}
    _report_progress(spec, stage="started", seconds=report["start_s"])
    for job in spec.get("jobs", []):
        if job.get("reset_prefix_cache"):  # the next job's prefix comes from the connector (or is recomputed)
            llm.reset_prefix_cache()
        before = _counters(llm)
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]],
                            SamplingParams(**job["sampling"]), use_tqdm=False)
        dt = time.perf_counter() - t
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        report["jobs"][job["name"]] = {
            "tokens": tokens, "finish": [o.outputs[0].finish_reason for o in outs], "seconds": dt,
            "new_tokens": sum(map(len, tokens)), "spec": _delta(_counters(llm), before),
            "proposer": llm.apply_model(proposer_stats)[0] if spec.get("stats") else None,
            "connector": llm.apply_model(connector_stats)[0] if spec.get("connector_stats") else None,
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
            **_latencies(outs),
        }
        _report_progress(spec, stage="job", name=job["name"], seconds=dt, new_tokens=report["jobs"][job["name"]]["new_tokens"])
    if spec.get("probe_ids"):
        import torch

        probe = Path(spec["out"]).with_suffix(".logits.pt")
        torch.save(llm.apply_model(partial(runtime_logits, token_ids=spec["probe_ids"]))[0], probe)
        report["probe_logits"] = str(probe)
    Path(spec["out"]).write_text(json.dumps(report))
    with contextlib.suppress(Exception):  # the report is written; the parent reaps what is left
        llm.llm_engine.engine_core.shutdown()  # the engine's processes end here, before the exit below


if __name__ == "__main__":
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    _main(sys.argv[1])
    # The report is written; the run's outcome is in it. A vLLM process that ran the custom proposer
    # intermittently aborts at interpreter exit after its engine has shut down ("terminate called
    # without an active exception", README "What does not work yet"), which would fail a run that
    # completed: exit without finalizing (stdio flushed first).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
