"""VerKV's trade-off on real SmolLM2 KV: traffic and quality of top-k eviction, PoissonComp alone and
KVFetch-certified attention (VerKV) against dense attention, per compression rate and tolerance.

For each stdlib file: the first ``--context`` tokens are the prefix (compressed chunk by chunk, 256
tokens, scored by the observation window of the prefix's last 32 queries, as the engine does), the
next ``--window`` tokens are the queries. Methods, per rate (8x/16x/32x resident):

* ``kvzip``: top-k eviction by KVzip's max-attention rule, plain attention over the kept tokens;
* ``poissoncomp``: the PoissonComp sample with the bounded shrinkage estimator, nothing fetched;
* ``verkv eps=...``: the same sample, KVFetch fetching until the certificate is below ``eps``.

Two measurements. (1) Attention, per layer, KV head and query (the real queries of the dense
forward): output error ``|o - o_dense| / |o_dense|`` (mean), the share of decisions whose
denominator error exceeds ``eps`` (the (eps, delta) guarantee: at most ``delta`` = 0.1 with an exact
sketch), decisions that fetch and the fraction of the prefix fetched per query. (2) Decoding,
teacher-forced along the file's real continuation one token at a time, the prefix attended by each
method: next-token agreement with dense (argmax) and KL(dense || method); VerKV's traffic per token
here is the union over a KV head's query heads, what one decode step moves.

(3) Beyond both papers: KVFetch as the exact mode's *drafter*. ``VeriCacheEngine`` greedy on the same
prompts (``--accept-new`` tokens, draft length 8) with kvzip, PoissonComp and PoissonComp + KVFetch
drafters at the same resident budget: tokens per round, identical to full-KV greedy, traffic.

    .venv/bin/python benchmarks/verkv.py                # 2 files x 2048 tokens, 2-bit sketch and exact
    .venv/bin/python benchmarks/verkv.py --quick        # smoke: 1 file, 512 tokens, 8x only

Prints a table; writes benchmarks/results/<name>.json and <name>.png (if matplotlib is installed);
the name is ``verkv``, ``verkv_quick`` with ``--quick`` (so a smoke run keeps the full results).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from machine import machine_info, pyplot, say

from lmcache_vericache import compressors
from lmcache_vericache.data import stdlib_source
from lmcache_vericache.engine import Segment
from lmcache_vericache.engine.cache import append_chunks
from lmcache_vericache.engine.kvfetch import CertifiedPrefix
from lmcache_vericache.engine.runtime import Runtime
from lmcache_vericache.models import load_model, prefill_kv

FILES = ["argparse.py", "typing.py", "inspect.py", "pathlib.py"]
OUT = Path(__file__).parent / "results"
CHUNK, OBS = 256, 32
NO_FETCH = 1e30


def variants(name: str, epsilons: list[float], sketches: list[int | None]) -> list[tuple[str, float | None, int | None]]:
    """The (method, epsilon, sketch bits) rows measured over one compression of the prefix by ``name``."""
    if name == "kvzip":
        return [("kvzip", None, None)]
    return [(m, e, s) for s in sketches for m, e in [("poissoncomp", None)] + [("verkv", e) for e in epsilons]]


def sketch_name(method: str, bits: int | None) -> str:
    return "-" if method == "kvzip" else ("exact" if bits is None else f"{bits}-bit")


def compressor(name: str, rate: int):
    if name == "kvzip":
        return compressors.get("kvzip", keep_ratio=1 / rate)
    # No per-chunk local window: the budget goes to the importance sample (a chunk's last tokens are
    # not the sequence's; at 16x a 16-token window per 256-token chunk would take the whole budget).
    return compressors.get("poissoncomp", keep_ratio=1 / rate, n_sink=4, n_local=0, seed=0)


def prefix_for(name: str, eps: float | None, sketch_bits: int | None, layers: int) -> CertifiedPrefix | None:
    if name == "kvzip":
        return None
    return CertifiedPrefix(layers, epsilon=NO_FETCH if eps is None else eps, delta=0.1, sketch_bits=sketch_bits)


def attention_rows(kv: torch.Tensor, queries: torch.Tensor, heads: int, ckvs: list, comp, prefix) -> dict:
    """Measurement (1): per layer and query position, the method's attention vs dense."""
    n_layers, d = kv.shape[1], queries.shape[-1]
    t, scale = kv.shape[2], 1 / math.sqrt(d)
    kept = None if prefix is not None else [comp.decompress(c) for c in ckvs]
    for i, c in enumerate(ckvs if prefix is not None else []):
        prefix.append(c, kv[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous())
    errs, d_errs = [], []
    for li in range(n_layers):
        k = kv[0, li].view(t, heads, d).transpose(0, 1).float()
        v = kv[1, li].view(t, heads, d).transpose(0, 1).float()
        if kept is not None:
            kk = torch.cat([c[li].keys for c in kept], 1).float()
            vk = torch.cat([c[li].values for c in kept], 1).float()
        for j in range(queries.shape[2]):  # one decode step: a KV head's query heads together
            q = queries[li, :, j].float().reshape(heads, -1, d)
            logits = q @ k.transpose(1, 2) * scale
            ref, lse_ref = logits.softmax(-1) @ v, logits.logsumexp(-1)
            if prefix is not None:
                out, lse = prefix.attend(q, li, scale)
            else:
                s = q @ kk.transpose(1, 2) * scale
                out, lse = s.softmax(-1) @ vk, s.logsumexp(-1)
            errs.append(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten())
            d_errs.append((lse - lse_ref).double().exp().sub(1).abs().flatten())
    e, de = torch.cat(errs), torch.cat(d_errs)
    return {"output_error": e.mean().item(), "denominator_error_median": de.median().item(), "_d_errs": de}


def decode_rows(rt: Runtime, kv: torch.Tensor, ids: list[int], ctx: int, window: int, ckvs: list, comp,
                prefix, dense_logits: torch.Tensor) -> dict:
    """Measurement (2): teacher-forced decoding of the continuation over the method's prefix."""
    cache = rt.new_cache(0)
    cache.packed = prefix
    chunks = [kv[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous() for i in range(len(ckvs))]
    append_chunks(cache, ckvs, comp, room=window + 1, full=chunks if prefix is not None else None)
    rows = []
    for j in range(window):
        logits, _ = rt.forward(torch.tensor([ids[ctx + j]]), torch.tensor([ctx + j]), [Segment(cache, 1)])
        rows.append(logits[0])
    logp = torch.stack(rows).log_softmax(-1)
    ref = dense_logits.log_softmax(-1)
    kl = (ref.exp() * (ref - logp)).sum(-1)
    return {"agreement": (logp.argmax(-1) == ref.argmax(-1)).double().mean().item(), "kl_mean": kl.mean().item()}


def dense_decode(rt: Runtime, kv: torch.Tensor, ids: list[int], ctx: int, window: int) -> torch.Tensor:
    cache = rt.new_cache(ctx + window + 1)
    cache.load_2ltd(0, kv[:, :, :ctx])
    cache.n = ctx
    rows = []
    for j in range(window):
        logits, _ = rt.forward(torch.tensor([ids[ctx + j]]), torch.tensor([ctx + j]), [Segment(cache, 1)])
        rows.append(logits[0])
    return torch.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2, help=f"stdlib files (1..{len(FILES)}, default 2)")
    ap.add_argument("--context", type=int, default=2048, help="prefix tokens, a multiple of 256 (default 2048)")
    ap.add_argument("--window", type=int, default=32, help="query / continuation tokens (default 32)")
    ap.add_argument("--rates", default="8,16,32", help="compression rates (resident fraction 1/rate)")
    ap.add_argument("--epsilons", default="0.01,0.05,0.1,0.3")
    ap.add_argument("--sketches", default="2,exact", help="key sketches: bits (2,4,8) or 'exact'")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--accept-rates", default="8,16", help="rates of measurement (3); empty: skip it")
    ap.add_argument("--accept-new", type=int, default=64, help="new tokens per prompt in measurement (3)")
    ap.add_argument("--quick", action="store_true", help="1 file, 512 tokens, 8x, eps 0.05, 2-bit sketch")
    ap.add_argument("--name", default=None, help="result file name (default verkv, verkv_quick with --quick)")
    args = ap.parse_args()
    if args.quick:
        args.files, args.context, args.window, args.rates, args.epsilons, args.sketches = 1, 512, 8, "8", "0.05", "2"
        args.accept_rates, args.accept_new = "8", 16
    rates = [int(x) for x in args.rates.split(",")]
    accept_rates = [int(x) for x in args.accept_rates.split(",") if x]
    epsilons = [float(x) for x in args.epsilons.split(",")]
    sketches = [None if s == "exact" else int(s) for s in args.sketches.split(",")]
    if not 1 <= args.files <= len(FILES) or args.context % CHUNK or args.context < CHUNK or args.window < 1:
        raise SystemExit(f"--files 1..{len(FILES)}, --context a positive multiple of {CHUNK}, --window >= 1")
    if any(r < 1 for r in rates) or any(e <= 0 for e in epsilons) or any(s not in (None, 2, 4, 8) for s in sketches):
        raise SystemExit("--rates >= 1, --epsilons > 0, --sketches from 2, 4, 8, exact")

    torch.set_grad_enabled(False)
    model, tok = load_model("smollm2", dtype=getattr(torch, args.dtype))
    rt = Runtime(model)
    heads, n_layers = rt.num_kv_heads, rt.num_layers
    rows: list[dict] = []
    d_errs: dict[tuple, list[torch.Tensor]] = {}
    jobs = args.files * len(rates) * (1 + len(sketches) * (1 + len(epsilons)))
    done, t_start = 0, time.perf_counter()
    for fname in FILES[:args.files]:
        ids = tok(stdlib_source(fname), add_special_tokens=False)["input_ids"][:args.context + args.window]
        t0 = time.perf_counter()
        kv, future_q = prefill_kv(model, torch.tensor(ids), window=args.window)
        _, obs_q = prefill_kv(model, torch.tensor(ids[:args.context]), window=OBS)
        dense = dense_decode(rt, kv, ids, args.context, args.window)
        prefix_kv = kv[:, :, :args.context].contiguous()
        say(f"{fname}: prefill and dense decode {time.perf_counter() - t0:.0f} s")
        for rate in rates:
            for name in ("kvzip", "poissoncomp"):
                comp = compressor(name, rate)
                ckvs = [comp.compress(prefix_kv[:, :, i:i + CHUNK].contiguous(), heads, start=i, queries=obs_q)
                        for i in range(0, args.context, CHUNK)]
                ratio = sum(c.full_nbytes for c in ckvs) / sum(c.nbytes for c in ckvs)
                for method, eps, sketch in variants(name, epsilons, sketches):
                    t1 = time.perf_counter()
                    # Two prefixes: the attention pass and the decode pass count their fetches apart.
                    att = attention_rows(prefix_kv, future_q, heads, ckvs, comp,
                                         prefix_for(method, eps, sketch, n_layers))
                    pre = prefix_for(method, eps, sketch, n_layers)
                    dec = decode_rows(rt, kv, ids, args.context, args.window, ckvs, comp, pre, dense)
                    row = {"file": fname, "rate": rate, "method": method, "epsilon": eps,
                           "sketch": sketch_name(method, sketch), "resident_ratio_vs_full": ratio, **att, **dec}
                    d_errs.setdefault((rate, method, eps, row["sketch"]), []).append(row.pop("_d_errs"))
                    if pre is not None:
                        row.update({f"decode_{k}": v for k, v in pre.stats.as_dict().items()})
                    rows.append(row)
                    done += 1
                    elapsed = time.perf_counter() - t_start
                    say(f"{done}/{jobs} {fname} {rate}x {method} eps={eps} sketch={row['sketch']}: "
                        f"agreement {dec['agreement']:.2f}, output error {att['output_error']:.3f} "
                        f"({time.perf_counter() - t1:.0f} s; ~{elapsed / done * (jobs - done) / 60:.0f} min left)")
    summary = summarize(rows, d_errs)
    print_table(summary)
    drafters = acceptance(model, tok, args, accept_rates) if accept_rates else []
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "verkv", "machine": machine_info(), "dtype": args.dtype, "context": args.context,
              "window": args.window, "files": FILES[:args.files], "delta": 0.1, "statistic": "mean over files",
              "summary": summary, "rows": rows, "drafters": drafters}
    out_name = args.name or ("verkv_quick" if args.quick else "verkv")
    (OUT / f"{out_name}.json").write_text(json.dumps(result, indent=1))
    plot(summary, OUT / f"{out_name}.png")
    say(f"wrote {OUT / f'{out_name}.json'}")


