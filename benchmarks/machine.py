"""Shared by the benchmarks: what a benchmark ran on, recorded in every result JSON (machines differ:
an AVX2-only CPU runs bf16 slower than fp32, one with AVX-512 BF16 or AMX does not), progress lines
and the optional plot backend."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")


def machine_info() -> dict:
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return dict(machine=platform.machine(), cpu=model, cpu_flags=[f for f in _FLAGS if f in flags],
                cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__)


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` (said on stderr) where
    matplotlib is not installed: plots are optional, the JSON is the result."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    return plt


_T0 = time.perf_counter()


def say(msg: str) -> None:
    """A progress line on stderr with the minutes since the benchmark started."""
    print(f"[{(time.perf_counter() - _T0) / 60:5.1f} min] {msg}", file=sys.stderr, flush=True)


def elapsed_s() -> float:
    """Seconds since the benchmark started."""
    return time.perf_counter() - _T0


def interleaved_times_s(paths: dict, reps: int, inputs: list[tuple] | None = None) -> dict[str, list[float]]:
    """Seconds of each of ``reps`` calls ``paths[name](*inputs[i])`` (no arguments by default), the
    paths called in turn every repeat (machine noise hits them alike), after one warm-up call each.
    Every call takes the next of ``inputs`` in turn, so no path reads what the call before it just
    read: given more inputs than the last-level cache holds, every call reads from DRAM. (When the
    paths of a repeat shared one input, the second and later ones found it in L3: the dense
    attention kernel's bf16 path measured 0.26-0.27 ms there against 0.40 ms from DRAM at 8k.)"""
    inputs = inputs or [()]
    for f in paths.values():
        f(*inputs[0])
    times: dict[str, list[float]] = {name: [] for name in paths}
    i = 0
    for _ in range(reps):
        for name, f in paths.items():
            i = (i + 1) % len(inputs)
            t = time.perf_counter()
            f(*inputs[i])
            times[name].append(time.perf_counter() - t)
    return times


def interleaved_medians_ms(paths: dict, reps: int, inputs: list[tuple] | None = None) -> dict[str, float]:
    """Median milliseconds of each path's calls (:func:`interleaved_times_s`)."""
    return {name: statistics.median(ts) * 1e3 for name, ts in interleaved_times_s(paths, reps, inputs).items()}


def save_rows(results: Path, name: str, out: dict) -> Path:
    """Write ``out`` to ``results/<name>.json``, print its rows, say where it went."""
    results.mkdir(exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["rows"], indent=1))
    say(f"saved {path}")
    return path
