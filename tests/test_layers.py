"""The package's layering (docs/architecture.md#layers), checked on the import graph of the source.

Every import counts, including those inside functions (a lazy import is still a dependency);
imports under ``if TYPE_CHECKING:`` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "lmcache_vericache"
PKG = "lmcache_vericache"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            # "from . import x" may name a submodule
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


GRAPH = {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}
MODULES = set(GRAPH)


def _internal(names: set[str]) -> set[str]:
    return {n for n in names if n in MODULES}


def _under(module: str, *packages: str) -> bool:
    """``module`` is one of ``packages`` (relative to the package; ``""`` is the whole package) or inside one."""
    names = [f"{PKG}.{p}" if p else PKG for p in packages]
    return any(module == n or module.startswith(n + ".") for n in names)


def _violations(importers: tuple[str, ...], forbidden: tuple[str, ...], *, external: bool = False) -> list[str]:
    bad = []
    for mod, names in GRAPH.items():
        if not _under(mod, *importers):
            continue
        for n in names:
            hit = (n.split(".")[0] in forbidden) if external else (n in MODULES and _under(n, *forbidden))
            if hit:
                bad.append(f"{mod} imports {n}")
    return sorted(bad)


@pytest.mark.parametrize("importers,forbidden", [
    (("compressors",), ("backends", "engine", "connectors", "cli", "testing")),
    (("backends",), ("engine", "connectors", "cli", "testing")),
    (("engine",), ("connectors", "cli", "backends.lmcache", "testing")),
    (("connectors",), ("cli", "backends.lmcache", "testing")),  # no sideways import between host adapters
    (("backends.lmcache",), ("connectors", "cli")),
])
def test_dependencies_point_inward(importers, forbidden):
    bad = _violations(importers, forbidden)
    if importers == ("backends",):  # the glue may use its own package
        bad = [v for v in bad if not v.startswith(f"{PKG}.backends.lmcache")]
    assert bad == []


def test_core_never_imports_the_lmcache_glue():
    bad = [f"{m} imports {n}" for m, names in GRAPH.items() if _under(m, "backends")
           and not _under(m, "backends.lmcache") for n in _internal(names) if _under(n, "backends.lmcache")]
    assert bad == []


def test_only_the_glue_imports_lmcache_and_only_connectors_import_vllm():
    lmcache_ok = ("backends.lmcache", "backends.tiers.lm", "testing")  # lm.py talks to LMCache's server
    vllm_ok = ("connectors", "testing")
    assert [v for v in _violations(("",), ("lmcache",), external=True) if not _under(v.split()[0], *lmcache_ok)] == []
    assert [v for v in _violations(("",), ("vllm",), external=True) if not _under(v.split()[0], *vllm_ok)] == []


def test_no_import_cycles():
    edges = {m: _internal(n) - {m} for m, n in GRAPH.items()}
    # a package's __init__ re-exporting its children is not a cycle of code
    edges = {m: {n for n in ns if not (n.startswith(m + ".") and m in MODULES)} for m, ns in edges.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    # A child importing its own package's __init__ (for a sibling) is how Python packages work;
    # report cycles between distinct modules that do not pass through a parent package.
    real = [c for c in cycles if not any(b.startswith(a + ".") or a.startswith(b + ".") for a, b in zip(c, c[1:]))]
    assert real == []


# Names a module may bind at import time to something it then mutates: containers and the objects
# of threads and pools. A module of `connectors/` holding one is a registry shared by every vLLM
# engine in the process (the WorkerContext holds what the connector and the proposer share).
_MUTABLE_FACTORIES = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "Lock", "RLock",
                      "Event", "Condition", "Semaphore", "Queue", "ThreadPoolExecutor", "WeakKeyDictionary",
                      "WeakValueDictionary", "local"}


def _module_level_mutables(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = [f"{path.name}:{n.lineno} global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [ast.unparse(t) for t in targets]
            value = node.value
            call = ast.unparse(value.func).rsplit(".", 1)[-1] if isinstance(value, ast.Call) else None
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
            if (mutable or call in _MUTABLE_FACTORIES) and names != ["__all__"]:
                found.append(f"{path.name}:{node.lineno} {', '.join(names)} = {ast.unparse(value)[:40]}")
    return found


def test_connectors_hold_no_module_level_mutable_state():
    bad = [m for p in sorted((ROOT / "connectors").rglob("*.py")) for m in _module_level_mutables(p)]
    assert bad == []


def test_the_mutable_state_check_sees_a_registry(tmp_path):
    p = tmp_path / "reg.py"
    p.write_text("import threading\n_STORES: dict[str, int] = {}\n_LOCK = threading.Lock()\nN = 3\n"
                 "def f():\n    global N\n    N = 4\n")
    assert [m.split()[0] for m in _module_level_mutables(p)] == ["reg.py:6", "reg.py:2", "reg.py:3"]


def test_only_the_test_fixtures_import_pytest():
    # The library's `testing` helpers are used from scripts and benchmarks without the dev extra.
    importers = {m for m, names in GRAPH.items() if "pytest" in {n.split(".")[0] for n in names}}
    assert importers == {f"{PKG}.testing.fixtures"}