def acceptance(model, tok, args, rates: list[int]) -> list[dict]:
    """Measurement (3): the exact mode with each drafter, greedy, against full-KV greedy."""
    from lmcache_vericache.engine import VeriCacheEngine

    prompts = [tok(stdlib_source(f), add_special_tokens=False)["input_ids"][:args.context]
               for f in FILES[:args.files]]
    with VeriCacheEngine(model, "kvzip", store="resident") as eng:
        ref = [r.tokens for r in eng.reference(prompts, args.accept_new)]
    eps = 0.05 if 0.05 in [float(x) for x in args.epsilons.split(",")] else float(args.epsilons.split(",")[0])
    out = []
    for rate in rates:
        for name, verkv in (("kvzip", None), ("poissoncomp", None), ("poissoncomp", {"kvfetch_draft": True,
                                                                                    "epsilon": eps})):
            t0 = time.perf_counter()
            comp = compressor(name, rate)
            with VeriCacheEngine(model, comp.name, comp.params(), draft_len=8, store="resident",
                                 verkv=verkv) as eng:
                res = eng.generate(prompts, args.accept_new)
            fetch = [r.stats.kvfetch["fetch_fraction"] for r in res if r.stats.kvfetch]
            row = {"rate": rate, "drafter": name + (f" + kvfetch eps={eps}" if verkv else ""),
                   "tokens_per_round": statistics.mean(r.stats.mean_accepted for r in res),
                   "identical": all(r.tokens == t for r, t in zip(res, ref)),
                   "fetch_fraction": statistics.mean(fetch) if fetch else None}
            out.append(row)
            say(f"drafter {rate}x {row['drafter']}: {row['tokens_per_round']:.2f} tokens/round, "
                f"identical {row['identical']} ({time.perf_counter() - t0:.0f} s)")
    print(f"{'rate':>4} {'drafter':<32} {'tok/round':>9} {'identical':>9} {'traffic':>8}")
    for r in out:
        traffic = "-" if r["fetch_fraction"] is None else f"{r['fetch_fraction']:.3f}"
        print(f"{r['rate']:>3}x {r['drafter']:<32} {r['tokens_per_round']:>9.2f} {str(r['identical']):>9} {traffic:>8}")
    return out


