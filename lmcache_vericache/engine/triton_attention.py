"""Decode attention over stored low-bit chunks without a dequantized copy (Triton, for GPUs).

A draft step is bound by the bytes it reads. These kernels read one layer of a request's prefix
as its chunks are stored (codes, scales, zeros, residual: :mod:`..compressors.formats`) from a
:class:`ChunkPool` addressed by a chunk table (like vLLM's block table, one entry per chunk), and
dequantize in registers: int8, int4, KIVI (2/4 bit, with its dense residual) and TurboQuant (2-4
bit). They return out and the log-sum-exp, which the caller merges with the exact suffix as
``runtime._merge`` does, or passes in (``suffix``) to have it merged in the launch that merges the
splits (:func:`merge`). TurboQuant's rotation is applied outside the kernel, once per call: q is
rotated by the key rotation before (``q @ R_k^T``) and the output by the value rotation after, so the
kernel reads only codebook entries times norms.

A draft step is bound by the bytes it reads (the first kernels ran at about a third of that bound
on an H200), so: a side whose scale is one per token (:func:`folds`: int8, TurboQuant, int4 with
one group per head) is never dequantized, its scale applied to scores and probabilities instead;
a request's splits divide its own tiles (a short request's splits do not idle while a long one's
run serially); and one reduce kernel merges the splits' partials (and the suffix).

Triton is imported on first use, so the package imports without it; on a CPU the kernels run under
``TRITON_INTERPRET=1`` (tests; fp32 and fp16: Triton 3.9's interpreter mishandles bf16)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..compressors.formats import KVFormat, Side

Tensor = torch.Tensor
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PARTS = ("codes", "scale", "zero", "residual")
BITS = (2, 3, 4, 8)  # code widths the kernel unpacks


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """Whether the kernels can run here: Triton imports and a CUDA device is present, or
    ``TRITON_INTERPRET=1`` (CPU tensors)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return interpreted() or torch.cuda.is_available()


@dataclass
class ChunkPool:
    """One layer's chunks of one format, each chunk's buffers as stored, flat, in one slot:
    ``k``/``v`` map ``codes``/``scale``/``zero``/``residual`` to ``[slots, per-chunk size]`` (absent
    parts are missing). Owned by its caller; the kernels only read it."""

    fmt: KVFormat
    k: dict[str, Tensor]
    v: dict[str, Tensor]

    @classmethod
    def of(cls, fmt: KVFormat, chunks: Sequence[dict[str, Tensor]], device: torch.device | str | None = None
           ) -> ChunkPool:
        """Stack ``chunks`` (per chunk, ``fmt.buffers(ckv, layer)``) into slots ``0..len-1``."""
        if not chunks:
            raise ValueError("a chunk pool needs at least one chunk")
        pool = cls.empty(fmt, len(chunks), device)
        for i, c in enumerate(chunks):
            pool.write(i, c, f"chunk {i}")
        return pool

    @classmethod
    def empty(cls, fmt: KVFormat, slots: int, device: torch.device | str | None = None) -> ChunkPool:
        """A pool of ``slots`` zeroed slots."""
        sides = []
        for side in (fmt.k, fmt.v):
            sides.append({part: torch.zeros(slots, n, dtype=dtype, device=device)
                          for part, (n, dtype) in _sizes(fmt, side).items() if _names(side)[part] is not None})
        return cls(fmt, *sides)

    def write(self, slot: int, buffers: dict[str, Tensor], what: str = "chunk") -> None:
        """Copy one chunk's buffers (``fmt.buffers(ckv, layer)``) into ``slot``, each checked first to
        be the format's size and dtype: the kernels index by the format, so a buffer of another size
        (a chunk from another model, or a corrupt one) would be read out of bounds."""
        fmt = self.fmt
        for side in (fmt.k, fmt.v):
            want = _sizes(fmt, side)
            for part, name in _names(side).items():
                if name is not None and (buffers[name].numel(), buffers[name].dtype) != want[part]:
                    raise ValueError(f"{what}: buffer {name!r} is {buffers[name].numel()} x {buffers[name].dtype}, "
                                     f"the {fmt.method} format of {fmt.tokens}-token chunks has {want[part]}")
        for side, dst in ((fmt.k, self.k), (fmt.v, self.v)):
            for part, name in _names(side).items():
                if name is not None:
                    dst[part][slot].copy_(buffers[name].reshape(-1), non_blocking=True)

    def grow(self, slots: int) -> None:
        """Grow to ``slots`` slots in place (the existing ones copied, the new ones zeroed)."""
        for side in (self.k, self.v):
            for part, t in side.items():
                grown = t.new_zeros(slots, t.shape[1])
                grown[:t.shape[0]] = t
                side[part] = grown

    @property
    def slots(self) -> int:
        return self.k["codes"].shape[0]

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot (one chunk of this layer) takes."""
        return sum(t.shape[1] * t.element_size() for side in (self.k, self.v) for t in side.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for side in (self.k, self.v) for t in side.values())


def _names(side: Side) -> dict[str, str | None]:
    """Buffer names of ``side``'s parts (``None``: absent)."""
    return dict(zip(_PARTS, (side.codes, side.scale, side.zero, side.residual)))


