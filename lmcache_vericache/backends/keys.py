"""The one chunk-key scheme of every host (engine, LMCache storage plugin, LMCache L2 adapter).

A chunk's store key is ``<space id>-<prefix hash>``:

* the **prefix hash** is a hash chain over token ids, one link per ``chunk_size`` tokens, so a
  chunk's hash depends on every token before its end. Hosts that see tokens (the engine) compute
  it with :func:`prefix_hashes`; the LMCache hosts are handed it by LMCache (``CacheEngineKey.
  chunk_hash``, ``ObjectKey.chunk_hash``). :func:`prefix_hashes` reproduces LMCache's chains bit for
  bit for the two cryptographic schemes LMCache uses, so the same prompt gets the same hash
  whichever host stored it:

  - ``"blake3"``: the LMCache multiprocess server's default (``lmcache server --hash-algorithm``);
    32-byte digests;
  - ``"sha256_cbor"``: LMCache in-process with ``pre_caching_hash_algorithm: sha256_cbor``;
    digests folded to their first 8 bytes, as LMCache stores them.

* the **space id** is a digest of everything that makes two chunks interchangeable
  (:class:`KeySpace`): model identity, KV dtype, chunk size, KV layout, hash scheme, compressor and
  its parameters, and the chunk formats' versions. Two hosts share chunks exactly when their key
  spaces are equal; a host whose layout differs (vLLM's CPU paged blocks) gets another space id, so
  it can never be served a chunk laid out for someone else.

See ``docs/architecture.md#the-key-scheme``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch

#: Version of this key scheme; bumping it moves every host to new keys.
KEY_VERSION = 1
HASH_SCHEMES = ("blake3", "sha256_cbor")
#: Token-major split K/V planes, ``[2, layers, tokens, kv_heads*head_dim]`` (LMCache ``KV_2LTD``).
LAYOUT_2LTD = "kv_2ltd"
# vLLM's default NONE_HASH seed (``vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED``), which LMCache
# in-process uses for sha256_cbor chains; PYTHONHASHSEED replaces it there, and so here.
_VLLM_NONE_HASH_SEED = "vllm-none-hash"


@dataclass(frozen=True)
class KeySpace:
    """Everything that makes two stored chunks interchangeable. Hashable, immutable."""

    model: str  # model identity: a digest of the weights (model_fingerprint) or an explicit revision
    dtype: str  # KV dtype, torch name without "torch." ("bfloat16")
    chunk_size: int
    compressor: str
    compressor_params: dict[str, Any] = field(default_factory=dict, hash=False)
    layout: str = LAYOUT_2LTD
    scheme: str = "blake3"
    # The slice of the model's KV a host holds ("" for all of it): a tensor-/pipeline-parallel
    # rank's heads and layers. Only a non-empty shard enters the id, so unsharded ids never change.
    shard: str = ""

    def __post_init__(self) -> None:
        if self.scheme not in HASH_SCHEMES:
            raise ValueError(f"hash scheme must be one of {HASH_SCHEMES}, got {self.scheme!r}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if not self.model:
            raise ValueError("key space needs a model identity")
        object.__setattr__(self, "dtype", dtype_str(self.dtype))

    @property
    def id(self) -> str:
        """32 hex digits naming the space (the key prefix)."""
        from ..compressors.codec import VERSION as CODEC_VERSION
        from .fullchunk import VERSION as FULL_VERSION

        desc = {"key": KEY_VERSION, "full": FULL_VERSION, "codec": CODEC_VERSION, "model": self.model,
                "dtype": self.dtype, "chunk_size": self.chunk_size, "layout": self.layout, "scheme": self.scheme,
                "compressor": self.compressor, "params": self.compressor_params}
        if self.shard:
            desc["shard"] = self.shard
        return blake3.blake3(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def key(self, prefix_hash: bytes | int) -> str:
        """Store key of the chunk whose chained prefix hash is ``prefix_hash`` (bytes, or LMCache's
        int form of a folded digest)."""
        if isinstance(prefix_hash, int):
            prefix_hash = prefix_hash.to_bytes(8, "big", signed=prefix_hash < 0)
        return f"{self.id}-{prefix_hash.hex()}"

    def rekey(self, key: str) -> str:
        """The key in this space of the chunk ``key`` names in another (same prefix hash)."""
        return f"{self.id}{key[key.index('-'):]}"

    def token_keys(self, tokens: Sequence[int]) -> list[str]:
        """Keys of the complete chunks of ``tokens``, in order."""
        ident = self.id
        return [f"{ident}-{h.hex()}" for h in prefix_hashes(tokens, self.chunk_size, self.scheme)]


def dtype_str(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    return name


def prefix_hashes(tokens: Sequence[int], chunk_size: int, scheme: str = "blake3") -> list[bytes]:
    """Chained prefix hash of each complete ``chunk_size``-token chunk of ``tokens``.

    Equal to LMCache's own chains: ``TokenHasher`` of the multiprocess server for ``"blake3"``
    (``h = blake3(prev || tokens as big-endian u32)`` from ``blake3(i64 0 || u32 0)``), and
    ``ChunkedTokenDatabase`` with vLLM's ``sha256_cbor`` for ``"sha256_cbor"`` (``h = sha256(cbor(
    (prev, tokens, ())))`` folded to its first 8 bytes). ``tests/backends/test_keys.py`` checks both
    against the installed LMCache."""
    if scheme == "blake3":
        link = _blake3_link
        h: Any = _blake3_link(0, [0])
    elif scheme == "sha256_cbor":
        link = _sha256_cbor_link
        h = _fold(_sha256_cbor(os.environ.get("PYTHONHASHSEED", _VLLM_NONE_HASH_SEED)))
    else:
        raise ValueError(f"hash scheme must be one of {HASH_SCHEMES}, got {scheme!r}")
    out = []
    for s in range(0, len(tokens) - chunk_size + 1, chunk_size):
        h = link(h, tokens[s:s + chunk_size])
        out.append(h if isinstance(h, bytes) else h.to_bytes(8, "big"))
    return out


def _blake3_link(prev: bytes | int, tokens: Sequence[int]) -> bytes:
    head = prev if isinstance(prev, bytes) else prev.to_bytes(8, "big", signed=True)
    return blake3.blake3(head + struct.pack(f">{len(tokens)}I", *tokens)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _fold(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big")


def _sha256_cbor_link(prev: int, tokens: Sequence[int]) -> int:
    return _fold(_sha256_cbor((prev, tuple(int(t) for t in tokens), ())))


def model_fingerprint(model: torch.nn.Module) -> str:
    """Identity of a model's exact weights: BLAKE3 over a few config facts and every parameter's
    name, dtype, shape and bytes, in name order (:func:`weights_fingerprint`). Equal in every process
    that loads the same weights in the same dtype, and equal to :func:`folder_fingerprint` of the
    Hugging Face folder they were loaded from, so a host that never holds the weights as plain
    tensors (vLLM) finds the same keys. KV of one model must never verify another's drafts, and a
    model changed in a single late weight is another model. Cached on the model against the
    parameters' version counters (which every in-place change bumps), so it is computed once per
    load (it reads every weight)."""
    params = list(model.named_parameters())
    versions = tuple((p._version, p.data_ptr()) for _, p in params)
    cached = getattr(model, "_vericache_fingerprint", None)
    if cached is not None and cached[0] == versions:
        return cached[1]
    with torch.inference_mode():
        fingerprint = weights_fingerprint(getattr(model, "config", None), sorted(params, key=lambda kv: kv[0]))
    object.__setattr__(model, "_vericache_fingerprint", (versions, fingerprint))
    return fingerprint


def weights_fingerprint(config: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """BLAKE3 (32 hex digits) over the config facts that change the KV (model type, RoPE, norm eps)
    and each ``(name, tensor)`` in the order given: name, dtype, shape, raw bytes."""
    h = blake3.blake3()
    facts = {k: str(getattr(config, k, None)) for k in ("model_type", "rope_theta", "rope_scaling", "rms_norm_eps")}
    h.update(json.dumps(facts, sort_keys=True).encode())
    for name, p in named_tensors:
        t = p.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()[:32]


_TIED = {"lm_head.weight", "model.embed_tokens.weight"}


def weight_files(folder: str | os.PathLike) -> list:
    """The safetensors files holding a Hugging Face folder's weights, once each: the sharded
    index's files where there is one, else every ``*.safetensors`` but a ``consolidated`` copy
    (Mistral ships one holding the same weights under other names). Empty if none."""
    from pathlib import Path

    folder = Path(folder)
    if not folder.is_dir():
        return []
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith("consolidated"))


def folder_fingerprint(folder: str | os.PathLike, dtype: torch.dtype | str) -> str:
    """:func:`model_fingerprint` of the model a Hugging Face folder loads as in ``dtype``, computed
    from its ``*.safetensors`` files without building the model (tensors cast to ``dtype``; tied
    weights stored once, as Hugging Face saves them). For hosts that cannot view their weights
    (vLLM on CPU packs them into oneDNN handles). Raises ``ValueError`` if the folder has no
    safetensors weights."""
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoConfig

    folder = Path(folder)
    files = weight_files(folder)
    if not files:
        raise ValueError(f"{folder}: no *.safetensors weights to fingerprint (set the store config's model_id)")
    target = getattr(torch, dtype_str(dtype))
    handles = [safe_open(str(f), framework="pt") for f in files]
    config = AutoConfig.from_pretrained(folder)
    # Buffers some exports store (RoPE inv_freq) are not parameters: model_fingerprint skips them.
    names = sorted((name, i) for i, f in enumerate(handles) for name in f.keys() if not name.endswith(".inv_freq"))
    if getattr(config, "tie_word_embeddings", False) and len({n for n, _ in names} & _TIED) == 2:
        names = [(n, i) for n, i in names if n != "lm_head.weight"]  # a loaded model holds it once

    def tensors():
        for name, i in names:
            yield name, handles[i].get_tensor(name).to(target)

    with torch.inference_mode():
        return weights_fingerprint(config, tensors())
