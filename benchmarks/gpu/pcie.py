"""GPU check stage ``pcie``: host<->device copy bandwidth, pinned vs pageable host memory, and whether a
copy on a side stream overlaps a matmul on the default stream (what the connector's load and save
streams rely on).

Bandwidth: GB/s (1e9 bytes/s) per direction, host memory kind and size (a 256-token SmolLM2 chunk
is ~5.9 MB; 256 MiB stands for a batch). Overlap, per direction: milliseconds of the copies alone,
of bf16 matmuls sized to take about as long alone, and of both issued together;
``overlap = (copy + matmul - both) / min(copy, matmul)``: 1 when the shorter one hides entirely, 0
when they serialize.

    python benchmarks/gpu/pcie.py [--dry-run]     (--dry-run: small sizes)
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from common import cuda_ms, require_cuda, run_stage


def bandwidth(torch, mib: float, reps: int) -> dict[str, float]:
    n = int(mib * 2**20)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for kind in ("pinned", "pageable"):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
        for name, copy in (("h2d", lambda h=host: dev.copy_(h, non_blocking=True)),
                           ("d2h", lambda h=host: h.copy_(dev, non_blocking=True))):
            out[f"{name}_{kind}_gb_s"] = round(n / (cuda_ms(copy, reps) * 1e6), 2)
    return out


def overlap(torch, mib: float, reps: int, matmul_n: int) -> dict[str, Any]:
    n = int(mib * 2**20)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    x = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    one_mm = cuda_ms(lambda: x @ x, 3)
    out: dict[str, Any] = {"copy_bytes": n * reps, "matmul_n": matmul_n, "one_matmul_ms": round(one_mm, 3)}
    cur = torch.cuda.current_stream()

    def issue(copy, k: int):
        """Copies on the side stream (after the current stream's work) and ``k`` matmuls on the current one."""
        def run():
            if copy is not None:
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    for _ in range(reps):
                        copy()
            for _ in range(k):
                x @ x
            if copy is not None:
                cur.wait_stream(side)
        return run

    for name, copy in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                       ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        k = max(1, math.ceil(cuda_ms(issue(copy, 0), 2) / one_mm))
        t_copy, t_mm, t_both = (cuda_ms(issue(c, m), 2) for c, m in ((copy, 0), (None, k), (copy, k)))
        out[name] = {"copy_ms": round(t_copy, 3), "matmul_ms": round(t_mm, 3), "both_ms": round(t_both, 3),
                     "matmuls": k, "overlap": round((t_copy + t_mm - t_both) / min(t_copy, t_mm), 3)}
    return out


def pcie(dry_run: bool) -> dict[str, Any]:
    torch = require_cuda()
    sizes, reps = ((1,), 2) if dry_run else ((6, 256), 5)
    out: dict[str, Any] = {f"{mib}_mib": bandwidth(torch, mib, reps) for mib in sizes}
    out["overlap"] = overlap(torch, sizes[-1], 4 if not dry_run else 1, 256 if dry_run else 8192)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="small sizes")
    args = ap.parse_args()
    return run_stage("pcie", lambda: pcie(args.dry_run))


if __name__ == "__main__":
    raise SystemExit(main())
