"""Sampling settings and the acceptance rule shared by every draft/verify level.

Greedy: accept drafts while they equal the target's argmax; the first mismatch is replaced by the
target's token, and if all match the target's next token is a bonus. Sampling (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding"): accept draft x with probability
min(1, p(x)/q(x)); on rejection sample from normalize(max(0, p - q)); on full acceptance sample the
bonus from p. Temperature / top-k / top-p are applied identically to p and q, so emitted tokens follow
the processed full-KV distribution exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import token_ops

Tensor = torch.Tensor


def draw(weights: Tensor, gen: torch.Generator | None) -> int:
    """One index drawn from ``weights [V]`` (non-negative, any positive total) in proportion to
    them: the inverse CDF at one uniform, summed in float64 (``kernels/token_ops.cpp`` on a CPU:
    block sums, then one block's running sum; ``torch.cumsum`` elsewhere). The distribution
    ``torch.multinomial`` draws (to float64's resolution; it uses the generator's stream
    differently, so seeded samples differ from it), at a fraction of its cost on a CPU (it draws one
    random variate per entry: ~1 ms for SmolLM2's 49,152 entries, the kernel ~0.01 ms), which every
    sampled token pays once or twice. An entry of weight 0 is never drawn: the first index whose
    running sum exceeds ``u`` has a positive weight."""
    # u <= 1 - 2**-53, so u * total rounds below total: some running sum exceeds it, i < V
    u = float(torch.rand((), dtype=torch.float64, generator=gen))
    i = token_ops.draw_index(weights, u)
    if i is not None and i >= 0:
        return i
    # no kernel here, or weights it refused (-1): PyTorch's path, which says what is wrong
    cdf = weights.double().cumsum(0)
    total = float(cdf[-1])
    if not (total > 0 and math.isfinite(total)) or float(weights.min()) < 0:
        raise ValueError(f"cannot draw from weights summing to {total} (all must be finite and >= 0)")
    return int(torch.searchsorted(cdf, u * total, right=True))


def host(t: Tensor) -> Tensor:
    """``t`` on the host: the engine's one way to read a device tensor (a sync on an accelerator;
    nothing on a CPU). The engine's loop calls it once per forward's logits, not once per token."""
    return t.cpu()


@dataclass(frozen=True)
class Sampling:
    """``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """Processed distribution ``[..., V]`` (float32) of ``logits``."""
        if not self.top_k and self.top_p == 1:
            return token_ops.softmax(logits.float(), self.temperature)
        x = logits.float() / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = x.topk(self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1:
            srt, idx = x.sort(dim=-1, descending=True)
            cum = srt.softmax(-1).cumsum(-1)
            drop = cum - srt.softmax(-1) >= self.top_p  # keep the smallest prefix reaching top_p
            x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
        return x.softmax(-1)

    def pick(self, logits: Tensor, gen: torch.Generator | None) -> tuple[int, Tensor | None]:
        """One token from ``logits [V]``; with sampling also its distribution (the q to record)."""
        if self.greedy:
            return int(host(logits.argmax())), None
        p = self.probs(host(logits.float()))  # sampling runs on the CPU, where the generators live
        return draw(p, gen), p


def accept(drafts: list[int], q: list[Tensor] | None, target_logits: Tensor, sampling: Sampling,
           gen: torch.Generator | None, target: list[int] | None = None) -> tuple[int, int]:
    """Verify ``drafts`` (L tokens, proposal distributions ``q``) against ``target_logits [L+1, V]``
    (row i predicts the token after draft i-1). Returns ``(n_accepted, next_token)``: the emitted
    tokens are ``drafts[:n_accepted] + [next_token]``. Greedy: ``target``, the rows' argmax already
    read to the host, if the caller has it."""
    n = len(drafts)
    if target_logits.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} target rows for {n} drafts, got {target_logits.shape[0]}")
    if sampling.greedy:
        target = host(target_logits.argmax(-1)).tolist() if target is None else target
        k = 0
        while k < n and drafts[k] == target[k]:
            k += 1
        return k, target[k]
    if q is None or len(q) != n:
        raise ValueError("sampling verification needs the draft distribution of every draft")
    # On the CPU, like the per-request generators and the recorded q (see Sampling.pick).
    p = sampling.probs(host(target_logits.float()))
    q = [host(qi) for qi in q]
    for i, x in enumerate(drafts):
        px, qx = float(p[i, x]), float(q[i][x])
        # u < p/q  <=>  u*q < p; qx > 0 always holds for a token sampled from q.
        if float(torch.rand((), generator=gen)) * qx < px:
            continue
        residual = (p[i] - q[i]).clamp_min_(0)
        # A zero residual only if p == q (then rejection has probability 0); guard float round-off.
        return i, draw(residual if float(residual.sum()) > 0 else p[i], gen)
    return n, draw(p[n], gen)
