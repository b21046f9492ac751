"""benchmarks/roofline.py's bound on two machines whose answer is known by hand: one with unlimited
compute (every step costs its bytes) and one with unlimited bandwidth (every step costs its flops)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import roofline  # noqa: E402

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


def test_with_unlimited_bandwidth_drafting_cannot_pay():
    """Every step costs its flops: a verify of L + 1 tokens costs L + 1 full steps on top of the
    drafts, so no drafter, not even one that reads no KV, beats full-KV decoding."""
    for entries in (1.0, 0.25, 0.0):
        r = roofline.bound(MODEL, rates(1e12, 1.0), "bfloat16", 8, 4096, entries=entries, kv_bytes=entries)
        assert r["full_bound_by"] == "flops" and r["bound"] < 1.0
        assert r["budget_throughput_bound"] < 1.0  # more requests at once do not help either
