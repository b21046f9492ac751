"""benchmarks/gpu/check.sh, the prepared GPU check, on this host: the scripts parse and compile, its dry
run gives exactly one JSON line per stage (on a host without CUDA, facts and pcie say "no CUDA"), the
budget skips stages it cannot fit, and a stage that hangs, fails or prints only its results still gets
exactly one line."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
GPU = ROOT / "benchmarks" / "gpu"
STAGES = ["install", "facts", "pcie", "tests", "attention", "draft_step", "vllm", "engine"]


def check(tmp_path: Path, **env: str) -> tuple[list[dict], list[dict]]:
    """Dry-run check.sh; its stdout lines and its gpu_check.jsonl lines, parsed."""
    proc = subprocess.run(["bash", str(GPU / "check.sh")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(tmp_path), "GPU_CHECK_DRY_RUN": "1",
                               "GPU_CHECK_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env})
    assert proc.returncode == 0, proc.stderr
    stdout = [json.loads(ln) for ln in proc.stdout.splitlines()]
    return stdout, [json.loads(ln) for ln in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]


def wrap(tmp_path: Path, timeout: float, *cmd: str) -> tuple[dict, subprocess.CompletedProcess]:
    proc = subprocess.run([sys.executable, str(GPU / "common.py"), "wrap", "--stage", "s", "--timeout", str(timeout),
                           "--log", str(tmp_path / "s.log"), "--", *cmd], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OUT": str(tmp_path)})
    [line] = proc.stdout.splitlines()
    assert (tmp_path / "gpu_check.jsonl").read_text().splitlines() == [line]
    return json.loads(line), proc


def test_shell_scripts_parse_and_python_files_compile(tmp_path):
    for script in ("check.sh", "install.sh"):
        subprocess.run(["bash", "-n", str(GPU / script)], check=True)
    files = sorted(GPU.glob("*.py"))
    assert {"common.py", "facts.py", "pcie.py", "vllm_decode.py", "engine_cuda.py", "draft_step.py"} <= {
        f.name for f in files}
    for f in files:
        py_compile.compile(str(f), cfile=str(tmp_path / (f.name + "c")), doraise=True)


def test_dry_run_prints_one_line_per_stage_and_appends_the_same_lines(tmp_path):
    stdout, lines = check(tmp_path)
    assert stdout == lines
    assert [ln["stage"] for ln in lines] == STAGES
    assert all(isinstance(ln["ok"], bool) and isinstance(ln["seconds"], float | int) for ln in lines)
    by = {ln["stage"]: ln for ln in lines}
    assert by["install"]["skipped"].startswith("dry run")
    if not torch.cuda.is_available():
        for name in ("facts", "pcie"):
            assert by[name]["ok"] is False and by[name]["error"].startswith("StageError: no CUDA"), by[name]
            assert "Traceback" not in (tmp_path / f"{name}.log").read_text()  # a clean failure, not a crash
        assert by["facts"]["results"]["versions"]["torch"] == torch.__version__
    assert by["tests"]["ok"] and by["tests"]["results"]["collect_only"]  # tests/gpu collected, none run
    assert by["tests"]["results"]["tests"] >= 30
    assert by["attention"]["ok"], by["attention"]  # its dry run: options and imports checked, the plan
    assert by["attention"]["results"]["dry_run"] and by["attention"]["results"]["batch"] == [32, 64]
    draft = by["draft_step"]["results"]  # its plan: both shapes at batch 32 and 64 x 8k, int8 and int4
    assert by["draft_step"]["ok"] and draft["dry_run"] and draft["context"] == 8192, by["draft_step"]
    assert [(c["shape"], c["batch"]) for c in draft["cells"]] == [
        (s, b) for s in ("smollm2", "llama3-8b-4l") for b in (32, 64)]
    assert all(0 < c["draft_kv_bytes"]["int4"] < c["draft_kv_bytes"]["int8"] < c["full_kv_bytes"] for c in draft["cells"])
    vllm = by["vllm"]["results"]["configs"]
    assert by["vllm"]["ok"] and list(vllm) == ["plain", "connector", "proposer"]
    assert vllm["plain"]["jobs"] == ["cold_32", "decode_32", "cold_64", "decode_64"]
    assert vllm["connector"]["jobs"] == ["cold_32", "load_32"] and vllm["proposer"]["jobs"] == ["cold_32", "decode_32"]
    assert vllm["connector"]["llm"]["kv_transfer_config"]["kv_connector"] == "VeriCacheConnector"
    assert vllm["proposer"]["llm"]["speculative_config"]["method"] == "custom_class"
    assert by["engine"]["ok"] and set(by["engine"]["results"]["commands"]) == {
        f"{c}/{dt}" for c in ("streamingllm", "int4") for dt in ("float32", "bfloat16")}


def test_without_torch_as_after_a_failed_install_every_stage_still_gives_its_line(tmp_path):
    bare = "/usr/bin/python3"  # the system Python: no torch
    if not Path(bare).is_file() or subprocess.run([bare, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"needs a Python without torch at {bare}")
    _, lines = check(tmp_path, GPU_CHECK_PYTHON=bare)
    by = {ln["stage"]: ln for ln in lines}
    assert [ln["stage"] for ln in lines] == STAGES
    for name in ("facts", "pcie"):
        assert by[name]["ok"] is False and by[name]["error"].startswith("StageError: no torch"), by[name]
    assert by["facts"]["results"]["python"]  # what it could find without torch


def test_a_small_budget_skips_the_stages_it_cannot_fit(tmp_path):
    # 100 s: the later stages' nominal seconds (tests 60 + draft_step 40 + vllm 90 + engine 85, ...) leave facts
    # and pcie under 10 s
    _, lines = check(tmp_path, GPU_CHECK_BUDGET_S="100")
    by = {ln["stage"]: ln for ln in lines}
    assert [ln["stage"] for ln in lines] == STAGES
    for name in ("facts", "pcie"):
        assert by[name]["ok"] is False and by[name]["skipped"].startswith("budget"), by[name]
    assert by["engine"]["ok"] and "skipped" not in by["engine"]


def test_wrap_kills_a_stage_at_its_limit_with_one_line_and_the_log_tail(tmp_path):
    line, _ = wrap(tmp_path, 1, "bash", "-c", "echo started >&2; sleep 30")
    assert line["ok"] is False and line["error"].startswith("killed at its 1 s limit") and "started" in line["error"]
    assert line["seconds"] < 10


def test_wrap_makes_the_line_from_a_stage_that_prints_only_results_or_fails(tmp_path):
    line, _ = wrap(tmp_path, 30, sys.executable, "-c", "print('noise'); print('{\"us\": 3}')")
    assert line["ok"] is True and line["results"] == {"us": 3}
    (tmp_path / "gpu_check.jsonl").unlink()
    line, proc = wrap(tmp_path, 30, "bash", "-c", "echo boom >&2; exit 3")
    assert line["ok"] is False and line["error"] == "exit status 3\nboom" and proc.returncode == 1


def test_wrap_passes_on_the_stage_line_a_stage_script_emitted(tmp_path):
    env_out = f"import os; os.environ['OUT'] = {str(tmp_path)!r}; "
    code = env_out + "import sys; sys.path.insert(0, %r); from common import run_stage; run_stage('s', lambda: {'a': 1})"
    line, _ = wrap(tmp_path, 30, sys.executable, "-c", code % str(GPU))
    assert line["ok"] is True and line["results"] == {"a": 1}


def test_draft_step_cpu_smoke_runs_the_engine_draft_and_full_steps_end_to_end(tmp_path):
    """``draft_step.py --cpu-smoke``: the stage's whole path (random model, full caches, draft caches over
    chunks in an arena, the runtime's batched forward through the Triton kernels, here interpreted) at
    tiny sizes; the draft logits match the full step's (same KV, int8 / int4 rounding)."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, str(GPU / "draft_step.py"), "--cpu-smoke"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1",
                                            "PYTHONPATH": str(ROOT)})
    [line] = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert line["stage"] == "draft_step" and line["ok"], line.get("error", "") + proc.stderr[-2000:]
    [cell] = line["results"]["cells"]
    assert cell["full_ms"] > 0 and set(cell["formats"]) == {"int8", "int4"}
    for fmt in cell["formats"].values():
        assert fmt["draft_ms"] > 0 and fmt["cosine"] > 0.99 and fmt["draft_bytes"] < cell["full_bytes"]
    assert "int4: draft step" in proc.stderr  # its progress lines
