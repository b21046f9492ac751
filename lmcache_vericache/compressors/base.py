"""The uniform compressor interface.

Every method turns a full KV chunk in LMCache's ``KV_2LTD`` layout
(``[2, num_layers, num_tokens, num_kv_heads * head_dim]``) into a :class:`CompressedKV`
and back into what the drafter attends to: per layer, the kept keys and values (dequantized)
with their original absolute token positions.

A compressor is one mechanism with two optional stages:

* a :class:`TokenEvictor` picks, per layer and KV head, which token positions to keep;
* a :class:`KVQuantizer` encodes the kept keys/values of one layer into packed buffers.

Eviction methods have no quantizer (kept tokens are stored in the model dtype), quantization
methods have no evictor (every token is kept), and composition has both. All methods therefore
share one compress/decompress path (:class:`KVCompressor`), one byte format and one test matrix.

RoPE is already applied to cached keys, so a kept key needs no re-rotation; new tokens continue at
their true logical position (as in kvpress). The positions are kept so attention masks and
diagnostics can use them.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

Tensor = torch.Tensor


@dataclass
class LayerKV:
    """What the drafter attends to in one layer.

    ``keys``/``values``: ``[num_kv_heads, n, head_dim]`` in the chunk's dtype;
    ``positions``: ``[num_kv_heads, n]`` int64 absolute token positions, ascending per head.
    """

    keys: Tensor
    values: Tensor
    positions: Tensor


@dataclass
class CompressionContext:
    """Everything a method may use besides the KV itself.

    ``start``: absolute position of the chunk's first token in its prefix.
    ``queries``: optional observation-window queries ``[num_layers, num_q_heads, w, head_dim]``
    (RoPE applied) for attention-based scoring (SnapKV, PyramidKV, H2O).
    ``scores``: optional per-token importance ``[num_layers, num_kv_heads, num_tokens]`` computed by
    the engine; takes precedence over ``queries``.
    """

    num_kv_heads: int
    start: int = 0
    queries: Tensor | None = None
    scores: Tensor | None = None


@dataclass
class CompressedKV:
    """A compressed chunk: self-describing, all stored bytes in ``buffers``.

    Buffer names are ``"L{layer}.{name}"``; ``L{layer}.pos`` (int32, ``[H, n]``) holds kept
    positions relative to ``start`` and is absent when every token is kept. ``nbytes`` is the
    exact number of payload bytes stored (low-bit codes are packed).
    """

    method: str
    params: dict[str, Any]
    shape: tuple[int, int, int, int]  # full chunk shape [2, L, T, H*D]
    num_kv_heads: int
    dtype: torch.dtype  # dtype of the full chunk
    start: int
    buffers: dict[str, Tensor] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @property
    def head_dim(self) -> int:
        return self.shape[3] // self.num_kv_heads

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def full_nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def ratio(self) -> float:
        """Compression ratio: full bytes / stored bytes (> 1 means smaller)."""
        return self.full_nbytes / max(1, self.nbytes)

    def layer_buffers(self, layer: int) -> dict[str, Tensor]:
        prefix = f"L{layer}."
        return {k[len(prefix):]: v for k, v in self.buffers.items() if k.startswith(prefix)}


class _Validated:
    """Dataclass mix-in: ``validate()`` runs after ``__init__`` and raises ``ValueError``."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # pragma: no cover - default accepts everything
        pass

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


class TokenEvictor(_Validated, ABC):
    """Picks the tokens to keep.

    ``select`` returns one int64 tensor per layer, ``[num_kv_heads, n_keep_l]``, of chunk-relative
    token indices, sorted ascending per head. ``n_keep_l`` may differ between layers (PyramidKV) but
    not between heads of one layer.
    """

    @abstractmethod
    def select(self, kv: Tensor, ctx: CompressionContext) -> list[Tensor]: ...


class KVQuantizer(_Validated, ABC):
    """Encodes the keys and values of one layer (``[H, n, D]`` each) into named buffers.

    ``decode`` must return tensors of the given ``dtype`` and shape. Buffers must be contiguous CPU
    tensors; their total size is the real stored size, so pack low-bit codes.
    """

    @abstractmethod
    def encode(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]: ...

    @abstractmethod
    def decode(
        self, buffers: dict[str, Tensor], shape: tuple[int, int, int], dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]: ...


