"""Attention over 2-4-bit codebook KV codes without a dequantized copy (TurboQuant's drafter prefix).

A CPU decode step over a long prefix is bound by the bytes it reads. TurboQuant k4 v3 stores 3.75
bits per element (4.27x less than bf16) and drafts about as well as int8 (docs/benchmarks.md), but
attended over a dequantized copy it reads bf16's 2 bytes. Here the prefix stays as codes: the int8
attention kernel (``kernels/int8_attention.cpp``, the same VNNI / AVX2 / float paths) reads them
through a second source that decodes 64 codes at a time to the codebook's entries scaled to int8
(one byte-table lookup), in the rotated domain: q is rotated once per row, the output rotated back,
and the draft cache's exact suffix merged in the same call. What is read comes from the format's
one description (:func:`~..compressors.formats.describe`: bits, codebook, rotation), shared with
the GPU kernels.

Layout (:class:`CodebookPrefix`): per layer, codes in tiles of 16 tokens x 16 dimensions, ``32 x
bits`` bytes each (bit planes, see ``CodebookCodes`` in the kernel), and one float32 scale per (head,
token): the stored norm over the codebook's int8 scale. The codebook rounded to int8 (127 over its
largest entry) moves an entry by at most 0.4% of the largest: far below the 2-4-bit codes' own
error, so a drafter's numerics, and drafts only (verification reads the full KV).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..compressors import CompressedKV
from ..compressors.formats import KVFormat, Side
from . import int8_attention

Tensor = torch.Tensor
BLOCK = 16
HEAD_DIMS = int8_attention.HEAD_DIMS
METHODS = ("turboquant",)  # formats with a codebook (describe(): Side.codebook)


@dataclass(frozen=True, eq=False)
class Codebook:
    """What the kernel needs of a codebook format besides the codes: per side its bit width, its
    codebook as int8 ``[16]`` (entries past ``2^bits`` are 0), the int8 scale (codebook entry =
    int8 entry / scale) and the rotation ``[D, D]`` float32."""

    head_dim: int
    kbits: int
    vbits: int
    klut: Tensor
    vlut: Tensor
    kscale: float
    vscale: float
    krot: Tensor
    vrot: Tensor

    @classmethod
    def of(cls, fmt: KVFormat) -> Codebook:
        """The codebook of a described format; ``ValueError`` unless the kernel reads it."""
        if fmt.k.codebook is None or fmt.v.codebook is None or fmt.k.rotation is None or fmt.v.rotation is None:
            raise ValueError(f"{fmt.method} has no codebook format; the codebook kernel reads {METHODS}")
        if fmt.head_dim not in HEAD_DIMS:
            raise ValueError(f"the codebook kernel takes head sizes {HEAD_DIMS}, not {fmt.head_dim}")
        for s in (fmt.k, fmt.v):
            if s.bits not in (2, 3, 4) or s.n_q != fmt.tokens or s.token_group != 1 or s.channel_group != fmt.head_dim:
                raise ValueError(f"{fmt.method}: the codebook kernel takes 2-4-bit codes with one norm per vector")
        (klut, ks), (vlut, vs) = _int8_table(fmt.k), _int8_table(fmt.v)
        return cls(fmt.head_dim, fmt.k.bits, fmt.v.bits, klut, vlut, ks, vs,
                   fmt.k.rotation.float().contiguous(), fmt.v.rotation.float().contiguous())


def _int8_table(side: Side) -> tuple[Tensor, float]:
    cb = side.codebook.double()
    scale = 127.0 / float(cb.abs().max())
    lut = torch.zeros(16, dtype=torch.int8)
    lut[:cb.numel()] = torch.round(cb * scale).to(torch.int8)
    return lut, scale


@dataclass
class CodebookPrefix:
    """A draft cache's compressed prefix as codebook codes, per layer: key and value tiles
    ``kt``/``vt`` ``[H, ceil(T_l/16), D/16, 32 bits]`` uint8, scales ``ks``/``vs`` ``[H, T_l]``
    float32. ``tail``: per layer, where the last partly filled block's tokens are in the stored
    chunks (``(kq, vq, n, start)``), so the next append re-tiles that block from its codes. It keeps
    those chunks' code buffers alive (views of the store's copies, not counted in ``nbytes``): the
    chunks holding the last ``T_l % 16`` tokens, none when chunks are whole blocks (a chunk size
    that 16 divides, as the default 256)."""

    codebook: Codebook
    layers: int
    heads: int
    kt: list[Tensor] = field(default_factory=list)
    ks: list[Tensor] = field(default_factory=list)
    vt: list[Tensor] = field(default_factory=list)
    vs: list[Tensor] = field(default_factory=list)
    tail: list[list[tuple[Tensor, Tensor, int, int]]] = field(default_factory=list)
    takes_suffix: ClassVar[bool] = True  # the DraftPrefix protocol (engine/draft_cache.py)
    batched: ClassVar[bool] = False
    arena_backed: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not self.kt:
            cb, h, d = self.codebook, self.heads, self.codebook.head_dim
            tiles = lambda bits: torch.empty(h, 0, d // 16, 32 * bits, dtype=torch.uint8)  # noqa: E731
            self.kt = [tiles(cb.kbits) for _ in range(self.layers)]
            self.vt = [tiles(cb.vbits) for _ in range(self.layers)]
            self.ks = [torch.empty(h, 0) for _ in range(self.layers)]
            self.vs = [torch.empty(h, 0) for _ in range(self.layers)]
            self.tail = [[] for _ in range(self.layers)]

    def append(self, ckvs: Sequence[CompressedKV]) -> None:
        """Append consecutive chunks (in order) to every layer. The chunks must be validated (a
        shared store's chunk passes ``codec.validate`` first); their shapes are checked again here,
        before the prefix changes (a chunk that does not fit raises ``ValueError`` and leaves it as
        it was)."""
        if not ckvs:
            return
        mod = int8_attention._module()
        cb, h, d = self.codebook, self.heads, self.codebook.head_dim
        for ckv in ckvs:
            if (ckv.num_kv_heads, ckv.head_dim, ckv.num_layers) != (h, d, self.layers):
                raise ValueError(f"a chunk of {ckv.num_layers} layers x {ckv.num_kv_heads} heads x {ckv.head_dim} "
                                 f"for a prefix of {self.layers} x {h} x {d}")
        per_layer = [ckv.buffers_by_layer() for ckv in ckvs]
        for b, ckv in zip(per_layer, ckvs):
            for li, parts in enumerate(b):
                for name, bits in (("kq", cb.kbits), ("vq", cb.vbits)):
                    want = (h * ckv.num_tokens * d * bits + 7) // 8
                    if name not in parts or parts[name].dtype != torch.uint8 or parts[name].numel() != want:
                        raise ValueError(f"layer {li}: {name} is not {want} bytes of {bits}-bit codes")
                for name in ("knorm", "vnorm"):
                    if name not in parts or parts[name].numel() != h * ckv.num_tokens:
                        raise ValueError(f"layer {li}: {name} is not one norm per head and token")
        for li in range(self.layers):
            n0 = self.length(li)
            pieces = list(self.tail[li]) + [(b[li]["kq"], b[li]["vq"], c.num_tokens, 0) for b, c in zip(per_layer, ckvs)]
            args = ([p[2] for p in pieces], [p[3] for p in pieces], h, d)
            kt = mod.codebook_tiles([p[0] for p in pieces], *args, cb.kbits, False)
            vt = mod.codebook_tiles([p[1] for p in pieces], *args, cb.vbits, True)
            whole = n0 // BLOCK  # blocks kept; the partly filled one is in the new tiles
            self.kt[li] = torch.cat([self.kt[li][:, :whole], kt], dim=1)
            self.vt[li] = torch.cat([self.vt[li][:, :whole], vt], dim=1)
            knorm, vnorm = (torch.cat([b[li][name].float().reshape(h, -1) for b in per_layer], dim=1)
                            for name in ("knorm", "vnorm"))
            self.ks[li] = torch.cat([self.ks[li], knorm / cb.kscale], dim=1)
            self.vs[li] = torch.cat([self.vs[li], vnorm / cb.vscale], dim=1)
            self.tail[li] = _last_tokens(pieces, self.length(li) % BLOCK)

    def extend(self, ckvs: Sequence[CompressedKV], compressor: object = None, full: object = None) -> None:
        self.append(ckvs)

    def release(self) -> None:
        """Nothing is held outside this object (its tensors go with it)."""

    @staticmethod
    def attention(jobs: list, scale: float, suffixes: list | None = None) -> list[tuple[Tensor, Tensor]]:
        return attention(jobs, scale, suffixes=suffixes)

    def length(self, layer: int) -> int:
        return self.ks[layer].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for part in (self.kt, self.ks, self.vt, self.vs) for t in part)

    def clone(self) -> CodebookPrefix:
        return CodebookPrefix(self.codebook, self.layers, self.heads, *[[t.clone() for t in part] for part in
                              (self.kt, self.ks, self.vt, self.vs)], [list(t) for t in self.tail])


def _last_tokens(pieces: list[tuple[Tensor, Tensor, int, int]], r: int) -> list[tuple[Tensor, Tensor, int, int]]:
    """The pieces (and starts) that hold the last ``r`` of ``pieces``' tokens."""
    out = []
    for kq, vq, n, start in reversed(pieces):
        if r <= 0:
            break
        take = min(r, n - start)
        out.append((kq, vq, n, n - take))
        r -= take
    return out[::-1]


def attention(jobs: list[tuple[Tensor, CodebookPrefix, int]], scale: float, integer: bool = True,
              suffixes: list[int8_attention.Suffix] | None = None) -> list[tuple[Tensor, Tensor]]:
    """:func:`.int8_attention.attention`'s contract for codebook prefixes (all of one codebook)."""
    if len({id(p.codebook) for _, p, _ in jobs}) > 1:
        raise ValueError("one call attends prefixes of one codebook")

    def call(mod, qs, picked, extra):
        cb = picked[0][1].codebook
        tiles = ([getattr(p, part)[li] for _, p, li in picked] for part in ("kt", "ks", "vt", "vs"))
        return mod.codebook_attention(qs, *tiles, cb.kbits, cb.vbits, cb.klut, cb.vlut, cb.krot, cb.vrot, scale,
                                      integer, **extra)

    return int8_attention.run_jobs(call, jobs, suffixes)
