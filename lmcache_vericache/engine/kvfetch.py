"""KVFetch: attention over a PoissonComp prefix, certified to (epsilon, delta), fetching what it needs.

A draft cache's prefix held as a :class:`CertifiedPrefix` is attended per decode step and query head
as VerKV specifies (docs/verkv.md): weights of every prefix token from the *sketch* (a low-bit copy
of every key, or the exact keys), the fetch plan of :mod:`.certificate` (tokens moved from the sample
part ``L`` to the exactly known part ``H`` until the Bernstein certificate is below ``epsilon``),
then ``N^ / D^`` over the known tokens (weight 1) and the sampled ones (weight ``lambda_i / r_i``),
returned with ``log D^`` so the runtime merges it with the exact suffix like any other prefix.

Query heads of one KV head decide separately; the tokens fetched for one KV head are the union of
its query heads' plans and are known exactly to all of them (a choice made from the sketch and
``r``, never from the sample, so the estimator keeps its guarantee).

Where things live: the resident part (the sample and the tokens kept for sure) is what a GPU would
hold; the full K/V (``full_k``/``full_v``, the store's full tier, in host memory) is read only for
fetched tokens. On a CPU both are host memory, so fetches are *counted* (``stats``), not timed.
A prefix lives on its ``device`` (the draft cache's): its chunks are moved there as they are
appended, and off the CPU a step attends every KV head at once over a mask of the known and
drawn tokens (no per-head gather, no host sync; the counters stay on the device until read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..backends.config import check_kvfetch
from ..compressors import CompressedKV
from ..compressors.packing import dequantize, quantize
from ..compressors.poissoncomp import is_poisson_sample
from .certificate import estimate, fetch_plan, shrinkage

Tensor = torch.Tensor


@dataclass
class FetchStats:
    """Counters of one prefix's KVFetch decisions (a decision: one query row of one head)."""

    decisions: int = 0
    fetching_decisions: int = 0  # decisions whose own plan fetched at least one token
    tokens_fetched: int = 0  # non-resident tokens read from the full tier (per KV head and layer)
    bytes_fetched: int = 0
    tokens_attended: int = 0  # prefix tokens per KV head and layer, summed over steps (traffic base)

    def as_dict(self) -> dict[str, float]:
        d = {k: int(v) for k, v in vars(self).items()}  # device counters are read here, once
        d["fetch_fraction"] = self.tokens_fetched / max(1, self.tokens_attended)
        d["fetching_decision_fraction"] = self.fetching_decisions / max(1, self.decisions)
        return d


@dataclass
class _Layer:
    r: Tensor  # [H, T] float32 inclusion probabilities (1: kept for sure)
    drawn: Tensor  # [H, T] bool: in the sample or kept for sure (resident)
    sketch: Tensor  # [H, T, D] float32 keys as the sketch sees them
    full_k: Tensor  # [H, T, D] exact keys and values (the full tier)
    full_v: Tensor


