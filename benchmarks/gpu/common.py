"""Shared parts of the prepared GPU check (``benchmarks/gpu/check.sh``): one JSON line per stage.

A stage line is ``{"stage", "ok", "seconds", "results"?, "error"?, "skipped"?}``, printed on stdout and
appended to ``$OUT/gpu_check.jsonl`` (``$OUT`` defaults to ``benchmarks/results/gpu``). Stage scripts
call :func:`run_stage`; ``check.sh`` runs every stage through ``wrap`` (below), which enforces the
stage's time limit and writes the line itself when the stage could not (killed at its limit, crashed
before Python ran, or an external script that prints only its results).

Standard library only at import: ``check.sh`` also runs this file with the system Python when the
venv is not there (failed install).

    python common.py emit --stage NAME --error TEXT | --skipped TEXT
    python common.py wrap --stage NAME --timeout S --log FILE -- CMD ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "gpu_check.jsonl"
TAIL_LINES = 15


class StageError(RuntimeError):
    """A stage that ran but failed; ``results`` is what it measured before failing."""

    def __init__(self, message: str, results: dict[str, Any] | None = None):
        super().__init__(message)
        self.results = results


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "gpu")
    path.mkdir(parents=True, exist_ok=True)
    return path


def tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def emit(stage: str, ok: bool, seconds: float, **fields: Any) -> dict[str, Any]:
    """Print the stage's one line and append it to ``$OUT/gpu_check.jsonl``."""
    line = {"stage": stage, "ok": ok, "seconds": round(seconds, 2),
            **{k: v for k, v in fields.items() if v is not None}}
    text = json.dumps(line, default=str)
    print(text, flush=True)
    with open(out_dir() / RESULTS, "a") as f:
        f.write(text + "\n")
    return line


def run_stage(stage: str, fn: Callable[[], dict[str, Any]]) -> int:
    """Run ``fn`` (returns the stage's results) and emit its line; any exception becomes ``ok: false``
    with the traceback's last lines. Returns the process exit status."""
    t0 = time.perf_counter()
    try:
        results = fn()
    except Exception as e:  # the line must say what failed, whatever it was
        emit(stage, False, time.perf_counter() - t0, results=getattr(e, "results", None),
             error=f"{type(e).__name__}: {e}" if isinstance(e, StageError) else tail(traceback.format_exc()))
        return 1
    emit(stage, True, time.perf_counter() - t0, results=results)
    return 0


def require_cuda():
    """``torch`` when a CUDA device is usable; else :class:`StageError` ``no CUDA`` (or ``no torch``)."""
    try:
        import torch
    except ImportError as e:  # a failed install
        raise StageError(f"no torch: {e}") from None

    if not torch.cuda.is_available():
        raise StageError(f"no CUDA: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU")
    return torch


def cuda_ms(fn: Callable[[], Any], reps: int) -> float:
    """Milliseconds per call of ``fn`` on the current stream (one warm-up call first)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def step_ms(fn: Callable[[], Any], reps: int, cuda: bool = True) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` (one warm-up call first): CUDA events around
    each call on the current stream, or the host clock where ``cuda`` is false (a CPU smoke run).
    For medians: unlike :func:`cuda_ms`'s mean, one slow call does not move them."""
    fn()
    if not cuda:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    import torch

    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _stage_line(stdout: str, stage: str) -> dict | None:
    """The stage line the command emitted itself, if any."""
    for text in stdout.splitlines():
        obj = _json_object(text)
        if obj is not None and obj.get("stage") == stage and "ok" in obj:
            return obj
    return None


def _json_object(text: str) -> dict | None:
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def wrap(stage: str, timeout: float, log: Path, cmd: list[str]) -> int:
    """Run ``cmd`` in its own process group, killed at ``timeout`` s. If it emitted its own stage line,
    pass it on; else make one: its last stdout JSON object as results (exit 0), or the error with the
    log's last lines. Its stdout is also appended to ``log``, after its stderr."""
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            rc = "timeout"
    seconds = time.perf_counter() - t0
    own = _stage_line(stdout, stage)
    with open(log, "a") as f:
        f.write(stdout)
    if own is not None:
        print(json.dumps(own), flush=True)
        return 0 if own["ok"] else 1
    results = next((o for o in map(_json_object, reversed(stdout.splitlines())) if o is not None), None)
    if rc == 0 and results is not None:
        emit(stage, True, seconds, results=results)
        return 0
    why = f"killed at its {timeout:.0f} s limit" if rc == "timeout" else f"exit status {rc}"
    emit(stage, False, seconds, results=results, error=f"{why}\n{tail(log.read_text(errors='replace'))}")
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("emit", help="one line for a stage that did not run")
    e.add_argument("--stage", required=True)
    what = e.add_mutually_exclusive_group(required=True)
    what.add_argument("--error", help="why it failed")
    what.add_argument("--skipped", help="why it did not run")
    w = sub.add_parser("wrap", help="run a stage command with a time limit; exactly one line for it")
    w.add_argument("--stage", required=True)
    w.add_argument("--timeout", type=float, required=True, help="seconds")
    w.add_argument("--log", type=Path, required=True, help="the command's stderr and other stdout")
    w.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...")
    args = ap.parse_args(argv)
    if args.command == "emit":
        emit(args.stage, False, 0.0, error=args.error, skipped=args.skipped)
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("wrap: no command after --")
    return wrap(args.stage, args.timeout, args.log, cmd)


if __name__ == "__main__":
    raise SystemExit(main())
