"""Real text sources and tokenization helpers."""

from __future__ import annotations

import pytest
import torch

from lmcache_vericache import data


def test_stdlib_source_reads_the_real_file():
    text = data.stdlib_source()
    assert "class ArgumentParser" in text and len(text) > 50_000
    assert "class JSONDecoder" in data.stdlib_source("json/decoder.py")


@pytest.mark.parametrize("bad", ["no_such_module.py", "../../etc/passwd", "json"])
def test_stdlib_source_rejects_missing_or_outside_paths(bad):
    with pytest.raises(FileNotFoundError, match="no standard library file"):
        data.stdlib_source(bad)


def test_humaneval_prompts():
    prompts = data.humaneval_prompts()
    assert len(prompts) == 164
    assert prompts[0].startswith("from typing import List") and "def has_close_elements" in prompts[0]


def test_prompt_ids_are_the_first_tokens(smollm2):
    tok = smollm2[1]
    text = data.stdlib_source()
    ids = data.prompt_ids(tok, text, 2048)
    assert ids.dtype == torch.int64 and ids.shape == (2048,)
    assert tok.decode(ids[:20]) == text[: len(tok.decode(ids[:20]))]
    assert torch.equal(data.prompt_ids(tok, text, 10), ids[:10])


def test_prompt_ids_rejects_short_text_and_bad_counts(smollm2):
    tok = smollm2[1]
    with pytest.raises(ValueError, match="text has only 2 tokens, 100 requested"):
        data.prompt_ids(tok, "import os", 100)
    with pytest.raises(ValueError, match="n_tokens must be > 0"):
        data.prompt_ids(tok, "import os", 0)
