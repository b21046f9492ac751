"""The kernels' warm step: ``vericache build-kernels`` builds (or finds cached) every kernel and
says so per kernel, :func:`kernels.is_built` tells a built kernel from one that is not without
building it, and the first build of a process says on stderr, once, that it is compiling."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from lmcache_vericache.engine import kernels

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: nothing to build")
CLI = [sys.executable, "-c", "import sys; from lmcache_vericache.cli import main; sys.exit(main())", "build-kernels"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VERICACHE_NO_KERNELS"}
    return {**env, **extra}


def test_names_are_the_kernels_callers_build():
    assert {"dense_attention", "int8_attention", "linear"} <= set(kernels.names())


@needs_compiler
def test_build_kernels_reports_every_kernel_and_leaves_them_built():
    # Real builds into the real cache: a few minutes the first time on a 2-core machine, then loads.
    p = subprocess.run(CLI, capture_output=True, text=True, timeout=1200, env=_env())
    assert p.returncode == 0, p.stderr
    names = kernels.names()
    for i, name in enumerate(names, 1):
        line = re.escape(f"[{i}/{len(names)}] {name}:")
        assert re.search(rf"^{line} (cached|building \(~\d+ s each, ~\d+ s left\)\.\.\. done in [\d.]+ s)$",
                         p.stderr, re.M), p.stderr
        assert kernels.is_built(name)
    again = subprocess.run(CLI, capture_output=True, text=True, timeout=300, env=_env())
    assert again.returncode == 0, again.stderr
    assert again.stderr.count(": cached\n") == len(names) and "building" not in again.stderr
    assert kernels.NOTICE not in p.stderr + again.stderr  # the command says it per kernel instead


def test_build_kernels_fails_with_the_error_when_a_build_fails(tmp_path):
    # torch's build takes its compiler from CXX: one that always fails, in an empty extension dir.
    env = _env(TORCH_EXTENSIONS_DIR=str(tmp_path), CXX="false")
    p = subprocess.run([*CLI, "linear"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 1, p.stderr
    assert re.search(r"^\[1/1\] linear: building .*\.\.\. failed: .*false", p.stderr, re.M), p.stderr
    assert "1 of 1 failed: linear" in p.stderr


def test_build_kernels_rejects_an_unknown_kernel():
    p = subprocess.run([*CLI, "linear", "no_such_kernel"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no_such_kernel" in p.stderr and "linear" in p.stderr


@needs_compiler
def test_a_cold_build_says_so_once_and_is_built_after(tmp_path):
    """A real cold build of the ``linear`` kernel (about half a minute) in an empty extension dir."""
    code = ("import sys\n"
            "from lmcache_vericache.engine import kernels\n"
            "assert not kernels.is_built('linear')\n"
            "assert kernels.build('linear') is not None\n"
            "assert kernels.is_built('linear')\n"
            "print('built', file=sys.stderr)\n")
    env = _env(TORCH_EXTENSIONS_DIR=str(tmp_path))
    cold = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert cold.returncode == 0, cold.stderr
    assert cold.stderr.count(kernels.NOTICE) == 1 and cold.stderr.index(kernels.NOTICE) < cold.stderr.index("built")
    assert any(p.name.endswith(".so") for p in tmp_path.glob(f"{kernels.module_name('linear')}/*"))
    warm = subprocess.run([sys.executable, "-c", "from lmcache_vericache.engine import kernels; "
                           "assert kernels.is_built('linear') and kernels.build('linear') is not None"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert warm.returncode == 0, warm.stderr
    assert kernels.NOTICE not in warm.stderr


def test_the_notice_is_printed_once_per_process(monkeypatch, capsys):
    monkeypatch.delenv("VERICACHE_NO_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "is_built", lambda *a, **k: False)
    monkeypatch.setattr(kernels, "load", lambda name, *a, **k: name)
    monkeypatch.setattr(kernels, "_noticed", False)
    kernels.build.cache_clear()
    try:
        assert [kernels.build("a"), kernels.build("b"), kernels.build("a", 8)] == ["a", "b", "a"]
    finally:
        kernels.build.cache_clear()  # the stubbed results must not outlive this test
    assert capsys.readouterr().err.count(kernels.NOTICE) == 1
