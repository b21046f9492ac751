"""``vericache`` console script. Each subcommand lives in its own module exposing
``add_parser(subparsers)`` and ``run(args) -> int``; modules are imported lazily."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module (relative to this package)
SUBCOMMANDS = {
    "build-kernels": ".build_kernels",
    "compressors": ".compressors",
    "demo": ".demo",
    "generate": ".generate",
    "lmcache-config": ".lmcache_config",
    "serve": ".serve",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The ``vericache`` parser and its subcommand modules by name (``tests/test_docs.py`` parses the
    docs' command lines with it)."""
    parser = argparse.ArgumentParser(prog="vericache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, mod in SUBCOMMANDS.items():
        # Only the chosen subcommand's module is needed to run, but all are needed for --help;
        # they import heavy dependencies inside run(), not at module level.
        modules[name] = importlib.import_module(mod, __name__)
        modules[name].add_parser(sub)
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
