"""``vericache compressors`` run for real, in a subprocess, on a short prefix of a real file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CLI = [sys.executable, "-c", "import sys; from lmcache_vericache.cli import main; sys.exit(main())", "compressors"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def test_json_rows_for_chosen_methods():
    p = _run("--stdlib", "json/decoder.py", "--tokens", "256", "--window", "16",
             "--methods", "int8,streamingllm", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["file"].endswith("json/decoder.py") and (out["tokens"], out["window"]) == (256, 16)
    rows = {r["method"]: r for r in out["rows"]}
    assert set(rows) == {"int8", "streamingllm"}
    int8, sllm = rows["int8"], rows["streamingllm"]
    assert int8["kept"] == 1.0 and 3.5 < int8["ratio"] < 4.0 and 0 < int8["attn_err"] < 0.05
    assert sllm["kept"] == pytest.approx(0.25, abs=0.01) and sllm["ratio"] > 3.5
    assert sllm["k_err"] == 0.0 and sllm["v_err"] == 0.0 and sllm["attn_err"] > int8["attn_err"]


def test_table_lists_every_example_of_the_method(tmp_path):
    from lmcache_vericache import compressors

    src = tmp_path / "code.py"
    src.write_text(open(compressors.__file__).read() * 4)
    p = _run("--file", str(src), "--tokens", "256", "--methods", "int8,none")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method"))
    assert lines[header].split()[-2:] == ["attn", "err"]
    rows = [line.split() for line in lines[header + 2:]]
    n_int8 = len(compressors.examples("int8"))
    assert [r[0] for r in rows] == ["int8"] * n_int8 + ["none"]
    assert rows[-1][2:] == ["1.00", "1.00", "0.0000", "0.0000", "0.0000"]  # identity: exact


@pytest.mark.parametrize("args, message", [
    (["--methods", "int8,nope"], "unknown method(s) ['nope']"),
    (["--file", "/no/such/file.py"], "No such file"),
    (["--tokens", "0"], "--tokens and --window must be > 0"),
])
def test_bad_input_is_a_clear_error(args, message):
    p = _run(*args)
    assert p.returncode == 2 and message in p.stderr and not p.stdout
