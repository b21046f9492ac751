"""``lmcache_vericache.testing`` is a library for scripts and benchmarks too: every module but the
fixtures imports where pytest is not installed, and a missing server binary is an exception there,
not a pytest skip."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import lmcache_vericache.testing
from lmcache_vericache.testing import servers

PLAIN = sorted(m.name for m in pkgutil.iter_modules(lmcache_vericache.testing.__path__) if m.name != "fixtures")


def test_every_module_but_the_fixtures_imports_without_pytest():
    assert {"servers", "throttle", "lmcache_engine", "vllm_harness"} <= set(PLAIN)
    code = ("import importlib, sys\n"
            "sys.modules['pytest'] = None  # `import pytest` raises ImportError from here on\n"
            f"for name in {PLAIN!r}:\n"
            "    importlib.import_module('lmcache_vericache.testing.' + name)\n"
            "assert 'pytest' not in sys.modules or sys.modules['pytest'] is None\n"
            "try:\n"
            "    importlib.import_module('lmcache_vericache.testing.fixtures')\n"
            "except ImportError:\n"
            "    print('blocked')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "blocked"  # the block works: the one module that needs pytest fails


def test_missing_binary_raises_server_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert servers.server_binary() is None
    with pytest.raises(servers.ServerUnavailable, match="no Redis/Valkey server binary"):
        servers.redis_binary()
    with pytest.raises(servers.ServerUnavailable):
        servers.cluster_binaries()
