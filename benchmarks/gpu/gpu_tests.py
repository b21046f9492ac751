"""The ``tests`` stage of the GPU check: ``pytest -m gpu tests/gpu`` (the connector's data
path and the proposer's draft path on CUDA, no vLLM or LMCache needed), one JSON line with the counts
and each failure's name and last lines.

    python benchmarks/gpu/gpu_tests.py [--dry-run]    # --dry-run: collect only (any host)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, StageError, run_stage, tail  # noqa: E402


def run(dry_run: bool) -> dict:
    try:
        import pytest  # noqa: F401  (the image's python3 may not have it offline)
    except ImportError:
        raise StageError(f"pytest is not installed for {sys.executable}: carry its wheel in .whl/ "
                         "(README.md, offline machines)") from None
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu",
               f"--junitxml={xml}"]
        if dry_run:
            cmd.append("--collect-only")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        print(proc.stdout + proc.stderr, file=sys.stderr)  # the stage's log
        if not xml.exists():
            raise StageError(f"pytest wrote no report (exit {proc.returncode}): {tail(proc.stdout + proc.stderr, 5)}")
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        failures = []
        for case in suite.iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                failures.append({"test": case.get("name"), "message": tail(bad.get("message") or bad.text or "", 4)})
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    results = {**counts, "failed": failures, "collect_only": dry_run}
    if dry_run:  # the report lists no cases when nothing ran: the count is pytest's own line
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)  # "N/M": N selected of M
        results["tests"] = int(found.group(1)) if found else 0
    if failures or (not dry_run and proc.returncode not in (0, 5)):
        raise StageError(f"{len(failures)} of {counts['tests']} GPU tests failed", results)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="collect the tests, run none")
    args = ap.parse_args(argv)
    return run_stage("tests", lambda: run(args.dry_run))


if __name__ == "__main__":
    raise SystemExit(main())