class KVCompressor(_Validated):
    """Base of every registered method. Subclasses set ``name`` and provide ``evictor()`` and/or
    ``quantizer()``; compress/decompress are shared."""

    name: ClassVar[str]
    # Parameter sets the shared test matrix and benchmarks run this method with.
    examples: ClassVar[tuple[dict[str, Any], ...]] = ({},)

    def evictor(self) -> TokenEvictor | None:
        return self if isinstance(self, TokenEvictor) else None

    def quantizer(self) -> KVQuantizer | None:
        return self if isinstance(self, KVQuantizer) else None

    # -- shared mechanism -------------------------------------------------------------------
    def compress(
        self,
        kv: Tensor,
        num_kv_heads: int,
        *,
        start: int = 0,
        queries: Tensor | None = None,
        scores: Tensor | None = None,
    ) -> CompressedKV:
        """Compress a full chunk ``[2, L, T, H*D]`` whose first token sits at ``start``."""
        if kv.dim() != 4 or kv.shape[0] != 2:
            raise ValueError(f"expected KV_2LTD [2, L, T, H*D], got shape {tuple(kv.shape)}")
        if num_kv_heads <= 0 or kv.shape[3] % num_kv_heads:
            raise ValueError(f"hidden size {kv.shape[3]} not divisible by num_kv_heads={num_kv_heads}")
        kv = kv.detach().cpu()
        n_layers, n_tokens = kv.shape[1], kv.shape[2]
        head_dim = kv.shape[3] // num_kv_heads
        ctx = CompressionContext(num_kv_heads, start, queries, scores)
        if scores is not None and tuple(scores.shape) != (n_layers, num_kv_heads, n_tokens):
            raise ValueError(f"scores must be [L, H, T]={n_layers, num_kv_heads, n_tokens}, got {tuple(scores.shape)}")

        evictor, quantizer = self.evictor(), self.quantizer()
        keep = evictor.select(kv, ctx) if evictor is not None else None
        buffers: dict[str, Tensor] = {}
        for layer in range(n_layers):
            k = kv[0, layer].view(n_tokens, num_kv_heads, head_dim).transpose(0, 1)
            v = kv[1, layer].view(n_tokens, num_kv_heads, head_dim).transpose(0, 1)
            if keep is not None:
                idx = keep[layer]
                gather = idx.unsqueeze(-1).expand(-1, -1, head_dim)
                k, v = k.gather(1, gather), v.gather(1, gather)
                buffers[f"L{layer}.pos"] = idx.to(torch.int32).contiguous()
            if quantizer is not None:
                parts = quantizer.encode(k.contiguous(), v.contiguous())
            else:
                parts = {"k": k.contiguous(), "v": v.contiguous()}
            for name, buf in parts.items():
                buffers[f"L{layer}.{name}"] = buf
        return CompressedKV(
            method=self.name,
            params=self.params(),
            shape=tuple(kv.shape),  # type: ignore[arg-type]
            num_kv_heads=num_kv_heads,
            dtype=kv.dtype,
            start=start,
            buffers=buffers,
        )

    def decompress(self, ckv: CompressedKV) -> list[LayerKV]:
        """Reconstruct, per layer, the kept K/V (dequantized) with absolute positions."""
        quantizer = self.quantizer()
        heads, head_dim = ckv.num_kv_heads, ckv.head_dim
        out = []
        for layer in range(ckv.num_layers):
            parts = ckv.layer_buffers(layer)
            pos = parts.pop("pos", None)
            if pos is None:
                pos = torch.arange(ckv.num_tokens).expand(heads, -1)
            n = pos.shape[1]
            if quantizer is not None:
                k, v = quantizer.decode(parts, (heads, n, head_dim), ckv.dtype)
            else:
                k, v = parts["k"], parts["v"]
            out.append(LayerKV(k, v, pos.to(torch.int64) + ckv.start))
        return out


# -- helpers shared by methods ------------------------------------------------------------------

def split_heads(kv: Tensor, num_kv_heads: int) -> Tensor:
    """``[2, L, T, H*D]`` -> ``[2, L, H, T, D]`` (a view when possible)."""
    two, n_layers, n_tokens, hidden = kv.shape
    return kv.view(two, n_layers, n_tokens, num_kv_heads, hidden // num_kv_heads).transpose(2, 3)


def budget(n_tokens: int, keep_ratio: float) -> int:
    """Tokens kept out of ``n_tokens`` at ``keep_ratio`` (at least one)."""
    return max(1, min(n_tokens, round(n_tokens * keep_ratio)))


def topk_keep(scores: Tensor, k: int, forced: Tensor | None = None) -> Tensor:
    """Indices of the ``k`` highest ``scores`` along the last axis, always including ``forced``
    (a bool mask over tokens), sorted ascending. ``scores``: ``[..., T]``."""
    s = scores.float()
    if forced is not None:
        s = s.masked_fill(forced, float("inf"))
    idx = s.topk(min(k, s.shape[-1]), dim=-1).indices
    return idx.sort(dim=-1).values


def check_ratio(name: str, value: float) -> None:
    if not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    # Compare types too: bits=2.0 equals 2 but would fail later, deep inside encode.
    if not any(value == c and type(value) is type(c) for c in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
