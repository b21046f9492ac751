"""Attention over int8 KV codes without a dequantized copy (the int8 drafter's prefix).

A decode step is bound by the bytes it reads. A drafter whose prefix is stored as int8 codes with
one scale per (head, token) (``compressors.int8`` and ``compose`` with ``quant="int8"``) reads 1 byte
per element here instead of the model dtype's 2 or 4: the C++ kernel in ``kernels/`` dequantizes
each key/value row on the fly, once for all query rows of its KV head (GQA groups x block tokens),
and returns the log-sum-exp so the runtime merges this part with attention over the exact suffix.

The kernel is compiled on first use (:mod:`.kernels`). Where it cannot be built, :func:`available`
is False and int8 drafters attend over a dequantized copy as before (slower, same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import kernels

Tensor = torch.Tensor


def _module():
    return kernels.build("int8_attention")


def available() -> bool:
    """Whether the kernel is built (building it on the first call)."""
    return _module() is not None


@dataclass
class Int8Prefix:
    """A draft cache's compressed prefix as int8 codes, per layer (counts may differ per layer):
    keys blocked by 16 tokens ``kq [H, ceil(T_l/16), D, 16]`` (a block's scores accumulate in
    registers; the last block is zero-padded), values ``vq [H, T_l, D]``, both int8, and
    ``ks``/``vs`` ``[H, T_l]`` float32 scales."""

    kq: list[Tensor] = field(default_factory=list)
    ks: list[Tensor] = field(default_factory=list)
    vq: list[Tensor] = field(default_factory=list)
    vs: list[Tensor] = field(default_factory=list)

    @classmethod
    def empty(cls, layers: int, heads: int, head_dim: int) -> Int8Prefix:
        empty = lambda *shape, dtype=torch.int8: torch.empty(*shape, dtype=dtype)  # noqa: E731
        return cls([empty(heads, 0, head_dim, BLOCK) for _ in range(layers)],
                   [empty(heads, 0, dtype=torch.float32) for _ in range(layers)],
                   [empty(heads, 0, head_dim) for _ in range(layers)],
                   [empty(heads, 0, dtype=torch.float32) for _ in range(layers)])

    def append(self, layer: int, kq: Tensor, ks: Tensor, vq: Tensor, vs: Tensor) -> None:
        """Append one chunk's codes ``[H, n, D]`` and scales ``[H, n]`` (any float dtype) to a layer."""
        h, n, d = self.vq[layer].shape
        keys = self.kq[layer].transpose(2, 3).reshape(h, -1, d)[:, :n]  # back to [H, T, D]
        self.kq[layer] = _blocked(torch.cat([keys, kq], dim=1))
        self.vq[layer] = torch.cat([self.vq[layer], vq], dim=1).contiguous()
        self.ks[layer] = torch.cat([self.ks[layer], ks.float().reshape(ks.shape[0], -1)], dim=1).contiguous()
        self.vs[layer] = torch.cat([self.vs[layer], vs.float().reshape(vs.shape[0], -1)], dim=1).contiguous()

    def length(self, layer: int) -> int:
        return self.vq[layer].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for part in (self.kq, self.ks, self.vq, self.vs) for t in part)

    def clone(self) -> Int8Prefix:
        return Int8Prefix(*[[t.clone() for t in part] for part in (self.kq, self.ks, self.vq, self.vs)])


BLOCK = 16


def _blocked(keys: Tensor) -> Tensor:
    """``[H, T, D]`` -> ``[H, ceil(T/16), D, 16]``, zero-padded."""
    h, t, d = keys.shape
    pad = -t % BLOCK
    if pad:
        keys = torch.cat([keys, keys.new_zeros(h, pad, d)], dim=1)
    return keys.view(h, -1, BLOCK, d).transpose(2, 3).contiguous()


def attention(jobs: list[tuple[Tensor, Int8Prefix, int]], scale: float) -> list[tuple[Tensor, Tensor]]:
    """For each job ``(q [H, m, D], prefix, layer)``: attention of the query rows over that layer's
    int8 prefix, ``(out [H, m, D] float32, lse [H, m] float32)``. Jobs with an empty prefix give
    ``lse = -inf`` (no weight in a merge)."""
    mod = _module()
    if mod is None:
        raise RuntimeError("int8 attention kernel is not available")
    run = [(i, q.float().contiguous(), p, li) for i, (q, p, li) in enumerate(jobs) if p.length(li)]
    res: list[tuple[Tensor, Tensor] | None] = [None] * len(jobs)
    if run:
        outs, lses = mod.int8_attention([q for _, q, _, _ in run], [p.kq[li] for _, _, p, li in run],
                                        [p.ks[li] for _, _, p, li in run], [p.vq[li] for _, _, p, li in run],
                                        [p.vs[li] for _, _, p, li in run], scale)
        for (i, *_), o, lse in zip(run, outs, lses):
            res[i] = (o, lse)
    for i, (q, _, _) in enumerate(jobs):
        if res[i] is None:
            h, m, d = q.shape
            res[i] = (torch.zeros(h, m, d), torch.full((h, m), float("-inf")))
    return res  # type: ignore[return-value]
