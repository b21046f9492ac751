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
    assert set(record["shapes"]) == {"llama8b", "smollm2"} and "errors" not in record, record.get("errors")
    assert (record["shapes"]["smollm2"]["kv_heads"], record["shapes"]["smollm2"]["group"]) == (3, 3)
    assert record["peak_gbps"] > 0
    for shape, part in record["shapes"].items():
        rows = [r for r in record["results"] if r["shape"] == shape]
        paths = {r["path"] for r in rows}
        assert {"sdpa", "int8/s2/t16/w4/stauto", "int8/s2/t16/w8/stauto", "kivi2/s2/t16/w8/stauto"} <= paths
        kernels = [r for r in rows if "/" in r["path"]]
        assert all(r["splits"] == 2 and r["tile"] == 16 and r["format"] == r["path"].split("/")[0] for r in kernels)
        # (stored bytes + q + out) / time / the copy's bandwidth, on every row
        for r in rows:
            assert r["bound_bytes"] > r["bytes"] > 0 and r["fraction_of_bound"] > 0, r
            assert r["fraction_of_bound"] == pytest.approx(r["bound_bytes"] / r["us"] / 1e3 / record["peak_gbps"],
                                                           rel=0.01), r
        assert {"int8/s2/t16/w8/stauto", "kivi2/s2/t16/w4/stauto"} <= set(part["check"])
        assert part["bytes_per_head_chunk"]["int8"] < part["bytes_per_head_chunk"]["bf16"]
        if record["vllm"] == "ok":
            assert {"vllm_bf16", "vllm_int8"} <= paths and part["check"]["vllm_int8"] < 3e-3
        assert all(err < 3e-3 for err in part["check"].values()), part["check"]


def test_default_sweep_times_the_listed_configurations_not_a_cross_product():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    configs = [tuple(c) for c in json.loads(proc.stdout)["configs"]]
    assert configs == [(1, 16, 4, 3), (0, 64, 4, 0), (0, 32, 4, 0), (0, 128, 4, 0)]
    assert json.loads(proc.stdout)["shapes"] == {"llama8b": [8, 4, 128], "smollm2": [3, 3, 64]}
    proc = _run("--dry-run", "--tiles", "64", "128", "--warps", "4", "8", "--shapes", "smollm2")
    plan = json.loads(proc.stdout)
    assert [tuple(c) for c in plan["configs"]] == [(0, t, w, 0) for t in (64, 128) for w in (4, 8)]
    assert plan["shapes"] == {"smollm2": [3, 3, 64]}
    assert json.loads(_run("--dry-run", "--kv-heads", "2").stdout)["shapes"] == {"custom": [2, 4, 128]}
