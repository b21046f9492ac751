"""Prompt lookup (n-gram) proposer: a free first stage in front of the compressed-KV drafter.

Saxena, "Prompt Lookup Decoding" (2023): find the most recent earlier occurrence of the last ``n``
tokens and propose the tokens that followed it. Code and long documents repeat themselves, so this
often proposes many right tokens for no model cost; the drafter checks them in one forward over the
compressed cache (with the same acceptance rule the verifier uses), and the full KV verifies what
survives.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposer:
    max_ngram: int = 3
    min_ngram: int = 1
    num_tokens: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``min(limit, num_tokens)`` tokens continuing ``tokens``; longest n-gram match wins,
        the most recent occurrence first."""
        limit = min(limit, self.num_tokens)
        if limit <= 0:
            return []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            # Scan backwards, skipping the tail itself.
            for s in range(len(tokens) - n - 1, -1, -1):
                if tokens[s:s + n] == tail:
                    return tokens[s + n:s + n + limit]
        return []
