"""``vericache generate`` end to end: the real model on a real stdlib file, checked against plain
full-KV greedy decoding (``--reference``); bad arguments fail with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmcache_vericache.cli import main

pytestmark = pytest.mark.e2e  # subprocesses of the CLI: run once, in the end-to-end pass


@pytest.mark.slow
def test_generate_reference_identical(tmp_path):
    cmd = [sys.executable, "-c", "from lmcache_vericache.cli import main; raise SystemExit(main())", "generate", "--compressor", "streamingllm",
           "--compressor-params", '{"keep_ratio": 0.25}', "--prompt-tokens", "1024", "--max-new-tokens", "128",
           "--draft-len", "auto", "--source", "file", "--swap-dir", str(tmp_path), "--full-kv", "offload",
           "--reference", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["identical"] is True and out["tokens"] == out["reference_tokens"]
    assert len(out["prompt_tokens"]) == 1024 and len(out["tokens"]) == 128
    assert out["rounds"] >= 1 and 1 <= out["mean_accepted"] <= 65
    assert 0 <= out["hidden_swap_fraction"] <= 1 and out["compression_ratio"] > 3
    assert out["full_kv"] == "offload" and out["store"]["full_hits"] >= 4 * out["rounds"]  # 4 chunks a round
    assert isinstance(out["text"], str) and out["text"]
    assert list(tmp_path.glob("*.kv"))  # the full chunks really went through files


@pytest.mark.parametrize("argv,msg", [
    (["--compressor-params", "{bad"], "not valid JSON"),
    (["--compressor-params", "[1]"], "JSON object"),
    (["--draft-len", "many"], "--draft-len"),
    (["--reference", "--temperature", "0.8"], "greedy"),
    (["--prompt-file", "/nonexistent/file.py"], "not found"),
    (["--store-config", "{bad"], "--store-config is not valid JSON"),
    (["--store-config", "[1]"], "JSON object"),
    (["--store-config", '{"capacity": "memory"}', "--source", "file"], "replaces --source"),
    (["--full-kv", "offload", "--source", "resident"], "needs a store"),
    (["--kv-budget-bytes", "0"], "kv_budget_bytes must be a positive int"),
    (["--verify-buffers", "-1"], "verify_buffers must be a positive int"),
    (["--mode", "verkv", "--compressor", "int8"], "needs compressor 'poissoncomp'"),
    (["--kvfetch-draft", "--compressor", "kivi"], "needs compressor 'poissoncomp'"),
    (["--mode", "verkv", "--sketch-bits", "3"], "sketch_bits must be"),
    (["--mode", "verkv", "--sketch-bits", "two"], "--sketch-bits must be"),
    (["--mode", "verkv", "--epsilon", "0"], "epsilon must be"),
    (["--mode", "verkv", "--delta", "1.5"], "delta must be"),
])
def test_bad_arguments(argv, msg, capsys):
    assert main(["generate", *argv, "--json"]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.slow
def test_generate_verkv_mode_reports_its_fetches_and_the_comparison():
    cmd = [sys.executable, "-c", "from lmcache_vericache.cli import main; raise SystemExit(main())", "generate",
           "--mode", "verkv", "--epsilon", "0.05", "--delta", "0.1", "--prompt-tokens", "768",
           "--max-new-tokens", "24", "--draft-len", "8", "--reference", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]  # not identical is not a failure in verkv mode
    out = json.loads(proc.stdout)
    assert out["mode"] == "verkv" and out["compressor"] == "poissoncomp" and len(out["tokens"]) == 24
    assert isinstance(out["identical"], bool) and out["verify_s"] == 0
    assert out["kvfetch"]["decisions"] > 0 and 0 < out["kvfetch"]["fetch_fraction"] < 1
