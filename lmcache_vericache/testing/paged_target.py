"""vLLM's side of a proposer test without vLLM: one request's full KV, computed by the package's
runtime and written into a paged cache at its blocks' slots as vLLM's cache-write would, with the
model's own greedy continuation as the oracle for drafts over an exact (``none``) draft cache."""

from __future__ import annotations

import torch

from ..connectors import paged_layout as pl
from ..engine import Runtime, Segment


class PagedTarget:
    """A request of ``prompt`` at vLLM blocks ``blocks`` (ids of ``block_size`` tokens) of the paged
    caches behind ``layout`` (a ``kv_layout`` strategy: ``scatter(slots, k, v)``), on the runtime's
    device. Its tokens end with the greedy next token, as vLLM's would before a draft step."""

    def __init__(self, rt: Runtime, layout, blocks: list[int], prompt: list[int], block_size: int,
                 capacity: int = 4096):
        self.rt, self.layout, self.block_size = rt, layout, block_size
        self.blocks = list(blocks)
        self.full = rt.new_cache(capacity)
        self.tokens = list(prompt)
        self._compute(0)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, device=self.rt.device)

    def _compute(self, start: int) -> None:
        """The full KV of ``tokens[start:]``, written to the paged cache; the greedy next token appended."""
        n = len(self.tokens) - start
        logits, _ = self.rt.forward(self._tensor(self.tokens[start:]), torch.arange(start, start + n, device=self.rt.device),
                                    [Segment(self.full, n)])
        self.write(start, start + n)
        self.tokens.append(int(logits[-1].argmax()))

    def write(self, start: int, stop: int) -> None:
        """Tokens ``[start, stop)`` of the full cache into the paged cache at this request's slots."""
        slots = pl.slots_for(torch.tensor(self.blocks), start, stop, self.block_size)
        self.layout.scatter(slots, self.full.k[:, :, start:stop], self.full.v[:, :, start:stop])

    def greedy(self, n: int) -> list[int]:
        """The next ``n`` greedy tokens after ``tokens`` (nothing committed)."""
        c, out, tok = self.full, [], self.tokens[-1]
        saved = c.n
        for _ in range(n):
            logits, _ = self.rt.forward(self._tensor([tok]), self._tensor([c.n]), [Segment(c, 1)])
            tok = int(logits[0].argmax())
            out.append(tok)
        c.n = saved
        return out

    def accept(self, m: int) -> None:
        """Commit ``m`` accepted drafts and vLLM's bonus token (what vLLM does after verification)."""
        start = self.full.n
        self.tokens += self.greedy(m)
        self._compute(start)

    def move(self, blocks: list[int]) -> None:
        """vLLM swapped the request out and in again at other blocks."""
        self.blocks = list(blocks)
        self.write(0, self.full.n)
