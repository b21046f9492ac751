"""Decode throughput of VeriCache vs plain full-KV decoding, measured in the same run, on SmolLM2 and
real prompts (the first N tokens of large Python stdlib files, one file per request).

Per (dtype, context, batch): plain full-KV decoding in the engine's runtime (the baseline, once for
all methods), then
VeriCache with each compressor (greedy): decode tokens/s (prefill excluded), speed-up, whether the
tokens are identical to the baseline's, tokens per round, hidden swap fraction. Median of ``--reps``.

Step costs, per (dtype, context, batch, method), on the same prompts' caches: a 1-token step over
the full KV (``t_full``), over the draft KV (``t_draft``) and a verify of L+1 tokens over the full KV
(``v``), medians of ``--step-reps``; the draft step's bytes bound is ``t_full x bytes_draft /
bytes_full`` (a step reads the weights once plus every cached K/V entry).

Acceptance, three ways, per compressor (batch 1, first context): greedy (the run above: inflated where
the model loops, flagged), seeded sampling (temperature 0.8) and the teacher-forced yardstick: draft
vs target argmax agreement along the file's real continuation, turned into the tokens per round that
agreement implies at horizon L (a round emits the agreeing run, capped at L, plus one). Pessimistic:
the draft cache computes the continuation's KV itself instead of receiving exact KV each round.

    .venv/bin/python benchmarks/decode.py                      # modest default for a 2-core CPU
    .venv/bin/python benchmarks/decode.py --full               # 2k/4k/8k x batch 1/8 x fp32/bf16, all methods

Prints a table, writes benchmarks/results/decode.json and decode.png (if matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from machine import machine_info, pyplot

from lmcache_vericache import compressors
from lmcache_vericache.data import stdlib_source
from lmcache_vericache.engine import Sampling, Segment, VeriCacheEngine
from lmcache_vericache.models import load_model

FILES = ["argparse.py", "typing.py", "inspect.py", "pathlib.py", "subprocess.py", "tarfile.py",
         "logging/__init__.py", "email/_header_value_parser.py"]
OUT = Path(__file__).parent / "results"


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


def loops(tokens: list[int], period_max: int = 64) -> bool:
    """True if the output's tail is a repetition (the model fell into a loop)."""
    tail = tokens[len(tokens) // 2:]
    return any(all(tail[j] == tail[j + p] for j in range(len(tail) - p)) for p in range(1, min(period_max, len(tail))))


def teacher_forced(eng: VeriCacheEngine, prompt: list[int], cont: list[int], horizon: int) -> float:
    """Tokens per round implied by draft/target agreement along the real continuation."""
    [r] = eng._start([prompt], len(cont) + 2, Sampling(), 0, draft=True)  # caches now hold the prompt
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


_T0 = time.perf_counter()


def say(msg: str) -> None:
    """Progress on stderr: what runs now and the time so far."""
    print(f"[{(time.perf_counter() - _T0) / 60:5.1f} min] {msg}", file=sys.stderr, flush=True)


def prefilled(eng: VeriCacheEngine, ps: list[list[int]], room: int) -> list:
    """Requests with resident full caches of the prompts (and their observation-window queries)."""
    return eng._start(ps, room, Sampling(), 0, draft=True)


def step_costs(model, eng: VeriCacheEngine, reqs: list, verify_lens: tuple[int, ...], reps: int) -> dict:
    """Median seconds of one batched forward over every request's full / draft cache (1 token each)
    and of verify blocks of ``verify_lens`` tokens over the full caches; the bytes each step reads.
    ``reqs``: prefilled requests (shared by the methods: each gets its own draft caches here)."""
    rt, p = eng.rt, eng._prefiller
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
    return dict(t_full_ms=1e3 * t_full, t_draft_ms=1e3 * t_draft, t_verify_ms=1e3 * t_verify[n], verify_len=n,
                verify_vs_full_by_len={k: v / t_full for k, v in t_verify.items()},
                draft_bound_ms=1e3 * bound, draft_vs_bound=t_draft / bound, verify_vs_full=t_verify[n] / t_full,
                weight_bytes=weights, full_kv_bytes=full_kv, draft_kv_bytes=draft_kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--compressors", default="streamingllm,int8",
                    help="comma-separated names, first example of each (default streamingllm,int8)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", default="auto")
    ap.add_argument("--source", default="memory", choices=["memory", "resident"],
                    help="memory: a store holds the prompt chunks; resident: no store at all")
    ap.add_argument("--full-kv", default="auto", choices=["auto", "resident", "offload"],
                    help="where the full KV lives between verifications (engine full_kv)")
    ap.add_argument("--step-reps", type=int, default=3, help="repeats of each timed step (median; 0: skip them)")
    ap.add_argument("--stagger", default="on", choices=["on", "off"],
                    help="off: lock step (every request drafts, then all verify in one forward)")
    ap.add_argument("--int8-draft", default="auto", choices=["auto", "off"],
                    help="int8 drafters attend over the codes with the int8 kernel (auto) or a dequantized copy")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--accept-tokens", type=int, default=128, help="tokens for the acceptance study (0: skip it)")
    ap.add_argument("--full", action="store_true", help="2k/4k/8k, batch 1/8, fp32/bf16, every method")
    ap.add_argument("--name", default="decode")
    args = ap.parse_args()
    if args.full:
        args.contexts, args.batches, args.dtypes = "2048,4096,8192", "1,8", "float32,bfloat16"
        args.compressors = ",".join(compressors.available())
    draft_len = args.draft_len if args.draft_len == "auto" else int(args.draft_len)
    for m in args.compressors.split(","):
        compressors.get(m)  # unknown names fail here, before any model loads
    methods = [(m, compressors.get(m).examples[0]) for m in args.compressors.split(",")]
    if args.source == "resident" and args.full_kv == "offload":
        ap.error("--full-kv offload needs a store (--source memory)")
    rows, accept_rows = [], []
    todo = len(args.dtypes.split(",")) * len(args.contexts.split(",")) * len(args.batches.split(",")) * len(methods)
    t_start = time.perf_counter()
    for dtype in args.dtypes.split(","):
        model, tok = load_model("smollm2", dtype=getattr(torch, dtype))
        # Warm-up (kernels, allocator): without it the first timed baseline ran up to 3x slow,
        # which once showed as a VeriCache "speed-up".
        warm = prompts(tok, 256, 1)
        VeriCacheEngine(model, "int8", store="resident").reference(warm, 8)
        VeriCacheEngine(model, methods[0][0], methods[0][1], draft_len=4).generate(warm, 8)
        for ctx in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                ps = prompts(tok, ctx, batch)
                base = VeriCacheEngine(model, "int8", store="resident")
                ref_s = []  # the baseline, once per (context, batch) for all methods (prefill is slow)
                for _ in range(args.reps):
                    say(f"{dtype} {ctx} b{batch}: full-KV baseline ({batch} prefills of {ctx} tokens, "
                        f"{args.new_tokens} steps)")
                    s, ref = timed(lambda base=base, ps=ps: base.reference(ps, args.new_tokens))
                    ref_s.append(s)
                if args.step_reps:
                    say(f"{dtype} {ctx} b{batch}: prefill for the step costs")
                    reqs = prefilled(VeriCacheEngine(model, methods[0][0], methods[0][1], store="resident"), ps, 18)
                for m, params in methods:
                    vc_s = []
                    for _ in range(args.reps):
                        say(f"{dtype} {ctx} b{batch}: VeriCache {m}")
                        # A fresh engine (and store) per repeat: a reused one would find the prompt's
                        # prefix in its own store and skip the prefill the baseline pays.
                        eng = VeriCacheEngine(model, m, params, draft_len=draft_len, full_kv=args.full_kv,
                                              stagger=args.stagger == "on",
                                              store="resident" if args.source == "resident" else None,
                                              int8_draft=False if args.int8_draft == "off" else None)
                        s, out = timed(lambda eng=eng, ps=ps: eng.generate(ps, args.new_tokens))
                        vc_s.append(s)
                    n_tok = sum(len(r.tokens) for r in ref)
                    st = [o.stats for o in out]
                    row = dict(dtype=dtype, context=ctx, batch=batch, method=m, params=params,
                               ratio=round(st[0].compression_ratio, 2),
                               full_tok_s=n_tok / statistics.median(ref_s),
                               vericache_tok_s=sum(len(o.tokens) for o in out) / statistics.median(vc_s),
                               identical=all(o.tokens == r.tokens for o, r in zip(out, ref)),
                               tokens_per_round=statistics.mean(s.mean_accepted for s in st),
                               hidden_swap=statistics.mean(s.hidden_swap_fraction for s in st),
                               swap_s=sum(s.swap_s for s in st), bytes_moved=sum(s.bytes_moved for s in st),
                               draft_step_ms=1e3 * statistics.mean(s.draft_s / max(1, s.draft_steps) for s in st),
                               full_step_ms=1e3 * statistics.median(ref_s) / args.new_tokens,
                               verify_ms=1e3 * statistics.mean(s.verify_s / max(1, s.rounds) for s in st),
                               loops=[loops(r.tokens) for r in ref], full_kv=eng.last_run["full_kv"])
                    row["speedup"] = row["vericache_tok_s"] / row["full_tok_s"]
                    if args.step_reps:
                        say(f"{dtype} {ctx} b{batch}: step costs of {m}")
                        row.update(step_costs(model, VeriCacheEngine(
                            model, m, params, store="resident", int8_draft=False if args.int8_draft == "off" else None),
                            reqs, (5, 9, 17), args.step_reps))
                    row["int8_draft"] = eng.int8_draft
                    rows.append(row)
                    print(_fmt(row), flush=True)
                    done_s = time.perf_counter() - t_start
                    print(f"[{len(rows)}/{todo}] {done_s / 60:.1f} min, about "
                          f"{done_s / len(rows) * (todo - len(rows)) / 60:.1f} min left (acceptance study after)",
                          file=sys.stderr, flush=True)
        if args.accept_tokens == 0:
            continue
        # acceptance three ways: batch 1, first context
        ctx = int(args.contexts.split(",")[0])
        [p] = prompts(tok, ctx, 1, cont=args.accept_tokens)
        prompt, cont = p[:ctx], p[ctx:]
        for m, params in methods:
            eng = VeriCacheEngine(model, m, params, draft_len=32, store="resident")
            [g] = eng.generate([prompt], args.accept_tokens)
            [s] = eng.generate([prompt], args.accept_tokens, temperature=0.8, seed=0)
            tf = teacher_forced(eng, prompt, cont, 32)
            a = dict(dtype=dtype, context=ctx, method=m, params=params, ratio=round(g.stats.compression_ratio, 2),
                     greedy=g.stats.mean_accepted, greedy_loops=loops(g.tokens), sampled_t08=s.stats.mean_accepted,
                     teacher_forced=tf, horizon=32)
            accept_rows.append(a)
            print(f"accept {dtype} {m:<14} ratio {a['ratio']:>5}x  greedy {a['greedy']:5.1f}"
                  f"{' (loops)' if a['greedy_loops'] else ''}  sampled {a['sampled_t08']:5.1f}  teacher-forced {tf:5.1f}",
                  flush=True)
    OUT.mkdir(exist_ok=True)
    meta = dict(**machine_info(), new_tokens=args.new_tokens, draft_len=args.draft_len, source=args.source,
                full_kv=args.full_kv, reps=args.reps, step_reps=args.step_reps, stagger=args.stagger)
    (OUT / f"{args.name}.json").write_text(json.dumps(dict(meta=meta, throughput=rows, acceptance=accept_rows), indent=1))
    _plot(rows, OUT / f"{args.name}.png")


def _fmt(r: dict) -> str:
    if "t_full_ms" not in r:  # --step-reps 0
        return (f"{r['dtype']:<8} ctx {r['context']:>5} b {r['batch']} {r['method']:<14} {r['ratio']:>5}x  "
                f"full {r['full_tok_s']:6.1f} tok/s  vericache {r['vericache_tok_s']:6.1f} tok/s  x{r['speedup']:.2f}  "
                f"identical {r['identical']}  tok/round {r['tokens_per_round']:5.1f}  [{r['full_kv']}]")
    return (f"{r['dtype']:<8} ctx {r['context']:>5} b {r['batch']} {r['method']:<14} {r['ratio']:>5}x  "
            f"full {r['full_tok_s']:6.1f} tok/s  vericache {r['vericache_tok_s']:6.1f} tok/s  x{r['speedup']:.2f}  "
            f"identical {r['identical']}  tok/round {r['tokens_per_round']:5.1f}  hidden {100 * r['hidden_swap']:.0f}%  "
            f"[{r['full_kv']}]\n    steps: full {r['t_full_ms']:.0f} ms  draft {r['t_draft_ms']:.0f} ms "
            f"(bound {r['draft_bound_ms']:.0f} ms, x{r['draft_vs_bound']:.2f})  verify {r['verify_len']} tokens "
            f"{r['t_verify_ms']:.0f} ms (x{r['verify_vs_full']:.2f} of a full step)  "
            f"in the run: draft {r['draft_step_ms']:.0f} ms  verify {r['verify_ms']:.0f} ms")


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['method']}\n{r['dtype'][:4]} {r['context'] // 1024}k b{r['batch']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["full_tok_s"] for r in rows], 0.4, label="full-KV decode")
    ax.bar([i + 0.2 for i in x], [r["vericache_tok_s"] for r in rows], 0.4, label="VeriCache")
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
