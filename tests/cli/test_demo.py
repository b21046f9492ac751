"""``vericache demo`` run for real, in a subprocess: a short setting, and the built-in defaults."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from lmcache_vericache.cli import demo

CLI = [sys.executable, "-c", "import sys; from lmcache_vericache.cli import main; sys.exit(main())", "demo"]
FIELDS = {"compressor", "compressor_params", "compression_ratio", "prompt_tokens", "draft_len", "new_tokens", "rounds",
          "tokens_per_round", "acceptance", "identical", "reference_loops", "lossy_first_divergence",
          "lossy_agreement", "full_tok_s", "vericache_tok_s", "speedup", "tokens", "reference_tokens", "lossy_tokens"}


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    return parser.parse_args(["demo", *argv])


@pytest.fixture(scope="module")
def short_run() -> dict:
    p = _run("--prompt-tokens", "512", "--max-new-tokens", "32", "--draft-len", "4", "--json")
    assert p.returncode == 0, p.stderr
    for phase in ("C++ kernels", "model SmolLM2-135M", "prefill: 512 prompt tokens", "full-KV greedy:", "VeriCache:"):
        assert phase in p.stderr, f"no progress line for {phase!r} on stderr:\n{p.stderr}"
    return json.loads(p.stdout)


def test_short_run_is_identical_and_drafts(short_run):
    o = short_run
    assert FIELDS <= set(o)
    assert o["identical"] is True and o["tokens"] == o["reference_tokens"]
    assert (o["prompt_tokens"], o["draft_len"], o["new_tokens"]) == (512, 4, 32)
    assert 1 < o["tokens_per_round"] <= 5 and 0 < o["acceptance"] <= 1
    assert o["full_tok_s"] > 0 and o["vericache_tok_s"] > 0
    assert o["speedup"] == pytest.approx(o["vericache_tok_s"] / o["full_tok_s"])
    assert o["compression_ratio"] > 3
    assert len(o["lossy_tokens"]) == 32 and o["lossy_tokens"][0] == o["reference_tokens"][0]


def test_report_states_every_part(short_run):
    text = demo._report(short_run)
    assert f"{short_run['tokens_per_round']:.1f} tokens/round" in text
    assert "identical to full-KV greedy: True" in text
    assert "The same compressed KV decoded alone" in text
    assert f"{short_run['speedup']:.2f}x" in text and "docs/benchmarks.md" in text


def test_side_by_side_keeps_columns():
    rows = demo._side_by_side("a\nbb\n" + "x" * 100, "a\ncc", width=10)
    assert rows == ["  a          | a", "  bb         | cc", "  xxxxxxxxx~ |"]


def test_defaults_are_valid_and_draft():
    args = _args()
    assert demo._parse(args) == {}
    assert isinstance(args.draft_len, int) and args.draft_len >= 4  # a fixed horizon: auto may pick plain decoding
    assert args.compressor == demo.DEFAULT_COMPRESSOR and not args.json


@pytest.mark.parametrize("argv, message", [
    (["--draft-len", "0"], "--draft-len must be in 1..64"),
    (["--compressor", "nope"], "unknown compressor 'nope'"),
    (["--compressor", "none"], "--compressor none is lossless"),
    (["--compressor-params", '{"keep_ratio": 2}'], "keep_ratio must be in (0, 1]"),
    (["--compressor-params", "[1]"], "--compressor-params must be a JSON object"),
    (["--prompt", "no/such/file.py"], "--prompt: no file 'no/such/file.py'"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1"),
    (["--max-new-tokens", "1"], "--max-new-tokens must be >= 2"),
    (["--threads", "-1"], "--threads must be >= 0"),
])
def test_bad_options_fail_before_the_model_loads(argv, message, capsys):
    assert demo.run(_args(*argv)) == 2  # in-process: no model is loaded on this path
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_defaults_show_drafting_identity_drift_and_speed():
    p = _run("--json", timeout=1800)
    assert p.returncode == 0, p.stderr
    o = json.loads(p.stdout)
    assert o["identical"] is True and not o["reference_loops"]
    assert o["tokens_per_round"] >= 4
    d = o["lossy_first_divergence"]
    assert d is not None and d < o["new_tokens"] and o["divergence"]["full_token"] != o["divergence"]["lossy_token"]
    assert o["full_tok_s"] > 0 and o["vericache_tok_s"] > 0