def summarize(rows: list[dict], d_errs: dict) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["rate"], r["method"], r["epsilon"], r["sketch"]), []).append(r)
    out = []
    for (rate, method, eps, sketch), rs in groups.items():
        def mean(k: str, rs: list[dict] = rs) -> float | None:
            return statistics.mean(r[k] for r in rs) if k in rs[0] else None
        errs = torch.cat(d_errs[(rate, method, eps, sketch)])
        tol = eps if eps is not None else 0.05
        out.append({"rate": rate, "method": method, "epsilon": eps, "sketch": sketch,
                    "resident_ratio_vs_full": mean("resident_ratio_vs_full"), "agreement": mean("agreement"),
                    "kl_mean": mean("kl_mean"), "output_error": mean("output_error"),
                    "denominator_violations": (errs > tol).double().mean().item(), "violation_tolerance": tol,
                    "decisions": errs.numel(), "fetch_fraction": mean("decode_fetch_fraction"),
                    "fetching_decisions": mean("decode_fetching_decision_fraction")})
    return out


def print_table(summary: list[dict]) -> None:
    head = (f"{'rate':>4} {'method':<11} {'eps':>5} {'sketch':>6} {'agree':>6} {'KL':>7} {'out err':>7} "
            f"{'viol.':>6} {'fetch dec.':>10} {'traffic':>8}")
    print(head + "\n" + "-" * len(head))
    for s in summary:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"{s['rate']:>3}x {s['method']:<11} {fmt(s['epsilon'], '>5'):>5} {s['sketch']:>6} "
              f"{s['agreement']:>6.3f} {s['kl_mean']:>7.4f} {s['output_error']:>7.4f} "
              f"{s['denominator_violations']:>6.3f} {fmt(s['fetching_decisions'], '>10.3f'):>10} "
              f"{fmt(s['fetch_fraction'], '>8.3f'):>8}")
    print("viol.: share of (query, head) decisions with |D^ - D| / D > eps (0.05 for kvzip/poissoncomp); "
          "fetch dec.: decisions that fetch; traffic: fraction of the prefix read from the full tier per token")


def plot(summary: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for (rate, sketch) in sorted({(s["rate"], s["sketch"]) for s in summary if s["method"] == "verkv"}):
        pts = sorted((s["epsilon"], s["fetch_fraction"], s["agreement"]) for s in summary
                     if s["method"] == "verkv" and s["rate"] == rate and s["sketch"] == sketch)
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{rate}x, {sketch} sketch")
        b.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=f"VerKV {rate}x, {sketch}")
    for s in summary:
        if s["method"] in ("kvzip", "poissoncomp") and s["sketch"] in ("-", "exact", "2-bit"):
            b.scatter([0.0], [s["agreement"]], marker="x" if s["method"] == "kvzip" else "+")
    a.set(xscale="log", xlabel="epsilon", ylabel="prefix fraction fetched per token", title="KVFetch traffic")
    b.set(xlabel="prefix fraction fetched per token", ylabel="next-token agreement with dense",
          title="quality vs traffic (x kvzip, + poissoncomp alone)")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
