"""benchmarks/roofline.py's bound on two machines whose answer is known by hand: one with unlimited
compute (every step costs its bytes) and one with unlimited bandwidth (every step costs its flops),
and its parameter count for SmolLM2's config."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import roofline  # noqa: E402
from machine import machine_info  # noqa: E402

from lmcache_vericache.engine import kernels  # noqa: E402

# A model small enough to check by hand: 1,000 parameters, 2 layers, 4 query heads on 2 KV heads of 8.
MODEL = dict(params=1000, layers=2, heads=4, kv_heads=2, head_dim=8)


def rates(read_gb_s: float, gflop_s: float) -> dict:
    return dict(read_gb_s=read_gb_s, gemm_gflop_s={"float32": gflop_s, "bfloat16": gflop_s})


def test_with_unlimited_compute_the_bound_is_the_bytes_ratio_at_the_longest_draft():
    """Verify costs a full step (same bytes), so the best L is the longest and the bound is
    (L + 1) / (L r + 1) with r the draft step's share of a full step's bytes."""
    batch, ctx = 2, 100
    r = roofline.bound(MODEL, rates(1.0, 1e12), "float32", batch, ctx, entries=1.0, kv_bytes=0.25)
    weights, kv = 1000 * 4, batch * ctx * 2 * 2 * 8 * 2 * 4
    share = (weights + kv * 0.25) / (weights + kv)
    assert r["full_bound_by"] == "bytes" and r["bound_L"] == roofline.MAX_L
    assert r["t_full_ms"] == pytest.approx(1e3 * (weights + kv) / 1e9)
    assert r["bound"] == pytest.approx((roofline.MAX_L + 1) / (roofline.MAX_L * share + 1))


def test_with_unlimited_bandwidth_every_step_costs_its_flops():
    """Every step costs its flops (2 per weight, 4 per query head x entry x head dimension, per
    token): a verify of L + 1 tokens costs L + 1 full steps on top of the drafts, so no drafter,
    not even one that reads no KV, beats full-KV decoding, and the budget cap is compute over a
    verified token's flops plus half a drafted one's."""
    batch, ctx, gflop_s = 8, 4096, 1.0
    linear, attention = 2 * 1000, 4 * ctx * 4 * 8 * 2
    for entries in (1.0, 0.25, 0.0):
        r = roofline.bound(MODEL, rates(1e12, gflop_s), "bfloat16", batch, ctx, entries=entries, kv_bytes=entries)
        full, draft = batch * (linear + attention), batch * (linear + attention * entries)
        assert r["full_bound_by"] == "flops"
        assert r["t_full_ms"] == pytest.approx(1e3 * full / 1e9)
        assert r["t_draft_ms"] == pytest.approx(1e3 * draft / 1e9)
        assert r["bound"] == pytest.approx(2 * full / (draft + 2 * full)) and r["bound_L"] == 1  # L = 1 is best
        ceiling = 1e9 / (linear + attention + (linear + attention * entries) / 2)
        assert r["vericache_ceiling_tok_s"] == pytest.approx(ceiling)
        assert r["budget_throughput_bound"] == pytest.approx(ceiling * full / 1e9 / batch) and r["bound"] < 1.0


def test_model_shape_counts_the_weights_a_step_reads(tmp_path):
    """SmolLM2-135M's config: 134,479,872 parameters (the LM head tied to the embeddings, read once),
    as the engine's own count of the model's parameters gives (benchmarks/decode.py's weight bytes)."""
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)))
    assert roofline.model_shape(tmp_path) == dict(params=134_479_872, layers=30, heads=9, kv_heads=3, head_dim=64)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the GEMM rates stand in")
def test_the_fma_probe_counts_every_threads_flops():
    """The FMA probe builds here and counts 2 flops per lane of 12 FMAs per round on every thread
    (16 lanes with AVX-512, else 8); the peak it reports is a real, positive rate."""
    import torch

    mod = kernels.build("fma_peak", source=Path(roofline.__file__).parent / "fma_peak.cpp")
    assert mod is not None
    lanes = 16 if "avx512f" in machine_info()["cpu_flags"] else 8
    assert mod.fma_flops(1000) == 2 * 12 * lanes * 1000 * torch.get_num_threads()
    assert roofline.fma_peak_gflop_s(reps=1) > 0
