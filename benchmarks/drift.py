"""Why lossless matters: a lossy KV cache drifts away from full-KV decoding as tokens accumulate.

On SmolLM2 and real prompts (the first ``--prompt-tokens`` tokens of different stdlib files), per
lossy compressor (one representative parameter set per registered method, ``identity``/``none``
skipped): prefill the prompt's exact KV, compress each complete 256-token chunk with the
observation-window queries of the prefill (as the engine stores them), lay out a draft cache (the
decompressed chunks, then the exact suffix: the engine's layout) and decode ``--new-tokens`` greedy
tokens on that lossy cache alone, with no verification. The first token comes from the exact
prefill's logits, as in the engine and in every prefill-then-compress method, so drift starts at step 1.

Along that same lossy trajectory, one teacher-forced forward of the full model over prompt + lossy
tokens gives the full-KV next-token distribution at every step. Reported per method: per-step
KL(full || lossy) in nats (mean per step, cumulative at step 250 or the last), the first step where
the lossy greedy tokens leave full-KV greedy decoding of the same prompt (median over prompts; ``N``
when they never do) and the token agreement between the two at equal positions. A VeriCache row
runs the engine with one lossy drafter on the same prompts and compares its tokens with full-KV
greedy (measured: ``identical``). fp32 by default: in bf16, argmax ties alone make decodings part.

    .venv/bin/python benchmarks/drift.py                     # 4 prompts x 1024 tokens, 256 new, every method
    .venv/bin/python benchmarks/drift.py --quick             # smoke test: 2 x 512, 64 new, 3 methods
    .venv/bin/python benchmarks/drift.py --methods kvzip,int8 --params '{"kvzip": {"keep_ratio": 0.5}}'

One torch thread by default: on 2 cores shared with other jobs, 2 threads made a batched decode step
30x slower (3.96 s against 0.13 s) and the default run took 56 min instead of 7.4 (same tokens, KL
within 1e-7). ``--threads 0`` leaves torch's choice, for a machine of one's own.

Prints a table, writes benchmarks/results/drift.json and drift.png (if matplotlib is installed).
Compression ratios are against bf16 (the serving dtype) whatever ``--dtype`` the run used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from machine import elapsed_s, machine_info, pyplot, say

from lmcache_vericache import compressors
from lmcache_vericache.cli.compressors import format_params
from lmcache_vericache.data import stdlib_source
from lmcache_vericache.engine import Segment, VeriCacheEngine
from lmcache_vericache.engine.cache import KVCache, append_chunks
from lmcache_vericache.engine.lossy import first_divergence, greedy
from lmcache_vericache.engine.runtime import Runtime
from lmcache_vericache.models import load_model

FILES = ["argparse.py", "typing.py", "inspect.py", "pathlib.py", "subprocess.py", "tarfile.py",
         "logging/__init__.py", "email/_header_value_parser.py"]
CHUNK, WINDOW, KL_AT = 256, 32, 250  # the engine's chunk size and observation window
LOSSLESS = {"identity", "none"}
# The first example of each method, except TurboQuant at k4v3: the VeriCache paper's setting.
REPRESENTATIVE = {"turboquant": {"k_bits": 4, "v_bits": 3}}
QUICK_METHODS = "streamingllm,kvzip,turboquant"
OUT = Path(__file__).parent / "results"


def prompts(tok, n_tokens: int, count: int) -> list[list[int]]:
    """The first ``n_tokens`` tokens of ``count`` different stdlib files (real code, not templates)."""
    out = []
    for f in FILES[:count]:
        ids = tok(stdlib_source(f), add_special_tokens=False)["input_ids"]
        if len(ids) < n_tokens:
            raise ValueError(f"{f} has {len(ids)} tokens, need {n_tokens}")
        out.append(ids[:n_tokens])
    return out


def prefill(rt: Runtime, ids: list[int], room: int) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """Exact KV of the prompt chunk by chunk (as the engine's prefill: the same floats), the last
    position's logits and the observation-window queries ``[layers, Hq, WINDOW, D]``."""
    n = len(ids)
    full = rt.new_cache(n + room)
    starts = list(range(0, n, CHUNK))
    if len(starts) > 1 and n - starts[-1] < WINDOW:
        starts.pop()  # the last piece holds the whole window
    for j, s in enumerate(starts):
        e = starts[j + 1] if j + 1 < len(starts) else n
        logits, q = rt.forward(torch.tensor(ids[s:e]), torch.arange(s, e), [Segment(full, e - s)],
                               rows=torch.tensor([e - s - 1]), capture_q=min(WINDOW, n) if e == n else 0)
    return full, logits[0], q.cpu()


def lossy_cache(rt: Runtime, full: KVCache, n: int, comp, queries: torch.Tensor, room: int) -> tuple[KVCache, list]:
    """The engine's draft layout of an ``n``-token prompt: every complete chunk compressed (with the
    prefill's window queries) and decompressed, then the exact suffix. Returns it and the chunks."""
    ckvs = [comp.compress(full.to_2ltd(i * CHUNK, (i + 1) * CHUNK), rt.num_kv_heads, start=i * CHUNK, queries=queries)
            for i in range(n // CHUNK)]
    prefix = len(ckvs) * CHUNK
    draft = rt.new_cache(0)
    append_chunks(draft, ckvs, comp, room=n - prefix + room)
    if n > prefix:
        draft.write_suffix(0, *full.suffix(prefix, n))
        draft.n = n - prefix
    return draft, ckvs


def ratio_bf16(rt: Runtime, full: KVCache, n: int, comp, queries: torch.Tensor) -> float:
    """Compression ratio against bf16, the serving dtype: the prompt's chunks compressed in bf16
    (an fp32 run's chunks would count fp32 bytes for kept or rescaled entries)."""
    fb = cb = 0
    for i in range(n // CHUNK):
        ckv = comp.compress(full.to_2ltd(i * CHUNK, (i + 1) * CHUNK).to(torch.bfloat16), rt.num_kv_heads,
                            start=i * CHUNK, queries=queries.to(torch.bfloat16))
        fb, cb = fb + ckv.full_nbytes, cb + ckv.nbytes
    return fb / cb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", help="comma-separated method names (default: every registered lossy one)")
    ap.add_argument("--params", default="{}", help='JSON per method overriding its parameters, e.g. '
                    '\'{"kvzip": {"keep_ratio": 0.5}}\'')
    ap.add_argument("--prompts", type=int, default=4, help=f"prompts, one stdlib file each (<= {len(FILES)})")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--vericache", default="kvzip", help="the drafter of the VeriCache row ('' skips it)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's choice; see above)")
    ap.add_argument("--quick", action="store_true", help=f"smoke test: 2 prompts x 512, 64 new, {QUICK_METHODS}")
    ap.add_argument("--name", default="drift")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.prompt_tokens, args.new_tokens = 2, 512, 64
        args.methods = args.methods or QUICK_METHODS
    # every option is checked here, before the model loads
    names = args.methods.split(",") if args.methods else [m for m in compressors.available() if m not in LOSSLESS]
    try:
        overrides = json.loads(args.params)
        if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
            raise ValueError("--params must be a JSON object of objects")
        methods = {m: overrides.get(m, REPRESENTATIVE.get(m, (compressors.examples(m) or [{}])[0]))
                   for m in dict.fromkeys(names + ([args.vericache] if args.vericache else []))}
        comps = {m: compressors.get(m, **p) for m, p in methods.items()}
    except ValueError as e:
        ap.error(str(e))
    if set(overrides) - set(methods):
        ap.error(f"--params names methods not run: {sorted(set(overrides) - set(methods))}")
    if set(names) & LOSSLESS:
        ap.error(f"{sorted(set(names) & LOSSLESS)} is lossless: nothing to drift")
    if not 1 <= args.prompts <= len(FILES) or args.prompt_tokens < CHUNK or args.new_tokens < 2:
        ap.error(f"need 1 <= --prompts <= {len(FILES)}, --prompt-tokens >= {CHUNK}, --new-tokens >= 2")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    dtype, n, steps = getattr(torch, args.dtype), args.prompt_tokens, args.new_tokens
    model, tok = load_model("smollm2", dtype=dtype)
    rt, ps = Runtime(model), prompts(tok, n, args.prompts)
    res: dict[str, dict[str, Any]] = {m: dict(method=m, params=methods[m], prompts=[]) for m in names}
    full_tokens: list[list[int]] = []
    todo, done, t_start = len(ps), 0.0, time.perf_counter()

    def progress(msg: str, part: float) -> None:
        """``part``: the rough share of a prompt's time this piece took (ETA from prompts done)."""
        nonlocal done
        done += part
        el = time.perf_counter() - t_start
        say(f"[{done:.1f}/{todo} prompts] {msg}; about {el / done * (todo - done) / 60:.1f} min left"
            + (" (then the VeriCache row)" if args.vericache else ""))

    for pi, ids in enumerate(ps):
        full, last, queries = prefill(rt, ids, steps + 2)
        first, lp0 = int(last.argmax()), F.log_softmax(last, -1)
        [ref], _ = greedy(rt, [full.clone()], [first], [n], steps)  # full-KV greedy of this prompt, alone
        full_tokens.append(ref)
        progress(f"prompt {pi} ({FILES[pi]}): full-KV greedy", 0.2)
        drafts, chunks = zip(*(lossy_cache(rt, full, n, comps[m], queries, steps + 2) for m in names))
        all_toks, all_lp = greedy(rt, list(drafts), [first] * len(drafts), [n] * len(drafts), steps, logprobs=True,
                                  on_step=lambda i: i % 64 == 0 and say(f"  step {i}/{steps} on {len(names)} lossy caches"))
        progress(f"prompt {pi}: lossy decoding with {len(names)} methods", 0.5)
        for m, ckvs, toks, lossy_lp in zip(names, chunks, all_toks, all_lp):
            # teacher-forced full-KV forward over the lossy tokens: row i is the step i+1 distribution
            logits, _ = rt.forward(torch.tensor(toks[:-1]), torch.arange(n, n + steps - 1), [Segment(full, steps - 1)])
            full.n = n  # roll back: the next method sees the prompt alone
            full_lp = torch.cat([lp0[None], F.log_softmax(logits, -1)])
            lossy_lp = torch.cat([lp0[None], lossy_lp])
            kl = (full_lp.exp() * (full_lp - lossy_lp)).sum(-1).clamp_min(0)
            div = first_divergence(toks, ref)
            r = res[m]
            if pi == 0:
                r["ratio"] = sum(c.full_nbytes for c in ckvs) / sum(c.nbytes for c in ckvs)
                r["ratio_bf16"] = r["ratio"] if dtype == torch.bfloat16 else ratio_bf16(rt, full, n, comps[m], queries)
            r["prompts"].append(dict(file=FILES[pi], kl=[round(x, 7) for x in kl.tolist()],
                                     first_divergence=div, agreement=sum(a == b for a, b in zip(toks, ref)) / steps,
                                     tf_top1=(full_lp[1:].argmax(-1) == torch.tensor(toks[1:])).float().mean().item(),
                                     tokens=toks))
            say(f"prompt {pi} {m}: mean KL {kl.mean():.4f} nats/step, first divergence {div}")
        del drafts, chunks, all_lp
        progress(f"prompt {pi}: teacher-forced full-KV distributions", 0.3)
    for r in res.values():
        kls = torch.tensor([p["kl"] for p in r["prompts"]])
        at = min(KL_AT, steps) - 1
        r.update(mean_kl_per_step=kls.mean().item(), cum_kl=kls[:, :at + 1].sum(1).mean().item(), cum_kl_step=at + 1,
                 median_first_divergence=statistics.median(
                     steps if p["first_divergence"] is None else p["first_divergence"] for p in r["prompts"]),
                 agreement=statistics.mean(p["agreement"] for p in r["prompts"]),
                 tf_top1=statistics.mean(p["tf_top1"] for p in r["prompts"]),
                 mean_kl_curve=kls.mean(0).tolist())

    vc = None
    if args.vericache:
        m = args.vericache
        say(f"VeriCache with {m} drafting: {len(ps)} prompts x {steps} tokens")
        with VeriCacheEngine(model, m, methods[m]) as eng:  # default store and full_kv, as decode.py
            outs = eng.generate(ps, steps)
        eos = set(rt.eos_ids)
        same = [o.tokens == ref[:len(o.tokens)] and (len(o.tokens) == steps or o.tokens[-1] in eos)
                for o, ref in zip(outs, full_tokens)]
        divs = [first_divergence(o.tokens, ref) for o, ref in zip(outs, full_tokens)]
        vc = dict(method=f"VeriCache({m})", params=methods[m], ratio=outs[0].stats.compression_ratio,
                  identical=all(same), identical_per_prompt=same, first_divergence=divs,
                  agreement=statistics.mean(sum(a == b for a, b in zip(o.tokens, ref)) / steps
                                            for o, ref in zip(outs, full_tokens)),
                  tokens_per_round=statistics.mean(o.stats.mean_accepted for o in outs),
                  ratio_bf16=res[m]["ratio_bf16"] if m in res else None)

    print(_table(list(res.values()), vc, steps))
    say(f"done in {elapsed_s() / 60:.1f} min")
    OUT.mkdir(exist_ok=True)
    meta = dict(**machine_info(), dtype=args.dtype, prompts=args.prompts, files=FILES[:args.prompts],
                prompt_tokens=n, new_tokens=steps, chunk_size=CHUNK, query_window=WINDOW,
                wall_s=elapsed_s(), kl="KL(full || lossy) in nats, full = full-KV model on the lossy prefix")
    (OUT / f"{args.name}.json").write_text(json.dumps(dict(meta=meta, full_greedy=full_tokens,
                                                           methods=list(res.values()), vericache=vc), indent=1))
    print(f"wrote {OUT / f'{args.name}.json'}")
    _plot(list(res.values()), OUT / f"{args.name}.png")


def _table(rows: list[dict], vc: dict | None, steps: int) -> str:
    """Method, params, ratio (bf16), mean KL/step, cumulative KL, median first divergence, agreement."""
    def fmt(p: dict) -> str:
        return format_params(p).replace("'", "").replace(" ", "")
    w = max([len(fmt(r["params"])) for r in rows] + [len(fmt(vc["params"])) if vc else 0, 6])
    mw = max([len(r["method"]) for r in rows] + [len(vc["method"]) if vc else 0, 6])
    at = rows[0]["cum_kl_step"] if rows else steps
    head = (f"{'method':<{mw}} {'params':<{w}} {'ratio':>6} {'KL/step':>8} {f'cumKL@{at}':>10} "
            f"{'1st div':>7} {'agree':>6} {'tf top1':>7}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: -r["mean_kl_per_step"]):
        lines.append(f"{r['method']:<{mw}} {fmt(r['params']):<{w}} {r['ratio_bf16']:>5.2f}x {r['mean_kl_per_step']:>8.4f} "
                     f"{r['cum_kl']:>10.2f} {r['median_first_divergence']:>7g} {r['agreement']:>6.3f} {r['tf_top1']:>7.3f}")
    if vc:
        div = "none" if all(d is None for d in vc["first_divergence"]) else str(vc["first_divergence"])
        lines.append(f"{vc['method']:<{mw}} {fmt(vc['params']):<{w}} {vc['ratio_bf16'] or vc['ratio']:>5.2f}x "
                     f"{'0':>8} {'0':>10} {div:>7} {vc['agreement']:>6.3f} {'':>7}  identical={vc['identical']} "
                     f"tokens/round={vc['tokens_per_round']:.1f}")
    lines.append(f"ratio: full bf16 bytes / compressed bytes; 1st div: median step where lossy greedy leaves full-KV "
                 f"greedy ({steps} = never); tf top1: full-KV argmax == lossy token along the lossy trajectory")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    """Mean KL per step (running mean over 8 steps, log y) and cumulative KL, one line per method."""
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.get_cmap("tab20").colors
    for i, r in enumerate(sorted(rows, key=lambda r: -r["mean_kl_per_step"])):
        kl, style = torch.tensor(r["mean_kl_curve"]), dict(lw=1, color=colors[i % 20], ls="-" if i < 20 else "--")
        smooth = F.avg_pool1d(kl[1:][None, None], 8, 1, 0, count_include_pad=False)[0, 0] if len(kl) > 8 else kl[1:]
        label = f"{r['method']} ({r['ratio_bf16']:.1f}x)"
        a.plot([j + (4.5 if len(kl) > 8 else 1) for j in range(len(smooth))], smooth.clamp_min(1e-7).tolist(),
               label=label, **style)
        b.plot(range(1, len(kl)), kl.cumsum(0)[1:].clamp_min(1e-7).tolist(), label=label, **style)
    a.set(yscale="log", xlabel="decode step", ylabel="KL(full || lossy), nats (running mean of 8)",
          title="per-step drift (mean over prompts)")
    b.set(yscale="log", xlabel="decode step", ylabel="cumulative KL, nats", title="accumulated drift; VeriCache: 0")
    b.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
