"""Engine test helpers: real prompts (stdlib source, HumanEval), reference decodes, identity checks."""

from __future__ import annotations

import torch

from lmcache_vericache.data import humaneval_prompts, prompt_ids, stdlib_source


def real_prompts(tokenizer, n_tokens: int) -> dict[str, list[int]]:
    """Two real prompts of exactly ``n_tokens`` tokens: a stdlib module and concatenated HumanEval tasks."""
    he = "\n\n".join(humaneval_prompts()[:40])
    return {
        "stdlib/json/decoder.py": prompt_ids(tokenizer, stdlib_source("json/decoder.py"), n_tokens).tolist(),
        "humaneval[:40]": prompt_ids(tokenizer, he, n_tokens).tolist(),
    }


def reference(engine, prompts: list[list[int]], n_new: int, cache: dict) -> list[list[int]]:
    key = (tuple(map(tuple, prompts)), n_new)
    if key not in cache:
        cache[key] = [(r.tokens, r.margins) for r in engine.reference(prompts, n_new)]
    return cache[key]


def assert_identical(out, ref, label: str) -> None:
    """Token-for-token equality; on failure report where and the reference's logit margin there."""
    tokens, margins = ref
    if out != tokens:
        i = next((j for j, (a, b) in enumerate(zip(out, tokens)) if a != b), min(len(out), len(tokens)))
        raise AssertionError(f"{label}: diverged at new token {i} (len {len(out)} vs {len(tokens)}); "
                             f"reference top1-top2 logit margin there {margins[i] if i < len(margins) else None}")


def random_prompts(n: int, lengths: list[int], vocab: int = 256, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths[:n]]


def packed_and_dense_runs(eng, dense, prompts: list[list[int]], n_new: int) -> list[tuple[dict, float]]:
    """Decode ``prompts`` with an engine whose draft caches keep their prefix packed (as codes) and
    with its dense twin; both must equal full-KV greedy decoding. Returns, per engine, request ->
    (the draft cache's packed prefix type, bytes a draft step reads, bytes of its compressed prefix)
    after the request's first round, and the mean drafts accepted per round."""
    ref = eng.reference(prompts, n_new)

    def prefix_bytes(c):  # what a draft step reads of the compressed prefix: codes, or dense K and V
        return c.packed.nbytes if c.packed is not None else sum(c.base) * 2 * c.k.shape[1] * c.k.shape[3] * c.k.element_size()

    runs = []
    for e in (eng, dense):
        seen: dict = {}
        out = e.generate(prompts, n_new, on_round=lambda r, seen=seen: seen.setdefault(
            r.idx, (type(r.draft.packed), r.draft.read_bytes(), prefix_bytes(r.draft))))
        assert [o.tokens for o in out] == [r.tokens for r in ref]
        runs.append((seen, sum(sum(o.stats.accepted) for o in out) / sum(o.stats.rounds for o in out)))
    return runs
