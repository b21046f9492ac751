"""The docs stay true to the code: every fenced snippet of README.md, docs/*.md and configs/README.md is
checked as far as it can be here without running a model.

- ``yaml`` / ``json``: parse; LMCache configs, vLLM ``--kv-transfer-config`` / ``--speculative-config`` /
  ``--additional-config`` JSON, L2 adapter JSON and store configs are validated by the package's own parsers.
- ``bash`` / ``sh`` / ``console``: each ``vericache ...`` line parses with the CLI's own argparse parser;
  each ``python benchmarks/X.py`` flag is one the script defines; each ``make X`` is a Makefile target;
  each ``pytest`` path exists; inline JSON (and ``$(cat configs/...)``) given to a config flag is validated.
- ``python``: compiles, and its ``from lmcache_vericache... import`` names exist.
- Inline code spans that are such commands are checked the same way; relative links point to files and
  headings that exist.

A snippet that cannot be checked here carries ``<!-- not-checked: reason -->`` on the line before it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", ROOT / "configs" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL, DATA, CODE = {"bash", "sh", "console"}, {"yaml", "json"}, {"python"}
PLAIN = {"text"}  # output or pseudo-code, shown not run
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
SKIP = re.compile(r"<!--\s*not-checked:(.*?)-->")
CONFIG_FLAGS = ("--kv-transfer-config", "--speculative-config", "--additional-config", "--store-config",
                "--l2-adapter")


def blocks(path: Path) -> list[tuple[int, str, str, str | None]]:
    """(line, language, text, not-checked reason or None) of every fenced block."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i][len(indent):])
            i += 1
        prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        skip = SKIP.search(prev)
        out.append((start + 1, lang, "\n".join(body), skip.group(1).strip() if skip else None))
        i += 1
    return out


def prose(path: Path) -> str:
    """The text outside fenced blocks."""
    keep, inside = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        keep.append("" if inside else line)
    return "\n".join(keep)


SNIPPETS = [(p, *b) for p in DOCS for b in blocks(p)]
IDS = [f"{p.relative_to(ROOT)}:{line}:{lang}" for p, line, lang, _, _ in SNIPPETS]


# -- validators ------------------------------------------------------------------------------------------
def check_yaml_config(obj) -> None:
    from lmcache_vericache.backends.config import StoreConfig
    from lmcache_vericache.backends.lmcache.plugin import KEY_PREFIX, store_params
    from lmcache_vericache.cli.lmcache_config import INPROCESS_CLASS, INPROCESS_MODULE

    extra = obj.get("extra_config") if isinstance(obj, dict) else None
    if not isinstance(extra, dict):
        return
    if "storage_plugin.vericache.module_path" in extra:
        assert extra["storage_plugin.vericache.module_path"] == INPROCESS_MODULE
        assert extra["storage_plugin.vericache.class_name"] == INPROCESS_CLASS
    StoreConfig.parse(store_params(extra), where="LMCache extra_config", prefix=KEY_PREFIX)


def check_json_config(obj) -> None:
    """Validate a JSON object by what it is; anything else only had to parse."""
    from lmcache_vericache.backends.config import StoreConfig
    from lmcache_vericache.backends.lmcache.l2_adapter import VeriCacheL2AdapterConfig
    from lmcache_vericache.cli import lmcache_config, serve
    from lmcache_vericache.connectors.proposer import CONFIG_KEY, ProposerOptions
    from lmcache_vericache.connectors.vericache_connector import parse_extra_config

    if not isinstance(obj, dict):
        return
    if obj.get("kv_connector") == "VeriCacheConnector":
        assert obj["kv_connector_module_path"] == serve.CONNECTOR_MODULE
        assert obj.get("kv_load_failure_policy") == "recompute", "the connector needs recompute on load errors"
        parse_extra_config(obj.get("kv_connector_extra_config"))
    elif obj.get("kv_connector") == "LMCacheMPConnector":
        assert {"lmcache.mp.host", "lmcache.mp.port"} <= set(obj["kv_connector_extra_config"])
    elif obj.get("method") == "custom_class":
        assert obj["model"] == serve.PROPOSER and int(obj["num_speculative_tokens"]) >= 1
    elif CONFIG_KEY in obj:
        ProposerOptions.load(obj, {}, 64)
    elif obj.get("type") == "plugin":
        assert (obj["module_path"], obj["class_name"]) == (lmcache_config.L2_MODULE, lmcache_config.L2_CLASS)
        VeriCacheL2AdapterConfig.from_dict(obj["adapter_params"])
    elif obj and set(obj) <= set(StoreConfig.__dataclass_fields__):
        StoreConfig.parse(obj)


def check_config_value(flag: str, value: str, sub: str | None = None) -> None:
    """A config flag's value: inline JSON, or ``$(cat configs/X)``."""
    m = re.fullmatch(r"\$\(cat (\S+)\)", value)
    if m:
        value = (ROOT / m.group(1)).read_text()
    if not value.lstrip().startswith("{"):
        return
    obj = json.loads(value)
    if flag == "--store-config" and sub == "serve":
        from lmcache_vericache.connectors.vericache_connector import parse_extra_config

        parse_extra_config(obj)
    elif flag == "--store-config":
        from lmcache_vericache.backends.config import StoreConfig

        StoreConfig.parse(obj, where="--store-config")
    else:
        check_json_config(obj)


def _cli():
    from lmcache_vericache.cli import build_parser

    return build_parser()[0]


def _script_flags(script: Path) -> set[str]:
    """Option strings of every ``add_argument`` call in a benchmark script."""
    flags = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return flags


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


