"""Decode throughput of VeriCache vs plain full-KV decoding, measured in the same run, on SmolLM2 and
real prompts (the first N tokens of large Python stdlib files, one file per request).

Per (dtype, context, batch, temperature): plain full-KV decoding in the engine's runtime (the
baseline, once for all methods), then VeriCache with each compressor: decode tokens/s (prefill
excluded), speed-up, whether greedy tokens are identical to the baseline's (and, where not, the
baseline's top-1/top-2 logit margin there, and ``differs_only_at_ties``: true only where every
differing request's first difference has a margin of exactly 0), tokens per round, hidden swap fraction. Median of
``--reps``; the baseline's repeats alternate with the first compressor's (a shared host's speed
drifts within a cell); identity and acceptance are the last repeat's.

Step costs, per (dtype, context, batch, method), on the same prompts' caches: a 1-token step over
the full KV (``t_full``), over the draft KV (``t_draft``) and a verify of L+1 tokens over the full KV
(``v``), medians of ``--step-reps``; the draft step's bytes bound is ``t_full x bytes_draft /
bytes_full`` (a step reads the weights once plus every cached K/V entry). Each cell also gets the
speed-up bound with every step at the machine's measured limits (``bound_at_limits``,
benchmarks/roofline.py: bandwidth and compute measured once per run, the cell's own draft bytes and
float entries): above it, a ratio says the full-KV step ran further from its limit than VeriCache's did.

Acceptance, three ways, per compressor (batch 1, first context): greedy (the run above: inflated where
the model loops, flagged), seeded sampling (temperature 0.8) and the teacher-forced yardstick: draft
vs target argmax agreement along the file's real continuation, turned into the tokens per round that
agreement implies at horizon L (a round emits the agreeing run, capped at L, plus one). Pessimistic:
the draft cache computes the continuation's KV itself instead of receiving exact KV each round.

Prompt prefixes (``--prefix stored``, default) are served from a store, as the dual tier serves a
shared prefix: each file's exact KV is computed once per model and dtype (chunk by chunk, as a
prefill does), kept under ``--kv-cache-dir`` and put into a fresh memory store per cell; a prompt is
``context`` cached positions plus its last token. The baseline reads the full chunks
(``reference(stored_prefix=True)``; the read and the first token's forward count as its prefill),
VeriCache drafts over the compressed ones while its swap brings the full prefix in (the swap and the
last prompt token's forwards count as decode time: the comparison leans against VeriCache). Both
decode from the same stored KV. ``--prefix computed`` prefills every prompt in every run instead.

    .venv/bin/python benchmarks/decode.py                      # modest default for a 2-core CPU
    .venv/bin/python benchmarks/decode.py --full               # 2k/4k/8k x batch 1/8 x fp32/bf16, all methods
    .venv/bin/python benchmarks/decode.py --grid               # ratio plot: 1k-8k x batch 1-16, int8, bf16 + fp32

``--compressors`` takes names (first example of each) or ``name{json params}``, comma-separated,
e.g. ``int8,turboquant{"k_bits": 4, "v_bits": 3}``.

Prints a table, writes benchmarks/results/<name>.json and <name>.png (if matplotlib is installed):
the speed-up against context length, one line per batch size, a panel per dtype/method/temperature.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from machine import machine_info, pyplot, say
from prefixes import DEFAULT_DIR, prefix_kvs, stored_prompts
from roofline import bound as limit_bound
from roofline import measure_rates, model_shape

from lmcache_vericache import compressors
from lmcache_vericache.backends import DualTierStore
from lmcache_vericache.data import stdlib_source
from lmcache_vericache.engine import Sampling, Segment, VeriCacheEngine, kernels
from lmcache_vericache.engine.horizon import best, predict, rate
from lmcache_vericache.engine.lossy import loops
from lmcache_vericache.engine.runtime import ATTENTION_PATHS
from lmcache_vericache.models import ensure_smollm2, load_model

FILES = ["argparse.py", "typing.py", "inspect.py", "pathlib.py", "subprocess.py", "tarfile.py",
         "logging/__init__.py", "email/_header_value_parser.py", "_pydecimal.py", "turtle.py", "pydoc.py",
         "locale.py", "datetime.py", "urllib/request.py", "zipfile.py", "difflib.py"]  # 16: batch <= 16
OUT = Path(__file__).parent / "results"
MAX_BOUND_L = 32


def prompts(tok, n_tokens: int, batch: int, cont: int = 0) -> list[list[int]]:
    """The first ``n_tokens`` (+ ``cont`` continuation) tokens of ``batch`` different stdlib files."""
    out = []
    for f in FILES[:batch]:
        ids = tok(stdlib_source(f), add_special_tokens=False)["input_ids"]
        if len(ids) < n_tokens + cont:
            raise ValueError(f"{f} has {len(ids)} tokens, need {n_tokens + cont}")
        out.append(ids[:n_tokens + cont])
    return out


def timed(fn) -> tuple[float, list]:
    t0 = time.perf_counter()
    res = fn()
    wall = time.perf_counter() - t0
    return wall - sum(r.stats.prefill_s for r in res), res  # decode seconds: prefill excluded


def teacher_forced(eng: VeriCacheEngine, prompt: list[int], cont: list[int], horizon: int) -> float:
    """Tokens per round implied by draft/target agreement along the real continuation."""
    [r] = eng.setup_requests([prompt], len(cont) + 2, Sampling(), 0, draft=True)  # caches now hold the prompt
    feed, pos = torch.tensor(cont), torch.arange(len(prompt), len(prompt) + len(cont))
    tgt, _ = eng.rt.forward(feed, pos, [Segment(r.full, len(feed))])
    dr, _ = eng.rt.forward(feed, pos, [Segment(r.draft, len(feed))])
    agree = (tgt.argmax(-1) == dr.argmax(-1)).tolist()
    i, rounds, emitted = 0, 0, 0
    while i < len(agree):
        k = 0
        while k < horizon and i + k < len(agree) and agree[i + k]:
            k += 1
        rounds, emitted, i = rounds + 1, emitted + k + 1, i + k + 1
    return emitted / rounds


def prefilled(model, method: tuple[str, dict], ps: list[list[int]], store: DualTierStore | None) -> list:
    """Requests with resident full caches of the prompts: read from ``store`` (no observation-window
    queries then), or prefilled (with them)."""
    if store is not None:
        return VeriCacheEngine(model, store=store).setup_requests(ps, 18, Sampling(), 0, draft=False, stored_prefix=True)
    return VeriCacheEngine(model, *method, store="resident").setup_requests(ps, 18, Sampling(), 0, draft=True)


def step_costs(model, eng: VeriCacheEngine, reqs: list, verify_lens: tuple[int, ...], reps: int) -> dict:
    """Median seconds of one batched forward over every request's full / draft cache (1 token each)
    and of verify blocks of ``verify_lens`` tokens over the full caches; the bytes each step reads.
    ``reqs``: prefilled requests (shared by the methods: each gets its own draft caches here)."""
    rt, p = eng.rt, eng.prefiller
    drafts = []
    for r in reqs:  # this method's draft cache from the request's full cache, as a prefill makes it
        r.draft, r.prefix = None, 0
        p._layout_draft(r, [], p._store_prompt(r, [], r.queries))
        drafts.append(r.draft)

    def timed_forward(caches, n):
        out = []
        for _ in range(reps):
            toks = torch.tensor([t for r in reqs for t in (r.tokens[-1:] * n)])
            pos = torch.tensor([q for r in reqs for q in range(r.pos, r.pos + n)])
            t0 = time.perf_counter()
            rt.forward(toks, pos, [Segment(c, n) for c in caches])
            out.append(time.perf_counter() - t0)
            for c in caches:
                c.n -= n  # roll back: every repeat sees the same cache
        return statistics.median(out)

    fulls = [r.full for r in reqs]
    t_full, t_draft = timed_forward(fulls, 1), timed_forward(drafts, 1)
    t_verify = {n: timed_forward(fulls, n) for n in verify_lens}
    weights = sum(q.numel() * q.element_size() for q in model.parameters())  # tied embeddings once
    full_kv = sum(c.read_bytes() for c in fulls)
    draft_kv = sum(c.read_bytes() for c in drafts)
    bound = t_full * (weights + draft_kv) / (weights + full_kv)
    n = max(verify_lens)
    # entries a step attends over in float: the flops side of a step (roofline.py does not count the
    # integer products over an int8 prefix's codes, nor a KVFetch prefix's: that leans toward VeriCache)
    full_entries, draft_entries = sum(float_entries(c) for c in fulls), sum(float_entries(c) for c in drafts)
    return dict(t_full_ms=1e3 * t_full, t_draft_ms=1e3 * t_draft, t_verify_ms=1e3 * t_verify[n], verify_len=n,
                verify_vs_full_by_len={k: v / t_full for k, v in t_verify.items()},
                draft_bound_ms=1e3 * bound, draft_vs_bound=t_draft / bound, verify_vs_full=t_verify[n] / t_full,
                weight_bytes=weights, full_kv_bytes=full_kv, draft_kv_bytes=draft_kv,
                draft_entries_vs_full=draft_entries / full_entries)


def float_entries(cache) -> int:
    """Dense (float) entries a decode step over ``cache`` attends to, summed over layers."""
    return sum(cache.length(li) for li in range(len(cache.base)))


def parse_methods(spec: str) -> list[tuple[str, dict]]:
    """``name`` (its first example) or ``name{json params}``, comma-separated (commas inside braces
    belong to the params). Unknown names and bad params fail here, before any model loads."""
    out, depth, cur = [], 0, ""
    for ch in spec + ",":
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            name, _, params = cur.strip().partition("{")
            p = json.loads("{" + params) if params else compressors.examples(name)[0]
            compressors.get(name, **p)
            out.append((name, p))
            cur = ""
        else:
            cur += ch
    return out


def speedup_bound(costs: dict, stats: list) -> dict:
    """What the measured step costs allow: with a draft step of ``r`` full steps, a verify of ``L + 1``
    tokens costing ``v(L + 1)`` full steps and per-token acceptance ``a``, a round emits ``E(L) = 1 +
    a + ... + a^L`` tokens for ``L r + v(L + 1)`` full steps. ``v`` is predicted from the measured
    blocks (2, 5, 9, 17 tokens) as the engine's horizon predicts it (``horizon.predict``: between two
    measured sizes the line between them, past 17 tokens the line through 9 and 17), never under one
    full step (2 tokens are measured since bounds of 1.6-1.7x at L = 1-2 came from the line through 5
    and 9 pricing a 2-token verify at 0.8 full steps, though it reads what a full step reads). Returns the best
    such speed-up over L <= 32 at the run's measured ``a`` and with every draft accepted (``a = 1``),
    and the L that gives it."""
    r = costs["t_draft_ms"] / costs["t_full_ms"]
    by_len = {int(n): v for n, v in costs["verify_vs_full_by_len"].items()}
    hits = sum(sum(s.accepted) for s in stats)
    trials = hits + sum(a < d for s in stats for a, d in zip(s.accepted, s.drafted))
    acc = hits / trials if trials else 0.0

    def verify(n: int) -> float:
        return max(1.0, predict(by_len, n))

    def bound(a: float) -> tuple[float, int]:
        L = best(a, r, verify, 1, MAX_BOUND_L)
        return rate(L, a, r, verify(L + 1)), L

    (at_acc, l_acc), (perfect, l_perfect) = bound(acc), bound(1.0)
    return dict(draft_vs_full=r, acceptance_rate=acc, bound_at_acceptance=at_acc,
                bound_L=l_acc, bound_all_accepted=perfect, bound_all_accepted_L=l_perfect)


def horizon_rounds(horizon) -> dict:
    """The rounds as the horizon saw them (``Horizon.record``): each round's L, the seconds predicted
    when L was chosen and measured (its draft and verify forwards), whether it explored; the chosen
    L's counts, and the median of |predicted - measured| / measured over the rounds with a prediction."""
    rounds = [dict(L=x.L, predicted_s=x.predicted_s, measured_s=x.measured_s, explore=x.explore)
              for x in horizon.record] if horizon is not None else []
    errs = [abs(x["predicted_s"] - x["measured_s"]) / x["measured_s"] for x in rounds if x["predicted_s"] is not None]
    counts = Counter(x["L"] for x in rounds)
    return dict(rounds=rounds, chosen_L=dict(sorted(counts.items())),
                round_error=statistics.median(errs) if errs else None, predicted_rounds=len(errs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--compressors", default="streamingllm,int8",
                    help='comma-separated: a name (its first example) or name{json params} (default streamingllm,int8)')
    ap.add_argument("--temperatures", default="0", help="comma-separated; 0 is greedy, > 0 seeded sampling")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", default="auto")
    ap.add_argument("--prefix", default="stored", choices=["stored", "computed"],
                    help="stored: prompt prefixes served from a store (exact KV cached on disk); computed: prefill each run")
    ap.add_argument("--kv-cache-dir", type=Path, default=DEFAULT_DIR,
                    help="where --prefix stored keeps each prompt file's exact KV (GBs at 8k x 16 files)")
    ap.add_argument("--source", default="memory", choices=["memory", "resident"],
                    help="--prefix computed: memory: a store holds the prompt chunks; resident: no store at all")
    ap.add_argument("--full-kv", default="auto", choices=["auto", "resident", "offload"],
                    help="where the full KV lives between verifications (engine full_kv)")
    ap.add_argument("--step-reps", type=int, default=3, help="repeats of each timed step (median; 0: skip them)")
    ap.add_argument("--stagger", default="auto", choices=["auto", "on", "off"],
                    help="off: lock step (every request drafts, then all verify in one forward); auto: the "
                         "engine's default (lock step with the full KV resident, staggered in offload)")
    ap.add_argument("--packed-draft", default="auto", choices=["auto", "off"],
                    help="int8 and TurboQuant drafters attend over their codes with the CPU kernel (auto) or "
                         "over a dequantized copy (off)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--roofline-reps", type=int, default=5,
                    help="repeats of the machine-limit measurements (benchmarks/roofline.py) behind each cell's "
                         "bound at the limits (0: skip)")
    ap.add_argument("--accept-tokens", type=int, default=128, help="tokens for the acceptance study (0: skip it)")
    ap.add_argument("--accept-context", type=int, default=0, help="context of the acceptance study (0: the first)")
    ap.add_argument("--full", action="store_true", help="2k/4k/8k, batch 1/8, fp32/bf16, every method")
    ap.add_argument("--grid", action="store_true",
                    help="1k/2k/4k/8k x batch 1/2/4/8/16, bf16 + fp32, int8, no step costs or acceptance")
    ap.add_argument("--attention", default="auto", choices=list(ATTENTION_PATHS),
                    help="bf16 attention over the full KV (engine/runtime.py attention_path): auto (the dense "
                         "kernel's AMX tiles where the CPU has them, else its AVX path), amx, kernel (the AVX "
                         "path), flash (PyTorch's, verify blocks only): A/B runs")
    ap.add_argument("--name", default="decode")
    args = ap.parse_args()
    os.environ["VERICACHE_ATTENTION"] = args.attention  # read by the runtime per call
    if args.attention == "amx" and not getattr(kernels.build("dense_attention"), "amx", False):
        ap.error("--attention amx: this CPU (or the OS, or a missing compiler) gives no AMX tiles")
    if args.full:
        args.contexts, args.batches, args.dtypes = "2048,4096,8192", "1,8", "float32,bfloat16"
        args.compressors = ",".join(compressors.available())
    if args.grid:
        args.contexts, args.batches, args.dtypes = "1024,2048,4096,8192", "1,2,4,8,16", "bfloat16,float32"
        args.compressors, args.step_reps, args.accept_tokens = "int8", 0, 0
    draft_len = args.draft_len if args.draft_len == "auto" else int(args.draft_len)
    methods = parse_methods(args.compressors)
    temps = [float(t) for t in args.temperatures.split(",")]
    contexts, batches = [int(c) for c in args.contexts.split(",")], [int(b) for b in args.batches.split(",")]
    if max(batches) > len(FILES):
        ap.error(f"--batches: at most {len(FILES)} (one prompt file per request)")
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.prefix == "computed" and args.source == "resident" and args.full_kv == "offload":
        ap.error("--full-kv offload needs a store (--source memory)")
    if args.roofline_reps < 0:
        ap.error("--roofline-reps must be >= 0")
    stored = args.prefix == "stored"
    rates, shape = None, None
    if args.roofline_reps and args.step_reps:
        say("measuring the machine's limits (benchmarks/roofline.py; under a minute)")
        rates, shape = measure_rates(args.roofline_reps), model_shape(ensure_smollm2())
    rows, accept_rows = [], []
    todo = len(args.dtypes.split(",")) * len(contexts) * len(batches) * len(methods) * len(temps)
    t_start = time.perf_counter()
    for dtype in args.dtypes.split(","):
        model, tok = load_model("smollm2", dtype=getattr(torch, dtype))
        # Warm-up (kernels, allocator): without it the first timed baseline ran up to 3x slow,
        # which once showed as a VeriCache "speed-up".
        warm = prompts(tok, 256, 1)
        VeriCacheEngine(model, "int8", store="resident").reference(warm, 8)
        VeriCacheEngine(model, methods[0][0], methods[0][1], draft_len=4).generate(warm, 8)
        kvs = prefix_kvs(model, dtype, {f: p for f, p in zip(FILES, prompts(tok, max(contexts), max(batches)))},
                         args.kv_cache_dir) if stored else []
        for ctx in contexts:
            for batch in batches:
                ps = prompts(tok, ctx + stored, batch)  # stored: ctx cached positions + the last prompt token
                refs: dict[float, list] = {}
                for mi, (m, params) in enumerate(methods):
                    store = stored_prompts(model, m, params, ps, kvs[:batch]) if stored else None
                    if args.step_reps and mi == 0:
                        say(f"{dtype} {ctx} b{batch}: caches for the step costs")
                        reqs = prefilled(model, methods[0], ps, store)
                    for temp in temps:
                        sampling = dict(temperature=temp, seed=0)
                        if mi == 0:  # the baseline, once per (context, batch, temperature) for all methods
                            base = VeriCacheEngine(model, store=store) if stored else \
                                VeriCacheEngine(model, "int8", store="resident")
                            refs[temp] = [None, []]  # the last repeat's results, every repeat's seconds
                        vc_s = []
                        # Baseline and first method's repeats alternate, so a machine that slows down
                        # or speeds up during the cell (a shared host: 1.6x within minutes) weighs on both.
                        for _ in range(args.reps):
                            if mi == 0:
                                say(f"{dtype} {ctx} b{batch} T={temp}: full-KV baseline ({batch} x {ctx} tokens "
                                    f"{'from the store' if stored else 'prefilled'}, {args.new_tokens} steps)")
                                s, ref = timed(lambda base=base, ps=ps, sampling=sampling: base.reference(
                                    ps, args.new_tokens, stored_prefix=stored, **sampling))
                                refs[temp][0] = ref
                                refs[temp][1].append(s)
                            say(f"{dtype} {ctx} b{batch} T={temp}: VeriCache {m}")
                            # A fresh engine per repeat (computed prefix: and store): a reused one would
                            # find the prompt's prefix in its own store and skip the prefill the baseline pays.
                            eng = VeriCacheEngine(model, m if not stored else None, params if not stored else None,
                                                  draft_len=draft_len, full_kv=args.full_kv, stagger={"on": True, "off": False}.get(args.stagger, "auto"),
                                                  store=store if stored else "resident" if args.source == "resident" else None,
                                                  **packed_draft(args))
                            seen: dict = {}  # each request's horizon (lock step: the batch's, shared)
                            s, out = timed(lambda eng=eng, ps=ps, sampling=sampling, seen=seen: eng.generate(
                                ps, args.new_tokens, on_round=lambda r: seen.setdefault(r.idx, r.horizon),
                                **sampling))
                            vc_s.append(s)
                        ref, ref_s = refs[temp]
                        rows.append(_row(dtype, ctx, batch, m, params, temp, ref, ref_s, out, vc_s, eng, args))
                        rows[-1].update(horizon_rounds(seen.get(0)))  # the first request's, last repeat
                        if args.step_reps:
                            if temp == temps[0]:  # the same caches and steps for every temperature
                                say(f"{dtype} {ctx} b{batch}: step costs of {m}")
                                costs = step_costs(model, VeriCacheEngine(
                                    model, m, params, store="resident",
                                    **packed_draft(args)), reqs, (2, 5, 9, 17),
                                    args.step_reps)
                            rows[-1].update(costs)
                            rows[-1].update(speedup_bound(costs, [o.stats for o in out]))
                            if rates:
                                lim = limit_bound(shape, rates, dtype, batch, ctx, costs["draft_entries_vs_full"],
                                                  costs["draft_kv_bytes"] / costs["full_kv_bytes"])
                                rows[-1].update(bound_at_limits=lim["bound"], bound_at_limits_L=lim["bound_L"])
                        print(_fmt(rows[-1]), flush=True)
                        done_s = time.perf_counter() - t_start
                        print(f"[{len(rows)}/{todo}] {done_s / 60:.1f} min, about "
                              f"{done_s / len(rows) * (todo - len(rows)) / 60:.1f} min left"
                              f"{' (acceptance study after)' if args.accept_tokens else ''}", file=sys.stderr, flush=True)
                    if store is not None:
                        store.close()
        del kvs
        if args.accept_tokens == 0:
            continue
        # acceptance three ways: batch 1, one context
        ctx = args.accept_context or contexts[0]
        [p] = prompts(tok, ctx, 1, cont=args.accept_tokens)
        prompt, cont = p[:ctx], p[ctx:]
        for m, params in methods:
            say(f"{dtype} {ctx}: acceptance of {m} {params} (greedy, T=0.8, teacher-forced)")
            eng = VeriCacheEngine(model, m, params, draft_len=32, store="resident", **packed_draft(args))
            [g] = eng.generate([prompt], args.accept_tokens)
            [s] = eng.generate([prompt], args.accept_tokens, temperature=0.8, seed=0)
            tf = teacher_forced(eng, prompt, cont, 32)
            a = dict(dtype=dtype, context=ctx, method=m, params=params, ratio=round(g.stats.compression_ratio, 2),
                     ratio_vs_bf16=_vs_bf16(g.stats.compression_ratio, dtype),
                     greedy=g.stats.mean_accepted, greedy_loops=loops(g.tokens), sampled_t08=s.stats.mean_accepted,
                     teacher_forced=tf, horizon=32, int8_draft=eng.int8_draft, codebook_draft=eng.codebook_draft)
            accept_rows.append(a)
            print(f"accept {dtype} {m:<14} {json.dumps(params)} ratio {a['ratio']:>5}x ({a['ratio_vs_bf16']}x vs bf16)  greedy {a['greedy']:5.1f}"
                  f"{' (loops)' if a['greedy_loops'] else ''}  sampled {a['sampled_t08']:5.1f}  teacher-forced {tf:5.1f}",
                  flush=True)
    OUT.mkdir(exist_ok=True)
    meta = dict(**machine_info(), attention=args.attention, limits=rates, new_tokens=args.new_tokens, draft_len=args.draft_len, prefix=args.prefix,
                source=args.source, full_kv=args.full_kv, reps=args.reps, step_reps=args.step_reps, stagger=args.stagger)
    (OUT / f"{args.name}.json").write_text(json.dumps(dict(meta=meta, throughput=rows, acceptance=accept_rows), indent=1))
    _plot(rows, OUT / f"{args.name}.png")


def packed_draft(args) -> dict:
    """The engine's options for ``--packed-draft``: off turns both CPU code drafters off."""
    return dict(int8_draft=False, codebook_draft=False) if args.packed_draft == "off" else {}


def _row(dtype, ctx, batch, m, params, temp, ref, ref_s, out, vc_s, eng, args) -> dict:
    n_tok, vc_tok = sum(len(r.tokens) for r in ref), sum(len(o.tokens) for o in out)
    st = [o.stats for o in out]
    row = dict(dtype=dtype, context=ctx, batch=batch, method=m, params=params, temperature=temp,
               ratio=round(st[0].compression_ratio, 2), ratio_vs_bf16=_vs_bf16(st[0].compression_ratio, dtype),
               full_tok_s=n_tok / statistics.median(ref_s),
               vericache_tok_s=vc_tok / statistics.median(vc_s),
               # each repeat's seconds and the tokens of the last (sampled requests may stop at EOS)
               full_s=list(ref_s), vericache_s=list(vc_s), full_tokens=n_tok,
               vericache_tokens=vc_tok,
               # sampled outputs are equal in distribution, not token for token: only greedy compares
               identical=all(o.tokens == r.tokens for o, r in zip(out, ref)) if temp == 0 else None,
               tokens_per_round=statistics.mean(s.mean_accepted for s in st),
               hidden_swap=statistics.mean(s.hidden_swap_fraction for s in st),
               swap_s=sum(s.swap_s for s in st), bytes_moved=sum(s.bytes_moved for s in st),
               draft_step_ms=1e3 * statistics.mean(s.draft_s / max(1, s.draft_steps) for s in st),
               full_step_ms=1e3 * statistics.median(ref_s) / max(1, statistics.mean(len(r.tokens) for r in ref) - 1),
               verify_ms=1e3 * statistics.mean(s.verify_s / max(1, s.rounds) for s in st),
               cached_chunks=sum(s.cached_chunks for s in st),
               drafted_per_round=list(st[0].drafted),  # the first request's L per round (0: plain), last repeat
               loops=[loops(r.tokens) for r in ref], full_kv=eng.last_run["full_kv"], int8_draft=eng.int8_draft,
               codebook_draft=eng.codebook_draft)
    row["speedup"] = row["vericache_tok_s"] / row["full_tok_s"]
    if temp == 0:
        row.update(divergences(out, ref))
    return row


def divergences(out, ref) -> dict:
    """Where greedy outputs differ from the baseline's: each differing request's first differing step
    and the baseline's top-1 minus top-2 logit margin there (``divergences``), and whether every one
    is at an exact tie of the baseline (``differs_only_at_ties``; true when identical)."""
    found = []
    for j, (o, r) in enumerate(zip(out, ref)):
        i = next((i for i, (a, b) in enumerate(zip(o.tokens, r.tokens)) if a != b), None)
        if i is not None:
            found.append(dict(request=j, step=i, margin=r.margins[i]))
    return dict(divergences=found, differs_only_at_ties=all(d["margin"] == 0 for d in found))


def _fmt(r: dict) -> str:
    line = (f"{r['dtype']:<8} ctx {r['context']:>5} b {r['batch']:>2} T={r['temperature']} {_label(r):<12} "
            f"{r['ratio']:>5}x  full {r['full_tok_s']:6.1f} tok/s  vericache {r['vericache_tok_s']:6.1f} tok/s  "
            f"x{r['speedup']:.2f}  identical {r['identical']}{_ties(r)}  tok/round {r['tokens_per_round']:5.1f}  "
            f"hidden {100 * r['hidden_swap']:.0f}%  [{r['full_kv']}]  in the run: draft {r['draft_step_ms']:.0f} ms "
            f"verify {r['verify_ms']:.0f} ms, full step {r['full_step_ms']:.0f} ms") + _horizon_fmt(r)
    if "t_full_ms" not in r:  # --step-reps 0
        return line
    return line + (f"\n    steps: full {r['t_full_ms']:.0f} ms  draft {r['t_draft_ms']:.0f} ms "
                   f"(bound {r['draft_bound_ms']:.0f} ms, x{r['draft_vs_bound']:.2f})  verify {r['verify_len']} tokens "
                   f"{r['t_verify_ms']:.0f} ms (x{r['verify_vs_full']:.2f} of a full step)\n"
                   f"    bound: x{r['bound_at_acceptance']:.2f} at L={r['bound_L']} with the run's acceptance "
                   f"{r['acceptance_rate']:.3f}, x{r['bound_all_accepted']:.2f} with every draft accepted"
                   + (f"; x{r['bound_at_limits']:.2f} with every step at the machine's limits"
                      if "bound_at_limits" in r else ""))


def _horizon_fmt(r: dict) -> str:
    """A line on request 0's horizon: the L chosen (L: rounds) and how well it predicted its rounds."""
    if not r.get("rounds"):
        return ""
    err = (f"median |predicted - measured| {100 * r['round_error']:.0f}% of measured over {r['predicted_rounds']} rounds"
           if r["round_error"] is not None else "no round predicted")
    return (f"\n    horizon: L chosen {r['chosen_L']}  {err}, "
            f"{sum(x['explore'] for x in r['rounds'])} exploring")


def _label(r: dict) -> str:
    """The method's name, with its params where they are not its first example."""
    default = r["params"] == compressors.examples(r["method"])[0]
    return r["method"] if default else f"{r['method']}{json.dumps(r['params'], separators=(',', ':'))}"


def _vs_bf16(ratio: float, dtype: str) -> float:
    """A compression ratio against the serving dtype, bf16 (an fp32 run's ratio counts 4-byte elements)."""
    return round(ratio * 2 / torch.empty((), dtype=getattr(torch, dtype)).element_size(), 2)


def _ties(r: dict) -> str:
    d = r.get("divergences") or []
    return f" ({len(d)} differ, at margins <= {max(x['margin'] for x in d):.3f})" if d else ""


def _plot(rows: list[dict], path: Path) -> None:
    """Speed-up against context length, a line per batch size, a panel per dtype/method/temperature."""
    plt = pyplot()
    if plt is None or not rows:
        return
    panels = sorted({(r["dtype"], _label(r), r["temperature"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False, sharey=True)
    for ax, (dtype, method, temp) in zip(axes[0], panels):
        mine = [r for r in rows if (r["dtype"], _label(r), r["temperature"]) == (dtype, method, temp)]
        for batch in sorted({r["batch"] for r in mine}):
            pts = sorted((r["context"], r["speedup"]) for r in mine if r["batch"] == batch)
            ax.plot([c for c, _ in pts], [x for _, x in pts], marker="o", label=f"batch {batch}")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["context"] for r in mine}), [f"{c // 1024}k" if c >= 1024 else str(c)
                                                             for c in sorted({r["context"] for r in mine})])
        ax.set_title(f"{method}, {dtype}, {'greedy' if temp == 0 else f'T={temp}'}", fontsize=9)
        ax.set_xlabel("context (tokens)")
    axes[0][0].set_ylabel("VeriCache / full-KV decode tokens/s")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
