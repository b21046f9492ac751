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
Each stage is a dataclass that checks its hyper-parameters when built (:mod:`.params`).

RoPE is already applied to cached keys, so a kept key needs no re-rotation; new tokens continue at
their true logical position (as in kvpress). The positions are kept so attention masks and
diagnostics can use them.
"""

from __future__ import annotations

import functools
import re
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .params import _Validated

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

    def buffers_by_layer(self, strict: bool = False) -> list[dict[str, Tensor]]:
        """``layer_buffers`` of every layer in one pass over the buffers. Names that are not
        ``L{layer}.{name}`` with ``layer < num_layers`` are skipped, or with ``strict`` raise
        ``ValueError``."""
        out: list[dict[str, Tensor]] = [{} for _ in range(self.num_layers)]
        for key, buf in self.buffers.items():
            m = _BUFFER_NAME.fullmatch(key) if isinstance(key, str) else None
            if m is not None and int(m[1]) < self.num_layers:
                out[int(m[1])][m[2]] = buf
            elif strict:
                raise ValueError(f"unexpected buffer {key!r} (not L{{layer}}.{{name}} with layer < {self.num_layers})")
        return out


_BUFFER_NAME = re.compile(r"L(0|[1-9][0-9]{0,8})\.(.+)", re.DOTALL)


class _Cache:
    """A small thread-safe LRU memo (outcomes, errors included) of derived layouts: keys come from
    untrusted headers, so it is bounded, and a header that fails is not re-derived each time."""

    def __init__(self, size: int) -> None:
        self._size, self._data, self._lock = size, OrderedDict(), threading.Lock()

    def get(self, key: Any, compute: Callable[[], Any]) -> Any:
        with self._lock:
            hit = self._data.get(key)
            if hit is not None:
                self._data.move_to_end(key)
        if hit is None:
            try:
                hit = (True, compute())
            except Exception as e:  # derived from the header: the same header fails the same way
                hit = (False, f"{type(e).__name__}: {e}")
            with self._lock:
                self._data[key] = hit
                while len(self._data) > self._size:
                    self._data.popitem(last=False)
        ok, value = hit
        if not ok:
            raise ValueError(value)
        return value


_LAYOUTS = _Cache(1024)
Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


class TokenEvictor(_Validated, ABC):
    """Picks the tokens to keep.

    ``select`` returns one int64 tensor per layer, ``[num_kv_heads, n_keep_l]``, of chunk-relative
    token indices, sorted ascending per head. ``n_keep_l`` may differ between layers (PyramidKV) but
    not between heads of one layer.
    """

    @abstractmethod
    def select(self, kv: Tensor, ctx: CompressionContext) -> list[Tensor]: ...

    # -- per-layer buffers stored beside ``pos`` (a sample's inclusion probabilities) ------------
    def select_with_extras(self, kv: Tensor, ctx: CompressionContext) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
        """``select`` plus, per layer, buffers to store beside ``pos`` (default: none)."""
        return self.select(kv, ctx), [{} for _ in range(kv.shape[1])]

    def extra_layout(self, num_kv_heads: int, n_tokens: int, n_kept: int) -> Layout:
        """Name -> (dtype, shape) of one layer's extra buffers (what ``select_with_extras`` writes)."""
        return {}

    def check_extras(self, extras: dict[str, Tensor], pos: Tensor) -> None:
        """Raise ``ValueError`` unless one layer's extra buffers (layout already checked) are usable."""

    # -- validation of untrusted chunks (see KVCompressor.check) ------------------------------
    def kept_counts(self, shape: tuple[int, int, int, int], num_kv_heads: int) -> list[int] | None:
        """Tokens kept per layer in a chunk of ``shape`` ``[2, L, T, H*D]``, or ``None`` where the
        count depends on the data (each layer then keeps 1..T tokens).

        Default: ``select`` on stand-ins that cost no memory (an all-zero chunk and all-zero
        ``scores``, start 0). Right for every method whose counts follow from the shape alone;
        override where they depend on the values or the start (a wrong count fails closed:
        the method's own chunks would be rejected)."""
        n_layers, n_tokens = shape[1], shape[2]
        kv = torch.zeros((), dtype=torch.float32).expand(*shape)
        scores = torch.zeros((), dtype=torch.float32).expand(n_layers, num_kv_heads, n_tokens)
        keep = self.select(kv, CompressionContext(num_kv_heads, 0, None, scores))
        if len(keep) != n_layers or any(k.dim() != 2 or k.shape[0] != num_kv_heads for k in keep):
            raise ValueError(f"select gave no [H, n] per layer for shape {tuple(shape)}")
        return [int(k.shape[1]) for k in keep]

    def check_positions(self, pos: Tensor, n_tokens: int) -> None:
        """Raise ``ValueError`` unless ``pos`` (int32 ``[H, n]``) could come from ``select``:
        chunk-relative positions in ``[0, n_tokens)``, strictly ascending per head."""
        if pos.numel() == 0:
            return
        lo, hi = torch.aminmax(pos)
        if int(lo) < 0 or int(hi) >= n_tokens:
            raise ValueError(f"kept positions span [{int(lo)}, {int(hi)}], outside the chunk's [0, {n_tokens})")
        if pos.shape[1] > 1 and not bool((pos[:, 1:] > pos[:, :-1]).all()):
            raise ValueError("kept positions are not strictly ascending per head")


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

    def int8_codes(self, buffers: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """One layer's buffers as ``(kq, ks, vq, vs)``: int8 codes ``[H, n, D]`` with one scale per
        (head, token) ``[H, n]`` or ``[H, n, 1]``, if that is this method's format (a drafter then
        attends over the codes, see ``engine/int8_attention.py``); ``None`` otherwise (default)."""
        return None

    # -- validation of untrusted chunks (see KVCompressor.check) ------------------------------
    # Buffers (scales, minima, norms) that multiply or offset codes: they must be finite.
    finite_buffers: ClassVar[tuple[str, ...]] = ()

    def layout(self, shape: tuple[int, int, int], dtype: torch.dtype) -> Layout:
        """Name -> (dtype, shape) of what ``encode`` returns for keys/values of ``shape``
        ``[H, n, D]`` and ``dtype``. Default: encodes zeros (``check`` caches the result); override
        where the layout depends on the values."""
        z = torch.zeros(shape, dtype=dtype)
        return {name: (b.dtype, tuple(b.shape)) for name, b in self.encode(z, z).items()}

    def check_layer(self, buffers: dict[str, Tensor], shape: tuple[int, int, int]) -> None:
        """Raise ``ValueError`` unless ``decode`` may read one layer's ``buffers`` (their names,
        dtypes and shapes already match ``layout``). Default: ``finite_buffers`` are finite."""
        for name in self.finite_buffers:
            b = buffers[name]
            if b.is_floating_point() and b.numel() and not bool(torch.isfinite(b).all()):
                raise ValueError(f"buffer {name!r} holds non-finite values")


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
        keep, extras = evictor.select_with_extras(kv, ctx) if evictor is not None else (None, None)
        buffers: dict[str, Tensor] = {}
        for layer in range(n_layers):
            k = kv[0, layer].view(n_tokens, num_kv_heads, head_dim).transpose(0, 1)
            v = kv[1, layer].view(n_tokens, num_kv_heads, head_dim).transpose(0, 1)
            if keep is not None:
                idx = keep[layer]
                gather = idx.unsqueeze(-1).expand(-1, -1, head_dim)
                k, v = k.gather(1, gather), v.gather(1, gather)
                buffers[f"L{layer}.pos"] = idx.to(torch.int32).contiguous()
                for name, buf in extras[layer].items():
                    buffers[f"L{layer}.{name}"] = buf
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

    @property
    def stores_int8_codes(self) -> bool:
        """Whether ``int8_layers`` gives the chunks' codes (the quantizer implements ``int8_codes``)."""
        q = self.quantizer()
        return q is not None and type(q).int8_codes is not KVQuantizer.int8_codes

    def int8_layers(self, ckv: CompressedKV) -> list[tuple[Tensor, Tensor, Tensor, Tensor]] | None:
        """Per layer ``(kq, ks, vq, vs)`` int8 codes and per-token scales where the method's
        quantizer stores them so (``KVQuantizer.int8_codes``), else ``None``. Same validation
        precondition as ``decompress``."""
        quantizer = self.quantizer()
        if quantizer is None:
            return None
        out = []
        for parts in ckv.buffers_by_layer():
            self._evictor_buffers(parts)
            codes = quantizer.int8_codes(parts)
            if codes is None:
                return None
            out.append(codes)
        return out

    def decompress(self, ckv: CompressedKV) -> list[LayerKV]:
        """Reconstruct, per layer, the kept K/V (dequantized) with absolute positions. A chunk from
        untrusted bytes must pass ``codec.validate`` first."""
        quantizer = self.quantizer()
        heads, head_dim = ckv.num_kv_heads, ckv.head_dim
        out = []
        for parts in ckv.buffers_by_layer():
            pos = self._evictor_buffers(parts)
            if pos is None:
                pos = torch.arange(ckv.num_tokens).expand(heads, -1)
            n = pos.shape[1]
            if quantizer is not None:
                k, v = quantizer.decode(parts, (heads, n, head_dim), ckv.dtype)
            else:
                k, v = parts["k"], parts["v"]
            out.append(LayerKV(k, v, pos.to(torch.int64) + ckv.start))
        return out

    def _evictor_buffers(self, parts: dict[str, Tensor]) -> Tensor | None:
        """Remove ``pos`` and the evictor's extra buffers from one layer's ``parts``; return ``pos``."""
        evictor = self.evictor()
        if evictor is not None:
            for name in evictor.extra_layout(1, 1, 1):
                parts.pop(name, None)
        return parts.pop("pos", None)

    def check(self, ckv: CompressedKV) -> None:
        """Raise ``ValueError`` unless ``ckv`` holds exactly what ``compress`` writes for its
        header, with values ``decompress`` can use. ``codec.validate`` calls it on untrusted chunks
        after checking the header fields and size caps (so ``shape``, ``num_kv_heads``, ``dtype``
        and ``start`` are sane ints/dtypes and ``method``/``params`` built this compressor).

        Default, per layer: buffer names, dtypes and shapes equal the layout this method writes
        (the evictor's ``kept_counts`` and ``check_positions`` for ``pos``, the quantizer's
        ``layout`` and ``check_layer`` for the rest; derived layouts are cached per method,
        parameters, shape and dtype). Methods override it, or those hooks, to add rules."""
        _, n_layers, n_tokens, hidden = ckv.shape
        heads, dtype = ckv.num_kv_heads, ckv.dtype
        head_dim = hidden // heads
        evictor, quantizer = self.evictor(), self.quantizer()
        layers = ckv.buffers_by_layer(strict=True)
        counts = None
        if evictor is not None:
            shape = tuple(ckv.shape)
            counts = _LAYOUTS.get(("kept", repr(evictor), shape, heads),
                                  functools.partial(evictor.kept_counts, shape, heads))
        for layer, parts in enumerate(layers):
            n = n_tokens
            if evictor is not None:
                pos = parts.pop("pos", None)
                if pos is None or pos.dtype != torch.int32 or pos.dim() != 2 or pos.shape[0] != heads:
                    got = None if pos is None else f"{pos.dtype} {tuple(pos.shape)}"
                    raise ValueError(f"layer {layer}: positions must be int32 [{heads}, n], got {got}")
                n = pos.shape[1]
                if counts is not None and n != counts[layer]:
                    raise ValueError(f"layer {layer}: {n} kept tokens where the method keeps {counts[layer]}")
                if counts is None and not 1 <= n <= n_tokens:
                    raise ValueError(f"layer {layer}: {n} kept tokens, not within 1..{n_tokens}")
                evictor.check_positions(pos, n_tokens)
                extra_layout = evictor.extra_layout(heads, n_tokens, n)
                extras = {name: parts.pop(name, None) for name in extra_layout}
                for name, (want_dtype, want_shape) in extra_layout.items():
                    b = extras[name]
                    if b is None or b.dtype != want_dtype or tuple(b.shape) != want_shape:
                        got = None if b is None else f"{b.dtype} {tuple(b.shape)}"
                        raise ValueError(f"buffer L{layer}.{name}: {got}, the method writes {want_dtype} {want_shape}")
                evictor.check_extras(extras, pos)
            layer_shape = (heads, n, head_dim)
            if quantizer is not None:
                expected = _LAYOUTS.get(("layout", repr(quantizer), layer_shape, dtype),
                                        functools.partial(quantizer.layout, layer_shape, dtype))
            else:
                expected = {"k": (dtype, layer_shape), "v": (dtype, layer_shape)}
            if parts.keys() != expected.keys():
                raise ValueError(f"layer {layer}: buffers {sorted(parts)}, the method writes {sorted(expected)}")
            for name, (want_dtype, want_shape) in expected.items():
                b = parts[name]
                if b.dtype != want_dtype or tuple(b.shape) != want_shape:
                    raise ValueError(f"buffer L{layer}.{name}: {b.dtype} {tuple(b.shape)}, "
                                     f"the method writes {want_dtype} {want_shape}")
            if quantizer is not None:
                quantizer.check_layer(parts, layer_shape)


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
