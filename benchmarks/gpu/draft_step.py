"""GPU check stage ``draft_step``: the engine's draft step against its full step on CUDA, at batch
32 and 64 x 8k context, for SmolLM2-135M's shape and a Llama-3-8B-shaped model cut to 4 layers
(random weights, a 32k vocabulary), per stored chunk format (default int8, int4).

A step is one token of every request through :meth:`Runtime.forward` (``batched``: one attention call
per layer, the GPU path), over the caches the engine keeps: the *full* step over each request's dense
KV (plain decoding, and what a verify block attends), the *draft* step over its draft cache as the
engine makes it on CUDA (:meth:`DraftCaches.choose`: the ``chunked`` kind, the prefix kept as stored
chunks in one arena and attended by the Triton kernels, the exact suffix merged by log-sum-exp).
Speculative decoding pays off only where a draft step costs well under a full one; this measures the
ratio where it matters (large batches, long contexts), with the bytes each step reads (weights + KV).

Every request holds the same random KV (in its own memory: the full caches copies of it, the draft
prefixes its chunks in their own arena slots), so ``cosine`` (draft logits against full logits, the
lowest over the batch) checks that the draft path computed attention over the same KV. Per step
CUDA events, the median of ``--reps`` steps after two warm-up steps (the first compiles the Triton
kernels). Cells run shape by shape while ``--budget-s`` lasts; the rest are listed as skipped.

    python benchmarks/gpu/draft_step.py [--budget-s 120] [--formats int8,int4,turboquant3]
    python benchmarks/gpu/draft_step.py --dry-run      # the plan, its bytes and memory; no CUDA
    python benchmarks/gpu/draft_step.py --cpu-smoke    # CPU: a tiny model, fp32, TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

from attention import FORMATS  # the kernel formats by name, one list for both stages
from common import ROOT, StageError, run_stage, step_ms, tail
from engine_cuda import SMOLLM2_SHAPE

sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": SMOLLM2_SHAPE,
    # Llama-3-8B's layer (its config.json), 4 of its 32 layers and a 32k vocabulary (of 128256): a
    # step's attention and MLP bytes per layer as the model's, in a few GiB of weights and seconds
    "llama3-8b-4l": dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=16384,
                         rope_theta=5e5, tie_word_embeddings=False),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # --cpu-smoke
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
NOTES = {"llama3-8b-4l": "Llama-3-8B's layer shape, 4 of its 32 layers, vocab 32768 (not 128256)"}
SMOKE = dict(device="cpu", dtype="float32", shapes="tiny", batches="2", context=64, chunk=32, exact=4, reps=2)
FIRST_PART_S = 15  # seconds a part (a model, a full step or one format's draft) needs before any has run


def say(t0: float, msg: str) -> None:
    print(f"[draft_step +{time.monotonic() - t0:.1f} s] {msg}", file=sys.stderr, flush=True)


def describe_shape(name: str, dtype: Any) -> dict[str, Any]:
    """A shape's dimensions and the bytes a step reads of its weights (each matrix once: a tied
    head counted once, an untied input embedding not at all, as a step reads only its rows)."""
    s = SHAPES[name]
    h, d, hq, hkv = s["hidden_size"], s["head_dim"], s["num_attention_heads"], s["num_key_value_heads"]
    layer = 2 * h * hq * d + 2 * h * hkv * d + 3 * h * s["intermediate_size"] + 2 * h
    el = dtype.itemsize
    out = {"layers": s["num_hidden_layers"], "hidden": h, "heads": hq, "kv_heads": hkv, "head_dim": d,
           "intermediate": s["intermediate_size"], "vocab": s["vocab_size"],
           "weights_bytes": (s["num_hidden_layers"] * layer + h + s["vocab_size"] * h) * el,
           "kv_bytes_per_token": 2 * s["num_hidden_layers"] * hkv * d * el}
    return {**out, "note": NOTES[name]} if name in NOTES else out


def chunk_format(fmt: str, shape: dict[str, Any], chunk: int, dtype: Any):
    """``(compressor, KVFormat)`` of ``fmt``'s chunks for ``shape``; ``ValueError`` where the Triton
    kernels cannot read them."""
    from lmcache_vericache import compressors
    from lmcache_vericache.compressors.formats import describe
    from lmcache_vericache.engine.triton_attention import check_format

    method, params = FORMATS[fmt]
    comp = compressors.get(method, **params)
    kf = describe(comp, shape["num_key_value_heads"], chunk, shape["head_dim"], dtype)
    check_format(kf)
    return comp, kf


def plan(args: argparse.Namespace, dtype: Any) -> dict[str, Any]:
    """The cells, each full step's and each format's KV bytes, and the device memory a cell needs
    (full caches, their padded copy in the batched path, GQA-expanded K/V of one layer)."""
    from lmcache_vericache.engine.triton_attention import ChunkPool

    length, cells = args.context + args.exact, []
    for name in args.shapes:
        s, info = SHAPES[name], describe_shape(name, dtype)
        slot = {f: ChunkPool.empty(chunk_format(f, s, args.chunk, dtype)[1], 0, "cpu").slot_bytes * s["num_hidden_layers"]
                for f in args.formats}
        for b in args.batches:
            kv = b * length * info["kv_bytes_per_token"]
            expand = 2 * b * s["num_attention_heads"] * length * s["head_dim"] * dtype.itemsize
            cells.append({"shape": name, "batch": b, "full_kv_bytes": kv, "mem_gib": round((2 * kv + expand) / 2**30, 1),
                          "draft_kv_bytes": {f: b * (args.context // args.chunk * slot[f] +
                                                     args.exact * info["kv_bytes_per_token"]) for f in args.formats}})
    return {"device": args.device, "dtype": args.dtype, "context": args.context, "exact": args.exact,
            "chunk": args.chunk, "reps": args.reps, "budget_s": args.budget_s,
            "shapes": {n: describe_shape(n, dtype) for n in args.shapes}, "cells": cells}


class Bench:
    """One shape's runtime and its request KV; times the full step and each format's draft step."""

    def __init__(self, name: str, args: argparse.Namespace, dtype: Any):
        import torch

        from lmcache_vericache.engine import Runtime
        from lmcache_vericache.models import tiny_llama

        self.args, self.shape, self.cuda = args, SHAPES[name], args.device.startswith("cuda")
        with torch.device(args.device):  # random weights made on the device (seconds, not a host init)
            model = tiny_llama(seed=0, **self.shape)
        self.rt = Runtime(model.to(device=args.device, dtype=dtype), batched=True)  # batched: the GPU path
        rt, self.length = self.rt, args.context + args.exact
        torch.manual_seed(0)
        self.k, self.v = (torch.randn(rt.num_layers, rt.num_kv_heads, self.length, rt.head_dim, dtype=dtype,
                                      device=args.device) for _ in range(2))

    def step(self, caches: list, tokens: Any) -> tuple[float, Any]:
        """Median milliseconds of one token of every request over ``caches``, and its logits."""
        import torch

        from lmcache_vericache.engine import Segment

        segments, positions, logits = [Segment(c, 1) for c in caches], torch.full_like(tokens, self.length), []

        def one():
            out, _ = self.rt.forward(tokens, positions, segments)
            for c in caches:  # back to where it was: every step appends at the same entry
                c.n -= 1
            logits[:] = [out]

        one()
        return statistics.median(step_ms(one, self.args.reps, self.cuda)), logits[0]

    def full(self, batch: int, tokens: Any) -> tuple[float, int, Any]:
        caches = []
        for _ in range(batch):
            c = self.rt.new_cache(self.length + 8)
            c.k[:, :, :self.length], c.v[:, :, :self.length], c.n = self.k, self.v, self.length
            caches.append(c)
        ms, logits = self.step(caches, tokens)
        return ms, sum(c.read_bytes() for c in caches), logits

    def draft(self, fmt: str, batch: int, tokens: Any) -> tuple[float, int, Any]:
        from lmcache_vericache.engine.cache import kv_to_2ltd
        from lmcache_vericache.engine.draft_cache import DraftCaches

        a, rt, c = self.args, self.rt, self.args.chunk
        comp, _ = chunk_format(fmt, self.shape, c, rt.dtype)
        drafts = DraftCaches.choose(rt, comp, c, triton=True)  # on CUDA the engine's auto choice
        if drafts.kind != "chunked":
            raise StageError(f"{fmt}: draft caches of kind {drafts.kind}, not chunked")
        n = a.context // c
        ckvs = [comp.compress(kv_to_2ltd(self.k[:, :, i * c:(i + 1) * c], self.v[:, :, i * c:(i + 1) * c]).contiguous(),
                              rt.num_kv_heads, start=i * c) for i in range(n)]
        drafts.arena.ensure(batch * n)  # one allocation, not a growth by a quarter at a time
        caches = []
        for _ in range(batch):  # each request's chunks in slots of its own: no request reads another's
            cache = drafts.new()
            drafts.append(cache, ckvs, room=a.exact + 8)
            cache.write_suffix(0, self.k[:, :, n * c:], self.v[:, :, n * c:])
            cache.n = a.exact
            caches.append(cache)
        ms, logits = self.step(caches, tokens)
        return ms, sum(x.read_bytes() for x in caches), logits


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    dtype = getattr(torch, args.dtype)
    if args.context % args.chunk:
        raise StageError(f"--context {args.context} is not a whole number of {args.chunk}-token chunks")
    out = plan(args, dtype)
    if args.dry_run:
        return {**out, "dry_run": True}
    cuda = args.device.startswith("cuda")
    if cuda:
        from common import require_cuda

        require_cuda()
        out["device_name"] = torch.cuda.get_device_name()
    out["timer"] = f"{'CUDA events' if cuda else 'host clock'} per step, median of {args.reps} after 2 warm-up steps"
    t0 = time.monotonic()
    deadline, longest, bad = t0 + args.budget_s, 0.0, []

    def part(what: str, fn: Callable[[], Any], cell: dict[str, Any], key: str) -> Any:
        """``fn()`` where the budget still fits a part as long as the longest so far (else a note in
        ``cell[key]``); its error, if any, goes there too."""
        nonlocal longest
        left = deadline - time.monotonic()
        if left < max(FIRST_PART_S if not longest else 0, 1.5 * longest):
            took = f"a part took up to {longest:.0f} s" if longest else f"the first part needs {FIRST_PART_S} s"
            cell[key] = {"skipped": f"budget: {left:.0f} s left, {took}"}
            say(t0, f"{what}: skipped ({cell[key]['skipped']})")
            return None
        t = time.monotonic()
        try:
            return fn()
        except Exception:
            cell[key] = {"error": tail(traceback.format_exc(), 6)}
            bad.append(f"{what}: {cell[key]['error'].splitlines()[-1]}")
            say(t0, f"{what}: {cell[key]['error']}")
            return None
        finally:
            longest = max(longest, time.monotonic() - t)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()

    cells = [{k: cell[k] for k in ("shape", "batch", "mem_gib")} for cell in out["cells"]]
    for name in args.shapes:
        rows = [r for r in cells if r["shape"] == name]
        bench = part(f"{name}: model", partial(Bench, name, args, dtype), rows[0], "model")
        if bench is None:
            for r in rows[1:]:
                r["model"] = rows[0]["model"]
            continue
        say(t0, f"{name}: model ready")
        for r in rows:
            b = r["batch"]
            tokens = torch.randint(3, SHAPES[name]["vocab_size"], (b,), generator=torch.Generator().manual_seed(b))
            full = part(f"{name} b{b} full", partial(bench.full, b, tokens), r, "full")
            if full is None:
                continue
            r.update(full_ms=round(full[0], 3), full_bytes=full[1] + out["shapes"][name]["weights_bytes"], formats={})
            say(t0, f"{name} b{b}: full step {full[0]:.2f} ms")
            for f in args.formats:
                got = part(f"{name} b{b} {f}", partial(bench.draft, f, b, tokens), r["formats"], f)
                if got is None:
                    continue
                cos = torch.nn.functional.cosine_similarity(got[2], full[2], dim=-1).min().item()
                draft_bytes = got[1] + out["shapes"][name]["weights_bytes"]
                r["formats"][f] = {"draft_ms": round(got[0], 3), "ratio": round(full[0] / got[0], 3),
                                   "draft_bytes": draft_bytes, "cosine": round(cos, 5)}
                say(t0, f"{name} b{b} {f}: draft step {got[0]:.2f} ms, full/draft {full[0] / got[0]:.2f}x, cosine {cos:.4f}")
                if not cos > 0.9:  # NaN included
                    bad.append(f"{name} b{b} {f}: draft logits' cosine to full {cos:.4f}")
        bench = None  # its caches and weights go before the next shape's
    out["cells"] = cells
    if bad:
        raise StageError("; ".join(bad), out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default="smollm2,llama3-8b-4l", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="32,64", help="comma-separated (default 32,64)")
    ap.add_argument("--formats", default="int8,int4", help=f"chunk formats, comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--context", type=int, default=8192, help="tokens of stored chunks per request (default 8192)")
    ap.add_argument("--exact", type=int, default=16, help="exact tokens after them (the draft's suffix; default 16)")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per chunk (default 256, the engine's)")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per cell (default 10)")
    ap.add_argument("--budget-s", type=float, default=120, help="the whole stage's seconds (default 120)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing (no CUDA needed)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="the whole path on the CPU: a tiny model, fp32, batch 2, 64 tokens, Triton's interpreter")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton
        for k, v in SMOKE.items():
            setattr(args, k, v)
    args.shapes, args.formats = args.shapes.split(","), args.formats.split(",")
    args.batches = [int(b) for b in str(args.batches).split(",")]
    for what, names, known in (("shape", args.shapes, SHAPES), ("format", args.formats, FORMATS)):
        if unknown := [n for n in names if n not in known]:
            ap.error(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return run_stage("draft_step", lambda: run(args))


if __name__ == "__main__":
    raise SystemExit(main())