@dataclass
class CertifiedPrefix:
    """The compressed prefix of a draft cache, attended with KVFetch. ``sketch_bits``: ``None`` for an
    exact sketch, else 2, 4 or 8 (per-channel asymmetric codes over each chunk's tokens)."""

    num_layers: int
    epsilon: float = 0.05
    delta: float = 0.1
    sketch_bits: int | None = 2
    device: torch.device | str = "cpu"
    layers: list[_Layer | None] = field(default_factory=list)
    stats: FetchStats = field(default_factory=FetchStats)
    takes_suffix: ClassVar[bool] = False  # the DraftPrefix protocol (engine/draft_cache.py)
    batched: ClassVar[bool] = False
    arena_backed: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_kvfetch(self.epsilon, self.delta, self.sketch_bits)
        if not self.layers:
            self.layers = [None] * self.num_layers

    def append(self, ckv: CompressedKV, full: Tensor) -> None:
        """Add one chunk: its PoissonComp compression ``ckv`` and its full KV ``[2, L, T, H*D]``."""
        if not is_poisson_sample(ckv.method, ckv.params):
            raise ValueError(f"KVFetch needs PoissonComp chunks (their inclusion probabilities), got {ckv.method}")
        h, d = ckv.num_kv_heads, ckv.head_dim
        t, dev = full.shape[2], self.device
        full = full.to(dev, non_blocking=True)
        for li, parts in enumerate(ckv.buffers_by_layer()):
            k = full[0, li].view(t, h, d).transpose(0, 1).contiguous()
            v = full[1, li].view(t, h, d).transpose(0, 1).contiguous()
            drawn = torch.zeros(h, t, dtype=torch.bool, device=dev)
            drawn.scatter_(1, parts["pos"].to(dev).long(), parts["in"].to(dev).bool())
            new = _Layer(parts["r"].to(dev).float(), drawn, self._sketch(k), k, v)
            old = self.layers[li]
            self.layers[li] = new if old is None else _Layer(*(torch.cat([a, b], dim=1) for a, b in zip(
                (old.r, old.drawn, old.sketch, old.full_k, old.full_v),
                (new.r, new.drawn, new.sketch, new.full_k, new.full_v))))

    def extend(self, ckvs: Sequence[CompressedKV], compressor: object = None,
               full: Sequence[Tensor] | None = None) -> None:
        """Add chunks with their full KV (``KV_2LTD`` each, from the full tier)."""
        if full is None or len(full) != len(ckvs):
            raise ValueError("a KVFetch prefix needs every chunk's full KV beside its compressed copy")
        for ckv, kv in zip(ckvs, full):
            self.append(ckv, kv)

    def release(self) -> None:
        """Nothing is held outside this object (its tensors go with it)."""

    def length(self, layer: int) -> int:
        """Tokens of the prefix (every token: the fetch decides per step which are read exactly)."""
        lay = self.layers[layer]
        return 0 if lay is None else lay.drawn.shape[1]

    @staticmethod
    def attention(jobs: list, scale: float, suffixes: list | None = None) -> list[tuple[Tensor, Tensor]]:
        return attention(jobs, scale)

    def _sketch(self, keys: Tensor) -> Tensor:
        if self.sketch_bits is None:
            return keys.float()
        q, mn, scale = quantize(keys.float(), self.sketch_bits, dim=1)  # per channel over the chunk
        return dequantize(q, mn, scale, self.sketch_bits, tuple(keys.shape), torch.float32)

    @property
    def nbytes(self) -> int:
        """Resident bytes: the drawn tokens' K/V, the sketch (at its bit width) and ``r`` (float16)."""
        total = 0
        for lay in self.layers:
            if lay is not None:
                h, t, d = lay.full_k.shape
                bits = 32 if self.sketch_bits is None else self.sketch_bits
                total += int(lay.drawn.sum()) * 2 * d * lay.full_k.element_size() + h * t * (d * bits // 8 + 2)
        return total

    def clone(self) -> CertifiedPrefix:
        return CertifiedPrefix(self.num_layers, self.epsilon, self.delta, self.sketch_bits, self.device,
                               list(self.layers), FetchStats(**vars(self.stats)))

    def attend(self, q: Tensor, layer: int, scale: float) -> tuple[Tensor, Tensor]:
        """Query rows ``q [H, m, D]`` over this layer's prefix: ``(out [H, m, D], lse [H, m])`` float32."""
        h, m, d = q.shape
        lay = self.layers[layer]
        if lay is None:
            return torch.zeros(h, m, d, device=q.device), torch.full((h, m), float("-inf"), device=q.device)
        qf = q.float()
        s_hat = (qf @ lay.sketch.transpose(1, 2)) * scale  # [H, m, T]
        w_hat = (s_hat - s_hat.amax(-1, keepdim=True)).exp()
        r, sure = lay.r[:, None].expand_as(w_hat), (lay.r == 1)[:, None].expand_as(w_hat)
        fetch, _, _ = fetch_plan(w_hat, r, sure, self.epsilon, self.delta)
        fetched = fetch.any(1)  # [H, T]: the union over the KV head's query rows
        known = sure | fetched[:, None]
        in_l = ~known & (r < 1)
        lam, _ = shrinkage(w_hat, r, in_l)
        mult = estimate(w_hat, r, known, lay.drawn[:, None].expand_as(w_hat), lam)  # [H, m, T]
        st, cpu = self.stats, q.device.type == "cpu"
        st.decisions += h * m
        fetching = fetch.any(-1).sum()
        n_new = (fetched & ~lay.drawn).sum()  # the drawn tokens are resident already
        st.fetching_decisions += int(fetching) if cpu else fetching
        st.tokens_fetched += int(n_new) if cpu else n_new
        st.bytes_fetched += (int(n_new) if cpu else n_new) * 2 * d * lay.full_k.element_size()
        st.tokens_attended += h * lay.r.shape[1]
        if not cpu:  # every head at once over its known and drawn tokens; the others masked out
            seen = fetched | lay.drawn  # [H, T]
            logits = (qf @ lay.full_k.float().transpose(1, 2)) * scale + mult.log()
            logits = logits.masked_fill(~seen[:, None], float("-inf"))
            lse = logits.logsumexp(-1)
            out = (logits - lse[..., None]).exp().nan_to_num(0.0) @ lay.full_v.float()  # a head seeing nothing: 0
            return out, lse
        out, lse = torch.empty(h, m, d), torch.empty(h, m)
        for head in range(h):  # attended entries differ per KV head: the known and the drawn ones
            idx = (fetched[head] | lay.drawn[head]).nonzero().squeeze(1)
            if idx.numel() == 0:  # nothing known or drawn (possible only without fetching): no weight
                out[head], lse[head] = 0.0, float("-inf")
                continue
            logits = (qf[head] @ lay.full_k[head, idx].float().T) * scale + mult[head][:, idx].log().float()
            lse[head] = logits.logsumexp(-1)
            out[head] = (logits - lse[head][:, None]).exp() @ lay.full_v[head, idx].float()
        return out, lse


def attention(jobs: list[tuple[Tensor, CertifiedPrefix, int]], scale: float) -> list[tuple[Tensor, Tensor]]:
    """The runtime's prefix-attention entry point (same contract as ``int8_attention.attention``)."""
    return [p.attend(q, li, scale) for q, p, li in jobs]
