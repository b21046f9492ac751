"""benchmarks/gpu/attention.py, the GPU check's attention entry: it runs end to end on tiny shapes
under Triton's interpreter (``--cpu-check``: every path, the device check included, one JSON line)
and, without a CUDA device, exits 2 with a message saying so."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "attention.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_exits_2_saying_why():
    proc = _run("--json")
    assert proc.returncode == 2
    assert "no CUDA device" in json.loads(proc.stdout)["error"] and "no CUDA device" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_cpu_check_runs_every_path_and_checks_numerics():
    proc = _run("--cpu-check", "--json", "--formats", "int8", "kivi2", "--splits", "2", "--tiles", "16", "--warps", "4", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    paths = {r["path"] for r in record["results"]}
    assert {"sdpa", "int8/s2/t16/w4/stauto", "int8/s2/t16/w8/stauto", "kivi2/s2/t16/w8/stauto"} <= paths
    assert all(r["splits"] == 2 and r["tile"] == 16 for r in record["results"] if "/" in r["path"])
    assert {"int8/s2/t16/w8/stauto", "kivi2/s2/t16/w4/stauto"} <= set(record["check"])
    assert record["bytes_per_head_chunk"]["int8"] < record["bytes_per_head_chunk"]["bf16"]
    if record["vllm"] == "ok":
        assert {"vllm_bf16", "vllm_int8"} <= paths and record["check"]["vllm_int8"] < 3e-3
    assert all(err < 3e-3 for err in record["check"].values()), record["check"]


def test_default_sweep_times_the_listed_configurations_not_a_cross_product():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    configs = [tuple(c) for c in json.loads(proc.stdout)["configs"]]
    assert configs == [(1, 16, 4, 3), (0, 64, 4, 0), (0, 32, 4, 0), (0, 128, 4, 0)]
    proc = _run("--dry-run", "--tiles", "64", "128", "--warps", "4", "8")
    assert [tuple(c) for c in json.loads(proc.stdout)["configs"]] == [(0, t, w, 0) for t in (64, 128) for w in (4, 8)]
