"""Attention over int8 KV codes without a dequantized copy (the int8 drafter's prefix).

A decode step is bound by the bytes it reads. A drafter whose prefix is stored as int8 codes with
one scale per (head, token) (``compressors.int8`` and ``compose`` with ``quant="int8"``) reads 1 byte
per element here instead of the model dtype's 2 or 4: the C++ kernel in ``kernels/`` reads each
key/value code once for all query rows of its KV head (GQA groups x block tokens) and, given the
draft cache's exact suffix, attends to it in the same call (exactly, in float) and merges both parts
by log-sum-exp: one call per layer for the whole batch. The codes are
kept in blocks of 16 tokens laid out for 4-byte integer dot products (:class:`Int8Prefix`): on CPUs
with AVX512-VNNI the scores and the weighted values are ``vpdpbusd`` dot products (q and the
weights rounded to 8 bits: drafting numerics), with AVX2 alone two multiply-adds per dot product
(7 bits), elsewhere codes are converted to float.

The kernel is compiled on first use (:mod:`.kernels`). Where it cannot be built, :func:`available`
is False and int8 drafters attend over a dequantized copy (slower, same tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..compressors import CompressedKV, KVCompressor
from . import kernels

Tensor = torch.Tensor


def _module():
    return kernels.build("int8_attention")


def available() -> bool:
    """Whether the kernel is built (building it on the first call)."""
    return _module() is not None


def integer() -> bool:
    """Whether the built kernel has an integer dot-product path over the codes (AVX512-VNNI's
    ``vpdpbusd``, or AVX2's ``vpmaddubsw`` + ``vpmaddwd``), which drafting takes by default."""
    mod = _module()
    return bool(mod is not None and (mod.vnni or mod.madd))


def vnni() -> bool:
    """Whether the built kernel has the AVX512-VNNI path (which also decodes codebook codes in vectors)."""
    mod = _module()
    return bool(mod is not None and mod.vnni)


@dataclass
class Int8Prefix:
    """A draft cache's compressed prefix as int8 codes, per layer (counts may differ per layer), in
    blocks of 16 tokens (zero-padded): keys ``kq [H, ceil(T_l/16), D/4, 16, 4]`` (per group of 4
    dimensions, each token's 4 codes), values ``vq [H, 4 ceil(T_l/16), D, 4]`` (per group of 4
    tokens, each dimension's 4 codes): the 4-byte runs the kernel's integer dot products take.
    ``ks``/``vs`` ``[H, T_l]`` float32 scales (their length is the layer's)."""

    kq: list[Tensor] = field(default_factory=list)
    ks: list[Tensor] = field(default_factory=list)
    vq: list[Tensor] = field(default_factory=list)
    vs: list[Tensor] = field(default_factory=list)
    takes_suffix: ClassVar[bool] = True  # the DraftPrefix protocol (engine/draft_cache.py)
    batched: ClassVar[bool] = False
    arena_backed: ClassVar[bool] = False

    @classmethod
    def empty(cls, layers: int, heads: int, head_dim: int) -> Int8Prefix:
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"the int8 attention kernel takes head sizes {HEAD_DIMS}, not {head_dim}")
        codes = lambda *shape: torch.empty(*shape, dtype=torch.int8)  # noqa: E731
        scales = lambda: torch.empty(heads, 0)  # noqa: E731
        return cls([codes(heads, 0, head_dim // 4, BLOCK, 4) for _ in range(layers)], [scales() for _ in range(layers)],
                   [codes(heads, 0, head_dim, 4) for _ in range(layers)], [scales() for _ in range(layers)])

    def append(self, layer: int, kq: Tensor, ks: Tensor, vq: Tensor, vs: Tensor) -> None:
        """Append codes ``[H, n, D]`` and scales ``[H, n]`` (any float dtype; one or more chunks) to a
        layer. Only a partly filled last block is re-blocked (chunks are whole blocks: none is); earlier
        blocks are copied as they are (re-blocking them all would make laying out a prefix chunk by
        chunk quadratic in its length)."""
        n = self.length(layer)
        ks, vs = ks.float().reshape(ks.shape[0], -1), vs.float().reshape(vs.shape[0], -1)
        if n == 0:  # a prefix laid out at once (a stored prompt's chunks): no copies through empty parts
            self.kq[layer], self.vq[layer] = _block_keys(kq), _block_values(vq)
            self.ks[layer], self.vs[layer] = ks.contiguous(), vs.contiguous()
            return
        whole = n // BLOCK  # blocks kept as they are
        keys = torch.cat([_unblock_keys(self.kq[layer][:, whole:], n - whole * BLOCK), kq], dim=1)
        values = torch.cat([_unblock_values(self.vq[layer][:, 4 * whole:], n - whole * BLOCK), vq], dim=1)
        self.kq[layer] = torch.cat([self.kq[layer][:, :whole], _block_keys(keys)], dim=1)
        self.vq[layer] = torch.cat([self.vq[layer][:, :4 * whole], _block_values(values)], dim=1)
        self.ks[layer] = torch.cat([self.ks[layer], ks], dim=1)
        self.vs[layer] = torch.cat([self.vs[layer], vs], dim=1)

    def extend(self, ckvs: Sequence[CompressedKV], compressor: KVCompressor, full: object = None) -> None:
        """Append the chunks' int8 codes, one append per layer for all of them (chunk by chunk would
        re-copy the growing prefix each time: quadratic in its length). ``ValueError`` (nothing
        appended) where a chunk has no int8 codes."""
        packed = [compressor.int8_layers(ckv) for ckv in ckvs]
        if not all(p is not None for p in packed):
            raise ValueError(f"{compressor.name} chunks have no int8 codes: this draft cache cannot be packed")
        for li, per_chunk in enumerate(zip(*packed)):  # per layer: each chunk's (kq, ks, vq, vs)
            self.append(li, *(torch.cat(parts, dim=1) for parts in zip(*per_chunk)))

    def release(self) -> None:
        """Nothing is held outside this object (its tensors go with it)."""

    @staticmethod
    def attention(jobs: list, scale: float, suffixes: list | None = None) -> list[tuple[Tensor, Tensor]]:
        return attention(jobs, scale, suffixes=suffixes)

    def length(self, layer: int) -> int:
        return self.ks[layer].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for part in (self.kq, self.ks, self.vq, self.vs) for t in part)

    def clone(self) -> Int8Prefix:
        return Int8Prefix(*[[t.clone() for t in part] for part in (self.kq, self.ks, self.vq, self.vs)])


BLOCK = 16
HEAD_DIMS = (16, 32, 64, 128)  # the kernel's compiled head sizes
DTYPES = (torch.float32, torch.bfloat16)  # model dtypes whose exact suffix the kernel reads


def _padded(x: Tensor) -> Tensor:
    """``[H, T, D]`` zero-padded to a multiple of ``BLOCK`` tokens."""
    pad = -x.shape[1] % BLOCK
    return torch.cat([x, x.new_zeros(x.shape[0], pad, x.shape[2])], dim=1) if pad else x


def _block_keys(keys: Tensor) -> Tensor:
    """``[H, T, D]`` -> ``[H, ceil(T/16), D/4, 16, 4]``: a transpose of 4-byte groups, moved as int32
    (a byte-wise transposed copy took 7x as long: a prefix's layout at set-up)."""
    h, t, d = keys.shape
    if t == 0:  # no words to view: an empty tensor's strides do not allow the dtype view
        return keys.new_empty(h, 0, d // 4, BLOCK, 4)
    words = _padded(keys).contiguous().view(torch.int32).view(h, -1, BLOCK, d // 4)
    return words.transpose(2, 3).contiguous().view(torch.int8).view(h, -1, d // 4, BLOCK, 4)


def _unblock_keys(kq: Tensor, n: int) -> Tensor:
    h, nb, g, _, _ = kq.shape
    return kq.transpose(2, 3).reshape(h, nb * BLOCK, g * 4)[:, :n]


def _block_values(values: Tensor) -> Tensor:
    """``[H, T, D]`` -> ``[H, 4 ceil(T/16), D, 4]``."""
    h, _, d = values.shape
    return _padded(values).view(h, -1, 4, d).transpose(2, 3).contiguous()


def _unblock_values(vq: Tensor, n: int) -> Tensor:
    h, g, d, _ = vq.shape
    return vq.transpose(2, 3).reshape(h, g * 4, d)[:, :n]


# exact keys, values [H, >= S, D] (rows contiguous), causal block n and S: the entries attended, the first ones
Suffix = tuple[Tensor, Tensor, int, int]


def attention(jobs: list[tuple[Tensor, Int8Prefix, int]], scale: float, integer: bool = True,
              suffixes: list[Suffix] | None = None) -> list[tuple[Tensor, Tensor]]:
    """For each job ``(q [H, m, D], prefix, layer)``: attention of the query rows over that layer's
    int8 prefix, ``(out [H, m, D] float32, lse [H, m] float32)``. Jobs with an empty prefix give
    ``lse = -inf`` (no weight in a merge). ``integer=False`` takes the kernel's float path on a CPU
    with an integer path (exact up to float rounding; the integer paths round q and the weights,
    see ``kernels/int8_attention.cpp``).

    ``suffixes`` (one per job): each job's exact suffix ``(k, v, n, S)``, the first ``S`` entries of
    float32 or bf16 ``k``/``v`` ``[H, >= S, D]`` (a draft cache's layer as it is: no slice per layer
    and job), attended in the same call and merged in: the result is then attention over prefix and
    suffix. ``n`` is the causal block (the last ``n`` of the ``S`` entries are the rows' own tokens;
    row ``r`` is block token ``r % n`` and sees the suffix up to itself); 0: every row sees all ``S``."""
    return run_jobs(lambda mod, qs, picked, extra: mod.int8_attention(
        qs, *([getattr(p, part)[li] for _, p, li in picked] for part in ("kq", "ks", "vq", "vs")), scale, integer,
        **extra), jobs, suffixes)


def run_jobs(call, jobs: list, suffixes: list[Suffix] | None) -> list[tuple[Tensor, Tensor]]:
    """What every packed prefix's ``attention`` shares: ``call(module, qs, picked jobs, suffix
    keywords)`` runs the kernel on the jobs it has work for (a prefix, or a suffix); the others get
    ``out = 0, lse = -inf``."""
    mod = _module()
    if mod is None:
        raise RuntimeError("int8 attention kernel is not available")
    if suffixes is not None and len(suffixes) != len(jobs):
        raise ValueError(f"{len(suffixes)} suffixes for {len(jobs)} jobs")
    run = [i for i, (_, p, li) in enumerate(jobs) if suffixes is not None or p.length(li)]
    res: list[tuple[Tensor, Tensor] | None] = [None] * len(jobs)
    if run:
        picked = [jobs[i] for i in run]
        extra = {} if suffixes is None else dict(sk=[suffixes[i][0] for i in run], sv=[suffixes[i][1] for i in run],
                                                 causal=[suffixes[i][2] for i in run], slen=[suffixes[i][3] for i in run])
        outs, lses = call(mod, [q.float().contiguous() for q, _, _ in picked], picked, extra)
        for i, o, lse in zip(run, outs, lses):
            res[i] = (o, lse)
    for i, (q, _, _) in enumerate(jobs):
        if res[i] is None:
            h, m, d = q.shape
            res[i] = (torch.zeros(h, m, d), torch.full((h, m), float("-inf")))
    return res  # type: ignore[return-value]
