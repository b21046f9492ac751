"""A compact forward of a decoder model over this package's KV caches.

The model's own modules and weights compute the per-token parts (through :class:`~.model.DecoderModel`:
an HF ``*ForCausalLM`` or vLLM's module); this loop owns everything about the KV, so that:

* K/V live in preallocated per-layer buffers written in place (no per-step concatenation);
  rolling back a rejected draft is just moving a length back;
* positions are explicit (a draft cache holds an evicted prefix, so buffer index != position);
* one forward takes a flat batch of *segments*, each a run of tokens of one request over one
  cache (nano-vllm style): linear layers see all tokens together, attention runs per segment
  (draft caches with an int8 prefix: all of them in one kernel call per layer, exact window included).
  A batch can therefore mix 1-token draft steps of some requests with the verify blocks of others
  (staggering) in the same pass;
* attention needs no materialized mask: a 1-token step attends to the whole cache; a block of n
  tokens attends to the cache before it and causally to itself. On a CPU both run in one pass of
  the package's C++ kernel (``kernels/dense_attention.cpp``, ``causal=n`` for a block: each K/V
  row read once for all rows of its KV head), not PyTorch's flash kernel (it splits a decode
  step's few rows per KV head over too few work items); full-KV decoding, the baseline of every
  benchmark, uses it too. Elsewhere (``batched``: any non-CPU device) the whole batch attends in one
  scaled-dot-product call per layer (:class:`_Batched`: segments padded to the longest, a mask for
  each one's cache length and causal block), so the ops of a step do not grow with its segments
  (a GPU launches one kernel per op), draft caches whose prefix is stored chunks included
  (:mod:`.chunk_prefix`: one Triton kernel call per layer for all their prefixes); a prefix
  attended by other code (int8 codes on a CPU, KVFetch) keeps the per-segment path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import chunk_prefix, kernels, token_ops
from .cache import KVCache
from .hf_model import HfModel
from .model import DecoderModel

Tensor = torch.Tensor


@dataclass
class Segment:
    """``n`` consecutive tokens of one request, attending over ``cache`` (written in place)."""

    cache: KVCache
    n: int


def _flash_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Unmasked attention with its log-sum-exp; q ``[H, m, D]``, k/v ``[H, S, D]``."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], scale=scale)[:2]
        return out[0], lse[0].float()
    s = (q @ k.transpose(-1, -2)).float() * scale
    lse = s.logsumexp(-1)
    return ((s - lse[..., None]).exp().to(v.dtype) @ v), lse


def _dense_kernel(q: Tensor, k: Tensor):
    """The dense kernel's module where it applies to rows ``q`` over ``k`` (CPU, bf16/fp32, head
    size 64/128, 1-128 rows per KV head; ``benchmarks/attention.py`` compares it with the flash
    kernel), else ``None``."""
    if (q.device.type == "cpu" and 1 <= q.shape[1] <= 128 and k.dtype in (torch.bfloat16, torch.float32)
            and k.shape[-1] in (64, 128) and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]):
        return kernels.build("dense_attention")
    return None


def _dense_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """:func:`_flash_lse` of query rows over dense entries (a decode token's GQA group): the dense
    kernel where it applies (on its AMX tiles where :func:`attention_path` says so), flash otherwise."""
    if (mod := _dense_kernel(q, k)) is not None:
        amx = attention_path(mod, k, 1) == "amx"
        return tuple(mod.dense_attention(q.float().contiguous(), k, v, scale, amx=amx))  # type: ignore[return-value]
    return _flash_lse(q, k, v, scale)


ATTENTION_PATHS = ("auto", "amx", "kernel", "flash")


def attention_path(mod, k: Tensor, n: int) -> str:
    """How the dense kernel's module ``mod`` attends ``n`` tokens' rows (1: a decode step) over ``k``:
    ``amx`` (its AMX tile path: bf16 caches on CPUs with ``amx_bf16``, the default there), ``kernel``
    (its AVX-512 / AVX2 path) or ``flash`` (PyTorch's CPU flash kernel; verify blocks only).
    Measured per layer over 8k DRAM-resident bf16 entries (SmolLM2's shape, 2-core Xeon with AMX,
    ``benchmarks/attention.py``): 1 token 0.33 ms tiles / 0.44 ms AVX-512-BF16 / 0.83 ms flash, 5
    tokens 0.41 / 0.67 / 0.96, 17 tokens 1.03 / 2.28 / 1.50. ``VERICACHE_ATTENTION`` (A/B runs)
    overrides ``auto``; ``amx`` where the tiles are missing is an error."""
    choice = os.environ.get("VERICACHE_ATTENTION", "auto")
    if choice not in ATTENTION_PATHS:
        raise ValueError(f"VERICACHE_ATTENTION must be one of {', '.join(ATTENTION_PATHS)}, got {choice!r}")
    if k.dtype != torch.bfloat16:
        return "kernel"
    if choice == "amx" and not mod.amx:
        raise ValueError("VERICACHE_ATTENTION=amx: this CPU (or the OS) gives no AMX tiles")
    if choice == "auto":
        return "amx" if mod.amx else "kernel"
    return "kernel" if choice == "flash" and n == 1 else choice


def _flash_block(rows: Tensor, k: Tensor, v: Tensor, n: int, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of a verify block's rows ``[Hkv, g*n, D]`` (row ``j*n + i``: GQA member j, token i)
    over ``k``/``v`` ``[Hkv, S+n, D]``, causal within the block, in one PyTorch flash call with an
    additive mask: out ``[Hkv, g*n, D]`` and log-sum-exp ``[Hkv, g*n]``."""
    total = k.shape[1]
    i = torch.arange(n)
    mask = torch.zeros(n, total, dtype=k.dtype)
    mask[:, total - n:].masked_fill_(i[None, :] > i[:, None], float("-inf"))
    mask = mask.repeat(rows.shape[1] // n, 1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        rows.to(k.dtype)[None], k[None], v[None], attn_mask=mask[None, None], scale=scale)
    return out[0], lse[0].float()


def attend(q: Tensor, k: Tensor, v: Tensor, n: int, scale: float,
           prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Attention of the last ``n`` entries' queries ``q [n, Hq, D]`` over ``k``/``v`` ``[Hkv, S+n, D]``
    (causal within the block) and, if given, over an earlier part whose attention the caller computed
    (``prefix``: out ``[Hkv, g*n, D]`` and log-sum-exp ``[Hkv, g*n]``, rows ``j*n + i`` for GQA group
    member j and block token i; merged by log-sum-exp). Returns ``[n, Hq*D]``."""
    hkv, total, d = k.shape
    g = q.shape[1] // hkv
    qh = q.view(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, n, D]: query head = kv_head*g + j
    if n == 1:
        # A single new token sees every cached entry: no mask at all, GQA groups as rows.
        out, lse = _dense_lse(qh.reshape(hkv, g, d), k, v, scale)
        if prefix is not None:
            out, lse = _merge(out.float(), lse, *prefix)
        return out.to(v.dtype).reshape(1, hkv * g * d)
    rows = qh.reshape(hkv, g * n, d)
    mod = _dense_kernel(rows, k)
    if mod is not None:  # the entries before the block and its causal part in one call
        path = attention_path(mod, k, n)
        out, lse_b = (_flash_block(rows, k, v, n, scale) if path == "flash" else
                      mod.dense_attention(rows.float().contiguous(), k, v, scale, causal=n, amx=path == "amx"))
        out, lse_b = out.view(hkv, g, n, d), lse_b.view(hkv, g, n)
    else:
        past = total - n
        kb, vb = k[:, past:], v[:, past:]
        s = (qh @ kb[:, None].transpose(-1, -2)).float() * scale  # [Hkv, g, n, n]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
        lse_b = s.logsumexp(-1)
        out = (s - lse_b[..., None]).exp().to(vb.dtype) @ vb[:, None]  # [Hkv, g, n, D]
        if past:
            op, lse_p = _flash_lse(rows, k[:, :past], v[:, :past], scale)
            op, lse_p = op.view(hkv, g, n, d), lse_p.view(hkv, g, n)
            out, lse_b = _merge(op.float(), lse_p, out.float(), lse_b)
    if prefix is not None:
        po, plse = prefix
        out, _ = _merge(out.float(), lse_b, po.view(hkv, g, n, d), plse.view(hkv, g, n))
    return out.to(v.dtype).permute(2, 0, 1, 3).reshape(n, hkv * g * d)


def prefix_attention(jobs: list[tuple[Tensor, object, int, Tensor, Tensor, int]], scale: float) -> list[Tensor]:
    """Attention of each job ``(q [n, Hq, D], prefix, layer, k, v, S)`` over a draft cache's ``packed``
    prefix (a :class:`~.draft_cache.DraftPrefix`) and its exact entries, the first ``S`` of ``k``/``v``
    ``[Hkv, >= S, D]`` (the cache's layer; the last ``n`` of them are the block's own: causal), as
    :func:`attend` returns it (``[n, Hq*D]``; float32 where the prefix's kernel ``takes_suffix``,
    else ``v``'s dtype: the caller rounds once, for every job). One call per layer for every job of
    a kind: a kind that ``takes_suffix`` attends the exact entries in the same call (give it float32
    ``q`` and no row is converted per job); the others' parts are merged with them by :func:`attend`.
    A decode step's job (n = 1) takes views only: a batch-8 draft step ran ~50 small ops per layer here."""
    res: list[Tensor | None] = [None] * len(jobs)
    rows = []
    for q, _, _, k, _, _ in jobs:
        n, hkv, d = q.shape[0], k.shape[0], k.shape[2]
        # row j*n + i: member j, token i (one token: the heads' own order)
        rows.append(q.view(hkv, -1, d) if n == 1 else q.view(n, hkv, -1, d).permute(1, 2, 0, 3).reshape(hkv, -1, d))
    kinds: dict[type, list[int]] = {}
    for i, job in enumerate(jobs):
        kinds.setdefault(type(job[1]), []).append(i)
    for kind, idx in kinds.items():
        picked = [(rows[i], jobs[i][1], jobs[i][2]) for i in idx]
        if kind.takes_suffix:
            parts = kind.attention(picked, scale, suffixes=[(jobs[i][3], jobs[i][4], jobs[i][0].shape[0], jobs[i][5])
                                                            for i in idx])
            for i, (out, _) in zip(idx, parts):
                q, _, _, _, v, _ = jobs[i]
                n, hkv, d = q.shape[0], v.shape[0], v.shape[2]
                res[i] = out.view(1, -1) if n == 1 else out.view(hkv, -1, n, d).permute(2, 0, 1, 3).reshape(n, -1)
        else:
            for i, part in zip(idx, kind.attention(picked, scale)):
                q, _, _, k, v, length = jobs[i]
                res[i] = attend(q, k[:, :length], v[:, :length], q.shape[0], scale, part)
    return res  # type: ignore[return-value]


def _merge(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over the union of two disjoint key sets from each set's output and log-sum-exp."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp(), (lse2 - m).exp()
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None], m + (w1 + w2).log()


def _row_writer(segments: list[Segment]):
    """The dense kernel's module where it writes a forward's new K/V rows into every segment's cache
    in one call per layer (CPU caches, contiguous), else ``None`` (one indexed copy per segment)."""
    c0 = segments[0].cache
    if c0.k.device.type != "cpu" or not all(s.cache.k.is_contiguous() and s.cache.v.is_contiguous() for s in segments):
        return None
    return kernels.build("dense_attention")


def _write_rows(segments: list[Segment], li: int, k: Tensor, v: Tensor, ats: list[int], starts: list[int],
                writer) -> None:
    """New K/V rows ``k``/``v`` ``[N, Hkv, D]`` of layer ``li`` into each segment's cache at its
    entries ``ats`` on (the segment's rows from ``starts``)."""
    if writer is not None:
        writer.write_rows([s.cache.k for s in segments], [s.cache.v for s in segments], li, k.contiguous(),
                          v.contiguous(), ats, starts, [s.n for s in segments])
        return
    for seg, off, at in zip(segments, starts, ats):
        c, n = seg.cache, seg.n
        c.k[li, :, at:at + n] = k[off:off + n].transpose(0, 1)
        c.v[li, :, at:at + n] = v[off:off + n].transpose(0, 1)


class _Batched:
    """One forward's segments as one padded batch: ``B`` segments of up to ``nmax`` tokens over
    their caches' entries before the forward (copied into one padded buffer per forward, up to
    ``smax``), attended in one call per layer; the new K/V reach the caches after the last layer
    (:meth:`write`). Every index and mask is built on the device from one small host copy."""

    def __init__(self, segments: list[Segment], starts: list[int], layers: int, device: torch.device):
        self.segments, self.starts = segments, starts
        # Draft caches whose prefix is stored chunks (chunk_prefix, one arena, every segment): the
        # kernel attends over their prefixes in one call per layer, merged with the dense part below.
        self.prefixes = [s.cache.packed for s in segments]
        self.chunked = any(p is not None for p in self.prefixes)
        b = len(segments)
        self.uniform = all(s.cache.uniform for s in segments)
        # past entries per (layer, segment); one row for all layers where every cache's base is uniform
        past = [[s.cache.length(li) for s in segments] for li in (range(layers) if not self.uniform else [0])]
        ns = [s.n for s in segments]
        self.nmax, self.smax = max(ns), max(max(row) for row in past)
        qi = [st + min(i, n - 1) for st, n in zip(starts, ns) for i in range(self.nmax)]  # padded row -> token
        oi = [j * self.nmax + i for j, n in enumerate(ns) for i in range(n)]  # token -> padded row
        host = torch.tensor([x for row in past for x in row] + ns + qi + oi, dtype=torch.long)
        idx = host.to(device, non_blocking=True)
        p = len(past) * b
        past_len, n = idx[:p].view(len(past), b), idx[p:p + b]
        self.qi, self.oi = idx[p + b:p + b + len(qi)], idx[p + b + len(qi):]
        j, i = torch.arange(self.smax, device=device), torch.arange(self.nmax, device=device)
        past_ok = (j < past_len[..., None])[:, :, None, None, :].expand(-1, -1, 1, self.nmax, -1)
        new_ok = ((i[None, :] <= i[:, None])[None] & (i < n[:, None])[:, None, :])[None, :, None]
        self.mask = torch.cat([past_ok, new_ok.expand(len(past), -1, -1, -1, -1)], -1)  # [L|1, B, 1, nmax, S+nmax]
        c0 = segments[0].cache
        if b == 1 and self.uniform:  # one segment (a prefill): its cache is the batch, no copy
            self.k, self.v = c0.k[:, None, :, :self.smax], c0.v[:, None, :, :self.smax]
        else:
            shape = (layers, b, c0.k.shape[1], self.smax, c0.k.shape[3])
            self.k, self.v = c0.k.new_zeros(shape), c0.v.new_zeros(shape)
            # Only valid entries: a stale one (NaN, say) would poison 0 * v. One multi-tensor copy
            # per forward, not one per segment.
            dst, src = [], []
            for j, s in enumerate(segments):
                c = s.cache
                for li in ([slice(None)] if self.uniform else range(layers)):
                    m = c.length(0 if self.uniform else li)
                    dst += [self.k[li, j, :, :m], self.v[li, j, :, :m]]
                    src += [c.k[li, :, :m], c.v[li, :, :m]]
            torch._foreach_copy_(dst, src)
        self.new_k: list[Tensor] = []
        self.new_v: list[Tensor] = []

    def attend(self, li: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Attention of every segment's queries ``q [N, Hq, D]`` (new ``k``/``v`` ``[N, Hkv, D]``) in
        layer ``li``; returns ``[N, Hq*D]``."""
        self.new_k.append(k)
        self.new_v.append(v)
        b, nmax = len(self.segments), self.nmax

        def pad(x: Tensor) -> Tensor:
            return x[self.qi].view(b, nmax, x.shape[1], x.shape[2]).transpose(1, 2)

        keys = torch.cat([self.k[li], pad(k)], 2)
        values = torch.cat([self.v[li], pad(v)], 2)
        mask = self.mask[0 if self.uniform else li]  # [B, 1, nmax, S + nmax]
        if not self.chunked:
            out = torch.nn.functional.scaled_dot_product_attention(
                pad(q), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
            return out.transpose(1, 2).reshape(b * nmax, -1)[self.oi]
        # The dense part needs its log-sum-exp for the merge (SDPA does not return it): the dense
        # entries are draft caches' exact suffixes (every segment here has a chunked prefix), so
        # explicit float32 scores are cheap.
        hkv, d = keys.shape[1], keys.shape[3]
        g = q.shape[1] // hkv
        rows = pad(q).reshape(b, hkv, g * nmax, d)  # row j * nmax + i: GQA member j, token i
        s = (rows.float() @ keys.float().transpose(-1, -2)) * scale
        s.masked_fill_(~mask.repeat(1, 1, g, 1), float("-inf"))
        lse = s.logsumexp(-1)
        # merged with the kernel's prefix part in its reduce launch (no _merge: four fewer ops a layer)
        out, _ = chunk_prefix.attend(rows, self.prefixes, li, scale, suffix=((s - lse[..., None]).exp() @ values.float(), lse))
        return out.to(v.dtype).view(b, q.shape[1], nmax, d).transpose(1, 2).reshape(b * nmax, -1)[self.oi]

    def write(self) -> None:
        """The forward's new K/V into each segment's cache (after the last layer)."""
        ks, vs = torch.stack(self.new_k), torch.stack(self.new_v)  # [L, N, Hkv, D]
        dst, src = [], []
        for s, off in zip(self.segments, self.starts):
            c, n = s.cache, s.n
            for li in ([slice(None)] if self.uniform else range(len(self.new_k))):
                at = c.length(0 if self.uniform else li)
                dst += [c.k[li, :, at:at + n], c.v[li, :, at:at + n]]
                src += [ks[li, off:off + n].transpose(-3, -2), vs[li, off:off + n].transpose(-3, -2)]
        torch._foreach_copy_(dst, src)


class Runtime:
    """Forward of a :class:`DecoderModel` over :class:`KVCache`. A plain HF Llama-family
    ``*ForCausalLM`` (Llama, SmolLM2, Mistral, Qwen2/3) is wrapped in :class:`HfModel`.

    ``batched``: attention of a whole step in one call per layer (:class:`_Batched`); ``None``
    (default): on any device but the CPU, whose C++ kernels attend per segment."""

    def __init__(self, model: DecoderModel | torch.nn.Module, batched: bool | None = None):
        self.model = model if isinstance(model, DecoderModel) else HfModel(model)
        m = self.model
        self.num_layers, self.num_heads, self.num_kv_heads = m.num_layers, m.num_heads, m.num_kv_heads
        self.head_dim, self.scale, self.dtype, self.device = m.head_dim, m.scale, m.dtype, m.device
        self.vocab_size, self.eos_ids = m.vocab_size, m.eos_ids
        self.batched = self.device.type != "cpu" if batched is None else batched
        # Built or loaded now, once per process, so that no build lands inside a timed round or a
        # vLLM step (a first build says so on stderr: kernels.build). Sampling runs on the host
        # whatever the device, so its ops' kernel is wanted everywhere.
        kernels.build("token_ops")
        if self.device.type == "cpu":
            kernels.build("dense_attention")
            if isinstance(self.model, HfModel):  # its nn.Linear layers run through engine/linear.py
                kernels.build("linear")

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache.empty(self.num_layers, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, segments: list[Segment],
                rows: Tensor | None = None, capture_q: int = 0) -> tuple[Tensor, Tensor | None]:
        """Run ``tokens`` (flat ``[N]``, segments back to back) at ``positions`` ``[N]``.

        Appends each segment's K/V to its cache (``cache.n += n``). Returns float32 logits of
        ``rows`` (default: all) and, if ``capture_q``, the post-RoPE queries of the last
        ``capture_q`` tokens ``[layers, Hq, capture_q, D]`` (observation window for eviction).
        """
        total = sum(s.n for s in segments)
        if tokens.shape != (total,) or positions.shape != (total,):
            raise ValueError(f"tokens/positions must be [{total}], got {tuple(tokens.shape)}/{tuple(positions.shape)}")
        for s in segments:
            if s.n <= 0:
                raise ValueError("empty segment")
            if max(s.cache.base) + s.cache.n + s.n > s.cache.capacity:
                raise ValueError(f"cache full: capacity {s.cache.capacity}, need {max(s.cache.base) + s.cache.n + s.n}")
        m = self.model
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        x = m.embed(tokens)
        cos, sin = m.rope(positions)
        cos, sin = cos[:, None], sin[:, None]  # [N, 1, D]: one rotation for every head
        captured = []
        starts = [sum(s.n for s in segments[:i]) for i in range(len(segments))]
        packed = [s.cache.packed for s in segments if s.cache.packed is not None]
        any_packed = bool(packed)
        code_rows = any_packed and all(type(p).takes_suffix for p in packed)
        # Batched: dense caches, or every segment a draft cache over stored chunks of one arena (one
        # kernel call per layer). A verify segment beside draft segments (staggered rounds) keeps the
        # per-segment path: its full cache is attended exactly as plain decoding attends it.
        batchable = not packed or (len(packed) == len(segments) and all(
            type(p).batched and p.arena is packed[0].arena for p in packed))
        batch = _Batched(segments, starts, self.num_layers, self.device) if self.batched and batchable else None
        writer = _row_writer(segments)
        # Each cache's per-layer K/V views, made once per forward: a select per layer and segment cost
        # more (a batch-8 draft step passes its code kernel each cache's layer whole, with its length).
        layer_kv = [(s.cache.k.unbind(0), s.cache.v.unbind(0)) for s in segments] if batch is None else []
        for li in range(self.num_layers):
            q, k, v = m.qkv(li, m.input_norm(li, x))
            q, k = m.qk_norm(li, q, k)
            q, k = token_ops.rope(q, cos, sin), token_ops.rope(k, cos, sin)
            if capture_q:
                captured.append(q[-capture_q:].transpose(0, 1))
            if batch is not None:
                x = x + m.o_proj(li, batch.attend(li, q, k, v, self.scale))
                x = x + m.mlp(li, m.post_attention_norm(li, x))
                continue
            ats = [seg.cache.length(li) for seg in segments]
            _write_rows(segments, li, k, v, ats, starts, writer)
            ends = [at + seg.n for at, seg in zip(ats, segments)]  # each cache's length in this layer now
            # Prefixes attended by their own code (int8 codes, KVFetch), with their exact entries:
            # one call per kind and layer; int8 / codebook kernels take the rows as float32, converted once.
            qp = q.float() if code_rows else q
            packed = iter(prefix_attention(
                [(qp[off:off + s.n], s.cache.packed, li, ck[li], cv[li], end)
                 for s, (ck, cv), off, end in zip(segments, layer_kv, starts, ends) if s.cache.packed is not None],
                self.scale) if any_packed else [])
            outs = [next(packed) if seg.cache.packed is not None else
                    attend(q[off:off + seg.n], ck[li][:, :end], cv[li][:, :end], seg.n, self.scale)
                    for seg, (ck, cv), off, end in zip(segments, layer_kv, starts, ends)]
            att = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = x + m.o_proj(li, att.to(x.dtype))  # int8 / codebook outputs are float32: rounded here, once
            x = x + m.mlp(li, m.post_attention_norm(li, x))
        if batch is not None:
            batch.write()
        for seg in segments:
            seg.cache.n += seg.n
        if rows is not None:
            x = x[rows.to(self.device)]
        logits = m.lm_head(m.final_norm(x)).float()
        return logits, (torch.stack(captured) if capture_q else None)