def check_command(argv: list[str]) -> str | None:
    """Check one simple command; returns what kind it was (None: not ours to check)."""
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
        argv = argv[1:]  # environment assignments
    if not argv:
        return None
    prog = Path(argv[0]).name
    if prog == "vericache":
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                args = _cli().parse_args(argv[1:])
            except SystemExit as e:
                if e.code == 0:  # --help
                    return "vericache"
                raise AssertionError(f"{shlex.join(argv)}: {err.getvalue().strip().splitlines()[-1]}") from e
        for flag in CONFIG_FLAGS:
            if flag in argv[:-1]:
                check_config_value(flag, argv[argv.index(flag) + 1], args.command)
        return "vericache"
    if prog.startswith("python"):
        if len(argv) > 1 and argv[1].startswith("benchmarks/"):
            script = ROOT / argv[1]
            assert script.is_file(), argv[1]
            known = _script_flags(script)
            used = {a.split("=")[0] for a in argv[2:] if a.startswith("--")}
            assert used <= known, f"{argv[1]}: no such flag {sorted(used - known)}"
            return "benchmark"
        if argv[1:3] == ["-m", "pytest"]:
            for a in argv[3:]:
                if a.startswith("tests/"):
                    assert (ROOT / a.split("::")[0]).exists(), a
            return "pytest"
    if prog == "make":
        targets = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
        assert set(targets) <= _make_targets(), f"no Makefile target {sorted(set(targets) - _make_targets())}"
        return "make"
    for flag in CONFIG_FLAGS:  # vllm / lmcache server command lines: their config JSON
        if flag in argv[:-1]:
            check_config_value(flag, argv[argv.index(flag) + 1])
    return None


def shell_commands(text: str, console: bool) -> list[list[str]]:
    """Simple commands of a shell snippet: continuation lines joined, quotes spanning lines kept whole,
    split at ``|``, ``&&``, ``||`` and ``;``. In a console block only ``$ `` lines are commands."""
    lines = text.splitlines()
    if console:
        lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
    out, buf = [], ""
    for line in lines:
        buf += line
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        try:
            tokens = shlex.split(buf, comments=True)
        except ValueError:  # a quote spanning lines
            buf += "\n"
            continue
        buf, cmd = "", []
        for t in tokens + [";"]:
            if t in ("|", "&&", "||", ";"):
                out.append(cmd) if cmd else None
                cmd = []
            else:
                cmd.append(t)
    assert not buf.strip(), f"unterminated command: {buf!r}"
    return out


def check_imports(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmcache_vericache"):
            mod = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(mod, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{node.module} has no {alias.name}"


# -- tests -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "line", "lang", "text", "skip"), SNIPPETS, ids=IDS)
def test_snippet(path, line, lang, text, skip):
    if skip is not None:
        assert skip, f"{path.name}:{line}: not-checked needs a reason"
        pytest.skip(f"not-checked: {skip}")
    assert lang in SHELL | DATA | CODE | PLAIN, f"{path.name}:{line}: tag the block (bash, yaml, json, python, text)"
    if lang == "yaml":
        check_yaml_config(yaml.safe_load(text))
    elif lang == "json":
        check_json_config(json.loads(text))
    elif lang == "python":
        tree = ast.parse(text)
        compile(tree, f"{path.name}:{line}", "exec")
        check_imports(tree)
    elif lang in SHELL:
        for argv in shell_commands(text, console=lang == "console"):
            check_command(argv)


def inline_commands(path: Path) -> list[str]:
    spans = (re.sub(r"\s+", " ", s).strip() for s in re.findall(r"`([^`]+)`", prose(path)))
    return [s for s in spans if re.match(r"(\S*/)?(vericache [a-z]|python\S* benchmarks/|make [a-z])", s)]


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_inline_commands(path):
    for span in inline_commands(path):
        for argv in shell_commands(span, console=False):
            check_command(argv)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in re.findall(r"^#{1,6} (.+)$", prose(path), re.M):
        s = slug(h)
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return out


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links(path):
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: link to missing {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{path.name}: no heading #{anchor} in {dest.name}"


def test_every_block_is_found_and_few_are_unchecked():
    """The extractor sees the docs' blocks (a fence it misread would hide them) and a skip has a reason."""
    langs = [lang for _, _, lang, _, _ in SNIPPETS]
    assert {"bash", "yaml", "json", "python"} <= set(langs)
    skipped = [(p.name, line, why) for p, line, _, _, why in SNIPPETS if why is not None]
    assert all(why for *_, why in skipped) and len(skipped) <= len(SNIPPETS) // 4, skipped


def test_checks_catch_stale_commands():
    """The command checks can fail: a renamed flag, a missing target and a bad store key are caught."""
    with pytest.raises(AssertionError, match="unrecognized arguments"):
        check_command(["vericache", "generate", "--no-such-flag"])
    with pytest.raises(AssertionError, match="no such flag"):
        check_command([".venv/bin/python", "benchmarks/decode.py", "--no-such-flag", "1"])
    with pytest.raises(AssertionError, match="no Makefile target"):
        check_command(["make", "no-such-target"])
    with pytest.raises(ValueError, match="capasity"):
        check_command(["vericache", "generate", "--store-config", '{"capasity": "disk"}'])
    with pytest.raises(ValueError, match="chunk_sise"):
        check_json_config({"vericache_proposer": {"chunk_sise": 1}})
    assert shell_commands("A=1 vericache serve \\\n  --port 1 -- --x | cat", False) == [
        ["A=1", "vericache", "serve", "--port", "1", "--", "--x"], ["cat"]]


def test_not_checked_marker_is_read_with_its_reason(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n\n<!-- not-checked: needs a GPU -->\n```bash\nvericache serve\n```\n\n```json\n{}\n```\n")
    assert [(lang, why) for _, lang, _, why in blocks(doc)] == [("bash", "needs a GPU"), ("json", None)]
