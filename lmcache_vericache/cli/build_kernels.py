"""``vericache build-kernels``: compile the package's C++ kernels for this CPU ahead of their first use.

Otherwise the first run that needs a kernel (``vericache generate``, vLLM's model load) compiles it
on the spot. Builds are cached outside the repository (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) by a hash of source, headers, flags and CPU flags, so a second run
only checks and loads them. One progress line per kernel on stderr; exits 1 if any failed to build.
``VERICACHE_NO_KERNELS`` does not apply here: it turns the kernels off at run time, not their build.
"""

from __future__ import annotations

import argparse
import sys
import time

# Per kernel, for the estimate before any build of this run has been timed.
DEFAULT_BUILD_S = 30.0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("build-kernels", help="compile the C++ kernels for this CPU (cached)",
                              description=__doc__)
    p.add_argument("names", nargs="*", metavar="NAME", help="kernels to build (default: all)")


def run(args: argparse.Namespace) -> int:
    from ..engine import kernels

    available = kernels.names()
    unknown = sorted(set(args.names) - set(available))
    if unknown:
        print(f"vericache build-kernels: unknown kernel(s) {', '.join(unknown)}; "
              f"available: {', '.join(available)}", file=sys.stderr)
        return 2
    todo = args.names or available
    pending = [n for n in todo if not kernels.is_built(n)]
    times: list[float] = []
    failed = []
    for i, name in enumerate(todo, 1):
        building = name in pending
        if building:
            each = sum(times) / len(times) if times else DEFAULT_BUILD_S
            left = each * sum(n in pending for n in todo[i - 1:])
            print(f"[{i}/{len(todo)}] {name}: building (~{each:.0f} s each, ~{left:.0f} s left)...", end=" ",
                  file=sys.stderr, flush=True)
        else:
            print(f"[{i}/{len(todo)}] {name}:", end=" ", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            # A cached one is loaded too: a library that does not load fails here, not in a later run.
            kernels.load(name)
        except Exception as e:
            failed.append(name)
            print(f"failed: {e}", file=sys.stderr, flush=True)
            continue
        if building:
            times.append(time.perf_counter() - t)
            print(f"done in {times[-1]:.1f} s", file=sys.stderr, flush=True)
        else:
            print("cached", file=sys.stderr, flush=True)
    if failed:
        print(f"vericache build-kernels: {len(failed)} of {len(todo)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