def _sizes(fmt: KVFormat, side: Side) -> dict[str, tuple[int, torch.dtype]]:
    """Elements and dtype of each of one chunk's buffers of ``side`` (what the kernel indexes)."""
    h, d = fmt.heads, fmt.head_dim
    stats = (h * side.scale_rows() * (d // side.channel_group), torch.float16)
    return {"codes": (side.code_bytes(h, d), torch.int8 if side.signed else torch.uint8), "scale": stats,
            "zero": stats, "residual": (h * (fmt.tokens - side.n_q) * d, fmt.dtype)}


def folds(side: Side, head_dim: int) -> bool:
    """Whether the kernel folds ``side``'s scale out of its tiles: one scale (and zero) per token
    (group) and head, no dense residual. int8 and TurboQuant (a norm per vector) do; int4 only with
    ``group_size >= head_dim`` (its default 32-channel groups do not); KIVI does not (per-channel
    keys, per-group values, residual tails)."""
    return side.channel_group == head_dim and side.residual is None


def _side_args(side: Side, bufs: dict[str, Tensor], device: torch.device, head_dim: int) -> tuple[list, dict]:
    """Pointer arguments (absent parts: the codes, never read) and constexprs of one side."""
    codes = bufs["codes"]
    lut = side.codebook.to(device) if side.codebook is not None else codes
    ptrs = [codes, bufs["scale"], bufs.get("zero", codes), lut, bufs.get("residual", codes)]
    const = dict(NQ=side.n_q, BITS=side.bits, TG=side.token_group, CG=side.channel_group,
                 ZERO=side.zero is not None, LUT=side.codebook is not None, RES=side.residual is not None,
                 FOLD=folds(side, head_dim))
    return ptrs, const


def launch(q: Tensor, pool: ChunkPool, table: Tensor, lengths: Tensor, scale: float, tile: int, splits: int,
           num_warps: int = 4) -> tuple[tuple[int, int, int], list, dict]:
    """Grid, arguments (out and lse allocated: ``[splits, ...]``) and constexprs of one
    ``decode_attention`` launch over validated inputs, q already rotated (the AOT compile test
    builds the kernel's signature from them)."""
    fmt = pool.fmt
    b, h, m, d = q.shape
    out = torch.empty(splits, b, h, m, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, b, h, m, dtype=torch.float32, device=q.device)
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    (kp, kc), (vp, vc) = (_side_args(side, bufs, q.device, d) for side, bufs in ((fmt.k, pool.k), (fmt.v, pool.v)))
    grid = (b, h, -(-m // block_m) * splits)  # each request's splits divide its own tiles (in the kernel)
    args = [q, out, lse, table, lengths, table.stride(0), m, float(scale), *kp, *vp]
    const = dict(H=h, T=fmt.tokens, D=d, BLOCK_M=block_m, TILE=tile, SPLITS=splits,
                 BYTEWISE=tile < 32 or tile // num_warps < 8,  # where the join unpack was wrong (_unpack)
                 **{f"K_{k}": v for k, v in kc.items()}, **{f"V_{k}": v for k, v in vc.items()})
    return grid, args, const


def check_format(fmt: KVFormat) -> None:
    """``ValueError`` where the kernels cannot read ``fmt``: a head size that is not a power of 2
    >= 16, a code width other than :data:`BITS`, a dtype other than :data:`DTYPES`."""
    d = fmt.head_dim
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of 2 >= 16 for the Triton kernels, got {d}")
    bad = [s.bits for s in (fmt.k, fmt.v) if s.bits not in BITS]
    if bad:
        raise ValueError(f"the Triton kernels read codes of {BITS} bits, the {fmt.method} format has {bad}")
    if fmt.dtype not in DTYPES:
        raise ValueError(f"the Triton kernels take {DTYPES}, not {fmt.dtype}")


def default_splits(b: int, h: int, m: int, chunks: int, device: torch.device) -> int:
    """Splits when the caller gives none: the fewest (a power of 2) that make the programs
    (requests x KV heads x row blocks x splits) at least 2 per SM of ``device``, so every SM has
    programs to overlap loads with, and at most one per chunk of the widest table row; 1 off CUDA.
    Each request's splits divide its own tiles, so a shorter request's splits are shorter too.
    (On an H200 at 8k tokens, with splits sized by the widest row, 512 programs ran faster unsplit
    than in 2 splits, 256 faster in 4 than in 1.)"""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(1, b * h * -(-m // 64))
    splits = 1
    while programs * splits < 2 * sms and splits * 2 <= max(1, chunks):
        splits *= 2
    return splits


def merge(out: Tensor, lse: Tensor, suffix: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """One launch of the reduce kernel: the partials ``out [S, ..., D]`` (fp32, contiguous) and
    ``lse [S, ...]`` of ``S`` splits (natural log; -inf: empty, weight 0) and, if given, ``suffix``
    ``(out [..., D], lse [...])`` over other keys merged by log-sum-exp into ``(out [..., D] fp32,
    lse [...])``, as ``runtime._merge`` would pairwise; rows where every part is empty get zeros and
    -inf (``_merge`` gives NaN there)."""
    from . import triton_kernels  # imports triton

    d = out.shape[-1]
    rows = lse[0].numel()
    if out.shape[:-1] != lse.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"partials must be fp32 contiguous out [S, ..., D] and lse [S, ...], got "
                         f"{tuple(out.shape)} {out.dtype} and {tuple(lse.shape)}")
    if suffix is not None:
        if tuple(suffix[0].shape) != tuple(out.shape[1:]) or tuple(suffix[1].shape) != tuple(lse.shape[1:]):
            raise ValueError(f"suffix must be out {tuple(out.shape[1:])} and lse {tuple(lse.shape[1:])}, "
                             f"got {tuple(suffix[0].shape)} and {tuple(suffix[1].shape)}")
        o2, l2 = suffix[0].contiguous(), suffix[1].float().contiguous()
    else:
        o2, l2 = out, lse  # never read
    res = torch.empty(out.shape[1:], dtype=torch.float32, device=out.device)
    res_lse = torch.empty(lse.shape[1:], dtype=torch.float32, device=out.device)
    block = max(1, min(16, 1024 // d))  # rows per program: [BLOCK_R, D] fp32 partials in registers
    if rows:
        triton_kernels.merge_splits[(-(-rows // block),)](out, lse.contiguous(), o2, l2, res, res_lse, rows, D=d,
                                                           SPLITS=out.shape[0], SUFFIX=suffix is not None, BLOCK_R=block)
    return res, res_lse


def attention(q: Tensor, pool: ChunkPool, table: Tensor, lengths: Tensor, scale: float, *,
              tile: int = 64, splits: int | None = None, num_warps: int = 4, num_stages: int | None = None,
              check: bool = True, suffix: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Attention of query rows ``q [B, H, M, D]`` (the rows of KV head ``h``: GQA members x block
    tokens) over request ``b``'s first ``lengths[b]`` prefix tokens, held in chunk slots
    ``table[b, :]`` (int32 ``[B, max_chunks]``; token ``t`` in slot ``table[b, t // fmt.tokens]``).
    Returns ``(out [B, H, M, D] float32, lse [B, H, M] float32)``, natural log; a request with
    no prefix gets zeros and ``-inf``. ``tile``: tokens per step (a power of 2 >= 16; a chunk of
    ``T`` tokens takes ``ceil(T / tile)`` steps, so a tile dividing ``T`` wastes none). ``splits`` > 1
    divides each request's own tiles over that many programs (for batches too small to fill the
    GPU), merged in one reduce launch (:func:`merge`); ``None``: :func:`default_splits`.
    ``num_warps`` (2, 4, 8) and ``num_stages`` (1-4: tiles in flight, Triton's software pipelining) are launch options;
    ``num_stages=None``: 2, or 1 for a codebook format (its per-element table loads ran about twice
    as fast unpipelined on an H200, while int4/int8 ran faster with 2).
    ``check`` validates the table against the pool (a host sync; pass False on a hot path whose
    table the caller built). ``suffix``: ``(out [B, H, M, D], lse [B, H, M])`` of the same rows over
    other keys (the exact suffix), merged by log-sum-exp in the launch that merges the splits
    (:func:`merge`): the result is then attention over both."""
    fmt = pool.fmt
    if q.dim() != 4 or q.shape[1] != fmt.heads or q.shape[3] != fmt.head_dim:
        raise ValueError(f"q must be [B, {fmt.heads}, M, {fmt.head_dim}], got {tuple(q.shape)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q dtype must be one of {DTYPES}, got {q.dtype}")
    check_format(fmt)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of 2 >= 16, got {tile}")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits must be None or an int >= 1, got {splits!r}")
    if num_warps not in (2, 4, 8):
        raise ValueError(f"num_warps must be 2, 4 or 8, got {num_warps!r}")
    if num_stages not in (None, 1, 2, 3, 4):
        raise ValueError(f"num_stages must be 1, 2, 3 or 4, got {num_stages!r}")
    b, h, m, _ = q.shape
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != b:
        raise ValueError(f"table must be int32 [{b}, max_chunks], got {table.dtype} {tuple(table.shape)}")
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (b,):
        raise ValueError(f"lengths must be int32 [{b}], got {lengths.dtype} {tuple(lengths.shape)}")
    if check and b:
        if int(lengths.max()) > table.shape[1] * fmt.tokens or int(lengths.min()) < 0:
            raise ValueError(f"lengths must be in [0, {table.shape[1] * fmt.tokens}] (table width x chunk tokens)")
        used = table[torch.arange(table.shape[1], device=table.device)[None] * fmt.tokens < lengths[:, None]]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= pool.slots):
            raise ValueError(f"table entries must be slots in [0, {pool.slots})")
    from . import triton_kernels  # imports triton

    if fmt.k.rotation is not None:
        q = (q.float() @ fmt.k.rotation.to(q.device).T).to(q.dtype)
    if splits is None:
        splits = default_splits(b, h, m, table.shape[1], q.device)
    if num_stages is None:
        num_stages = 1 if fmt.k.codebook is not None or fmt.v.codebook is not None else 2
    grid, args, const = launch(q.contiguous(), pool, table, lengths, scale, tile, splits, num_warps)
    triton_kernels.decode_attention[grid](*args, **const, num_warps=num_warps, num_stages=num_stages)
    out, lse = args[1], args[2]
    rot = fmt.v.rotation.to(q.device) if fmt.v.rotation is not None else None
    if suffix is not None and rot is not None:  # merged in the rotated domain (R orthogonal: o R^T R = o)
        suffix = (suffix[0].float() @ rot.T, suffix[1])
    if splits > 1 or suffix is not None:
        out, lse = merge(out, lse, suffix)
    else:
        out, lse = out[0], lse[0]
    if rot is not None:
        out = out @ rot
    return out, lse
