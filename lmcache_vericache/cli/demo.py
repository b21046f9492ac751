"""``vericache demo``: what VeriCache is for, in one run on built-in defaults (``make run``).

One prompt (the first ``--prompt-tokens`` tokens of real code) is decoded greedily three ways on
SmolLM2-135M, in the same runtime:

1. the compressed KV decoded alone, with no verification: where it leaves full-KV greedy decoding
   (the first divergent token, and both texts from that line on, side by side);
2. plain full-KV greedy decoding, the reference;
3. VeriCache: ``--draft-len`` tokens drafted on the same compressed KV, verified in one forward on
   the full KV: tokens per round, the share of drafts accepted, and its output, which must be
   identical to the reference.

Then both decode speeds measured in this run (tokens/s, prefill excluded) and their ratio. Progress
goes to stderr; ``--json`` prints the numbers as one JSON object. Exits 1 if VeriCache's tokens
differ from full-KV greedy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_COMPRESSOR = "streamingllm"
DEFAULT_PROMPT = "humaneval"  # the HumanEval prompts, one after another
DEFAULT_DRAFT_LEN = 8
MAX_DRAFT_LEN = 64  # the engine's default max_draft_len
COLUMN = 44  # width of each side of the side-by-side texts
SHOWN_LINES = 6


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="VeriCache vs full-KV greedy vs the lossy cache alone, on defaults",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressor", default=DEFAULT_COMPRESSOR, help=f"draft KV compressor (default {DEFAULT_COMPRESSOR})")
    p.add_argument("--compressor-params", default=None, metavar="JSON",
                   help="compressor parameters as a JSON object (default: the method's defaults)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, metavar="SOURCE",
                   help="'humaneval' (the HumanEval prompts, one after another; default), a standard library "
                        "file relative to its folder (e.g. json/decoder.py) or a path to a text file")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="the prompt's first N tokens (default 1024)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--draft-len", type=int, default=DEFAULT_DRAFT_LEN,
                   help=f"drafts per round, fixed (default {DEFAULT_DRAFT_LEN}); `vericache generate --draft-len "
                        "auto` chooses it from measured costs, and on a CPU at short contexts chooses plain decoding")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (default 0: torch's choice); 1 on a host shared with other jobs, "
                        "where threads spinning against each other slow every step")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


def _parse(args: argparse.Namespace) -> dict:
    """Every option checked before the model loads; returns the compressor's parameters."""
    from .. import compressors

    params = {}
    if args.compressor_params is not None:
        try:
            params = json.loads(args.compressor_params)
        except json.JSONDecodeError as e:
            raise ValueError(f"--compressor-params is not valid JSON: {e}") from e
        if not isinstance(params, dict):
            raise ValueError("--compressor-params must be a JSON object")
    if args.compressor in ("identity", "none"):
        raise ValueError(f"--compressor {args.compressor} is lossless: there is nothing to show")
    try:
        compressors.get(args.compressor, **params)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--compressor {args.compressor} {params}: {e}") from e
    if args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    if args.max_new_tokens < 2:
        raise ValueError(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
    if not 1 <= args.draft_len <= MAX_DRAFT_LEN:
        raise ValueError(f"--draft-len must be in 1..{MAX_DRAFT_LEN}, got {args.draft_len}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    _prompt_text(args.prompt, check_only=True)
    return params


def _prompt_text(source: str, check_only: bool = False) -> str:
    from ..data import humaneval_prompts, stdlib_path

    if source == "humaneval":
        prompts = humaneval_prompts()  # raises with the install command when the data is missing
        return "" if check_only else "\n".join(prompts)
    path = Path(source)
    if not path.is_file():
        try:
            path = stdlib_path(source)
        except FileNotFoundError:
            raise ValueError(f"--prompt: no file {source!r} (nor a standard library file of that name)") from None
    return "" if check_only else path.read_text(encoding="utf-8", errors="replace")


class Progress:
    """Progress lines on stderr: time since the start and an estimate of what is left."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str, left_s: float | None = None) -> None:
        el = time.perf_counter() - self.t0
        tail = f"; about {left_s:.0f} s left" if left_s is not None else ""
        print(f"[demo {el:6.1f} s] {msg}{tail}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        params = _parse(args)
    except (ValueError, RuntimeError) as e:
        print(f"vericache demo: error: {e}", file=sys.stderr)
        return 2
    out = _run(args, params)
    if args.json:
        print(json.dumps(out))
    else:
        print(_report(out))
    return 0 if out["identical"] else 1


def _run(args: argparse.Namespace, params: dict) -> dict:
    import torch

    from ..engine import VeriCacheEngine, kernels
    from ..engine.lossy import first_divergence, loops
    from ..models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    say = Progress()
    t = time.perf_counter()
    names = kernels.names()
    built = sum(kernels.build(n) is not None for n in names)  # a first build prints a notice first
    say(f"C++ kernels: {built} of {len(names)} ready ({time.perf_counter() - t:.1f} s)"
        + ("" if built == len(names) else "; the rest take the slower PyTorch path"))
    t = time.perf_counter()
    model, tok = load_model("smollm2", dtype=getattr(torch, args.dtype))
    say(f"model SmolLM2-135M ({args.dtype}) loaded ({time.perf_counter() - t:.1f} s)")
    text = _prompt_text(args.prompt)
    ids = tok(text, add_special_tokens=False)["input_ids"][:args.prompt_tokens]
    if len(ids) < args.prompt_tokens:
        say(f"the prompt has only {len(ids)} tokens (--prompt-tokens {args.prompt_tokens})")
    n, new = len(ids), args.max_new_tokens

    # 1. The compressed KV alone (no store: the engine compresses the prompt's chunks itself). Its
    # prefill and decode also warm the runtime up before the two timed decodes.
    plain = VeriCacheEngine(model, args.compressor, params or None, store="resident")
    clock = {"start": time.perf_counter()}

    def on_step(i: int) -> None:
        now = time.perf_counter()
        if i == 1:
            clock["prefill"] = now - clock["start"]
            clock["step0"] = now
            say(f"prefill: {n} prompt tokens, exact KV and its {args.compressor} compression "
                f"({clock['prefill']:.1f} s); decoding on the compressed KV alone")
        elif i % 32 == 0 or i == new:
            step = (now - clock["step0"]) / (i - 1)
            left = (new - i) * step + 2 * (clock["prefill"] + new * step)
            say(f"  lossy decode: {i}/{new} tokens ({1 / step:.1f} tok/s)", left)

    [lossy] = plain.lossy([ids], new, on_step=on_step)
    step = (time.perf_counter() - clock["step0"]) / max(1, len(lossy.tokens) - 1)

    # 2. Full-KV greedy, timed (decode only: its prefill is excluded, as VeriCache's is).
    say(f"full-KV greedy decoding: prefill + {new} tokens", clock["prefill"] * 2 + new * step * 2)
    t = time.perf_counter()
    [ref] = plain.reference([ids], new)
    full_s = time.perf_counter() - t - ref.stats.prefill_s
    full_tok_s = len(ref.tokens) / full_s
    say(f"full-KV greedy: {len(ref.tokens)} tokens at {full_tok_s:.1f} tok/s (prefill and set-up {ref.stats.prefill_s:.1f} s)",
        ref.stats.prefill_s + full_s)

    # 3. VeriCache (the engine's default memory store holds the full and compressed chunks).
    say(f"VeriCache decoding: prefill + {new} tokens, {args.draft_len} drafts per round")
    with VeriCacheEngine(model, args.compressor, params or None, draft_len=args.draft_len) as eng:
        t = time.perf_counter()
        [res] = eng.generate([ids], new)
        vc_s = time.perf_counter() - t - res.stats.prefill_s
        comp = eng.compressor
    vc_tok_s = len(res.tokens) / vc_s
    s = res.stats
    say(f"VeriCache: {len(res.tokens)} tokens at {vc_tok_s:.1f} tok/s (prefill and set-up {s.prefill_s:.1f} s); done")

    div = first_divergence(lossy.tokens, ref.tokens)
    drafted, accepted = sum(s.drafted), sum(s.accepted)
    out = {
        "model": "smollm2", "dtype": args.dtype, "compressor": comp.name, "compressor_params": comp.params(),
        "compression_ratio": s.compression_ratio, "prompt": args.prompt, "prompt_tokens": n,
        "max_new_tokens": new, "draft_len": args.draft_len,
        "new_tokens": len(res.tokens), "rounds": s.rounds, "tokens_per_round": s.mean_accepted,
        "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0,
        "identical": res.tokens == ref.tokens, "reference_loops": loops(ref.tokens), "lossy_loops": loops(lossy.tokens),
        "lossy_first_divergence": div,
        "lossy_agreement": sum(a == b for a, b in zip(lossy.tokens, ref.tokens)) / max(1, len(ref.tokens)),
        "full_tok_s": full_tok_s, "vericache_tok_s": vc_tok_s, "speedup": vc_tok_s / full_tok_s,
        "full_decode_s": full_s, "vericache_decode_s": vc_s, "prefill_s": ref.stats.prefill_s,
        "wall_s": time.perf_counter() - say.t0, "cpu_threads": torch.get_num_threads(),
        "text": tok.decode(res.tokens), "tokens": res.tokens, "reference_tokens": ref.tokens,
        "lossy_tokens": lossy.tokens,
    }
    if div is not None:
        out["divergence"] = _divergence(tok, ref.tokens, lossy.tokens, div)
    return out


def _divergence(tok, ref: list[int], lossy: list[int], i: int) -> dict:
    """The first divergent token of each side and both texts from the start of that line."""
    head = tok.decode(ref[:i])
    line_start = head.rfind("\n") + 1
    shared = head[line_start:]
    return {"position": i, "full_token": tok.decode(ref[i:i + 1]), "lossy_token": tok.decode(lossy[i:i + 1]),
            "shared_text": head, "full_text": shared + tok.decode(ref[i:]), "lossy_text": shared + tok.decode(lossy[i:])}


def _side_by_side(left: str, right: str, width: int = COLUMN, lines: int = SHOWN_LINES) -> list[str]:
    def cut(s: str) -> list[str]:
        rows = [r.replace("\t", "    ") for r in s.split("\n")][:lines]
        return [r if len(r) <= width else r[:width - 1] + "~" for r in rows]
    a, b = cut(left), cut(right)
    a += [""] * (len(b) - len(a))
    b += [""] * (len(a) - len(b))
    return [f"  {x:<{width}} | {y}".rstrip() for x, y in zip(a, b)]


def _report(o: dict) -> str:
    p = ", ".join(f"{k}={v}" for k, v in o["compressor_params"].items())
    lines = [
        f"VeriCache demo: SmolLM2-135M ({o['dtype']}), prompt: the first {o['prompt_tokens']} tokens of "
        f"{'the HumanEval prompts' if o['prompt'] == 'humaneval' else o['prompt']}, {o['max_new_tokens']} new tokens, "
        f"greedy",
        f"drafter: {o['compressor']} ({p}), the prompt's KV {o['compression_ratio']:.1f}x smaller; "
        f"{o['draft_len']} drafts per round",
        "",
        "VeriCache (draft on the compressed KV, verify on the full KV):",
        f"  {o['new_tokens']} tokens in {o['rounds']} rounds: {o['tokens_per_round']:.1f} tokens/round, "
        f"{100 * o['acceptance']:.0f}% of drafts accepted",
        f"  identical to full-KV greedy: {o['identical']}"
        + ("" if not o["reference_loops"] else " (the output ends in a loop, which inflates acceptance)"),
        "",
        "The same compressed KV decoded alone (no verification):",
    ]
    d = o.get("divergence")
    if d is None:
        lines.append(f"  stays with full-KV greedy for all {o['new_tokens']} tokens here (try more --max-new-tokens)")
    else:
        lines += [f"  leaves full-KV greedy at token {d['position'] + 1} of {o['new_tokens']}: "
                  f"{d['full_token']!r} (full KV) vs {d['lossy_token']!r} (compressed KV alone); "
                  f"{100 * o['lossy_agreement']:.0f}% of its tokens agree by position", ""]
        lines += _side_by_side("full-KV greedy = VeriCache", "compressed KV alone")
        lines.append(f"  {'-' * COLUMN}-+-{'-' * COLUMN}")
        lines += _side_by_side(d["full_text"], d["lossy_text"])
    lines += [
        "",
        f"Speed, decode only (prefill excluded), one measurement each in this run, {o['cpu_threads']} CPU threads:",
        f"  full-KV {o['full_tok_s']:.1f} tok/s, VeriCache {o['vericache_tok_s']:.1f} tok/s: {o['speedup']:.2f}x",
    ]
    if o["speedup"] < 1:
        lines += [f"  VeriCache was slower here. At {o['prompt_tokens']} tokens of context a CPU decode step is bound by",
                  "  reading the weights, not the KV: drafting on a smaller KV saves little, and verifying",
                  f"  {o['draft_len'] + 1} tokens at once costs a few steps' arithmetic."]
    else:
        lines += ["  VeriCache was faster here; a shared host's speed moves by 10-40% between runs."]
    lines += ["  VeriCache pays where reading the KV dominates a step (long contexts, batches): see",
              "  README.md, 'Current results', and docs/benchmarks.md, 'What the machine allows'."]
    return "\n".join(lines)
