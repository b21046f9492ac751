"""Draft horizon L: fixed, or sized each round from measurements.

``auto``: the swap of the full prefix must hide behind drafting, so L >= L_min = ceil(T_swap /
t_draft_step); above that, L follows acceptance: it doubles after a round that accepted every draft
and drops to about 1.5x the recent accepted run after a rejection (drafting past the likely first
mismatch is wasted work). The horizon only changes how many drafts are verified at once, never which
tokens are emitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DraftLen = int | str


def check_draft_len(draft_len: DraftLen, max_len: int) -> None:
    if draft_len == "auto":
        return
    if isinstance(draft_len, bool) or not isinstance(draft_len, int) or not 0 <= draft_len <= max_len:
        raise ValueError(f"draft_len must be an int in [0, {max_len}] or 'auto', got {draft_len!r}")


@dataclass
class Horizon:
    draft_len: DraftLen = 16
    max_len: int = 64
    start_len: int = 8
    L: int = field(init=False)
    _acc: float = field(init=False, default=0.0)
    _step_s: float = field(init=False, default=0.0)
    _swap_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        check_draft_len(self.draft_len, self.max_len)
        self.L = self.start_len if self.draft_len == "auto" else int(self.draft_len)

    @property
    def l_min(self) -> int:
        if self._step_s <= 0 or self._swap_s <= 0:
            return 1
        return min(self.max_len, math.ceil(self._swap_s / self._step_s))

    def update(self, drafted: int, accepted: int, draft_step_s: float, swap_s: float) -> None:
        """Record one round: ``accepted`` of ``drafted`` drafts, mean draft step and swap seconds."""
        if self.draft_len != "auto" or drafted == 0:
            return
        ema = lambda old, new: new if old == 0 else 0.5 * old + 0.5 * new  # noqa: E731
        self._acc = ema(self._acc, accepted)
        if draft_step_s > 0:
            self._step_s = ema(self._step_s, draft_step_s)
        if swap_s > 0:
            self._swap_s = ema(self._swap_s, swap_s)
        if accepted == drafted:
            want = 2 * drafted
        else:
            want = math.ceil(1.5 * self._acc) + 1
        self.L = max(self.l_min, min(self.max_len, want))
