"""Draft horizon L: fixed, or chosen each round from measurements.

``auto`` picks the L that maximizes the expected tokens per second of a round,

    E(L) / (L * t_draft + v(L)),   E(L) = 1 + a + a^2 + ... + a^L,

with ``a`` the measured per-token acceptance rate (accepted drafts over accept/reject trials),
``t_draft`` the measured draft step (from rounds without a swap once there is one) and
``v(L) = v0 + v1 * (L + 1)`` the verify forward's cost fitted to recent rounds: near-constant where
verifying is memory-bound (a GPU: L grows with acceptance), growing with L where it is
compute-bound (a CPU, where a verify block of many tokens costs several decode steps: L stays
short). The swap of the full prefix must hide behind drafting, so L >= L_min = ceil(T_swap /
t_draft) while rounds swap. Until two different L were verified, L doubles after a round that
accepted every draft and drops to about 1.5x the recent accepted run after a rejection. The
horizon only changes how many drafts are verified at once, never which tokens are emitted.

Where drafting does not pay (the draft step costs about a full step: short contexts, where the
weights dominate a step; a CPU whose verify blocks cost several full steps), ``plain_ok`` lets auto
choose L = 0: each round verifies the last token alone, i.e. plain full-KV decoding. The scheduler
sets it only with the full KV resident, where no round after the first swaps. The round after the
first drafting round without a swap (a swap slows the drafting it shares the CPU with, so rounds
beside it say little about drafting's rate) is plain: a plain step takes another attention path
than a verify block, so its cost is measured, not extrapolated from the verify fit; a trial is
``plain_trial`` rounds and their median decides (one slow step does not). From then on the
measured tokens/s of plain and drafting rounds decide (the mode in use stays unless the other
measured ``switch_margin`` faster), and each mode is re-measured now and then, so a change in
acceptance or costs is noticed at a bounded price: while plain wins, one drafting round once the
plain rounds have run ``probe_ratio`` times as long as the last drafting round took (none in a
short run); while drafting wins, a plain trial once drafting has run ``probe_ratio`` times as long
as a trial takes.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

DraftLen = int | str


def check_draft_len(draft_len: DraftLen, max_len: int) -> None:
    if draft_len == "auto":
        return
    if isinstance(draft_len, bool) or not isinstance(draft_len, int) or not 0 <= draft_len <= max_len:
        raise ValueError(f"draft_len must be an int in [0, {max_len}] or 'auto', got {draft_len!r}")


def _ema(old: float, new: float) -> float:
    return new if old == 0 else 0.5 * old + 0.5 * new


@dataclass
class Horizon:
    draft_len: DraftLen = 16
    max_len: int = 64
    start_len: int = 8
    plain_ok: bool = False
    probe_ratio: float = 16.0
    plain_trial: int = 4  # plain rounds per trial (their median decides): one slow step does not
    switch_margin: float = 1.05  # the other mode must measure this much faster to be chosen
    L: int = field(init=False)
    _acc: float = field(init=False, default=0.0)
    _step_s: float = field(init=False, default=0.0)
    _clean_step: bool = field(init=False, default=False)  # _step_s measured in a round without a swap
    _swap_s: float = field(init=False, default=0.0)
    _hits: float = field(init=False, default=0.0)  # decayed accept / reject counts
    _trials: float = field(init=False, default=0.0)
    _verifies: deque = field(init=False, default_factory=lambda: deque(maxlen=16))  # (tokens verified, s)
    _plain_chosen: bool = field(init=False, default=False)
    _mode_s: float = field(init=False, default=0.0)  # seconds in the current mode (plain or drafting)
    _trial_left: int = field(init=False, default=0)  # plain rounds before this trial may end
    _round_s: float = field(init=False, default=0.0)  # seconds of the last drafting round
    _plain_steps: deque = field(init=False)  # seconds of the last plain_trial plain rounds
    _draft_rate: float = field(init=False, default=0.0)  # measured tokens/s of drafting rounds
    _probe_len: int = field(init=False, default=0)  # the best L >= 1 when plain decoding was chosen

    def __post_init__(self) -> None:
        check_draft_len(self.draft_len, self.max_len)
        self.L = min(self.start_len, self.max_len) if self.draft_len == "auto" else int(self.draft_len)
        self._plain_steps = deque(maxlen=self.plain_trial)

    @property
    def l_min(self) -> int:
        if self._step_s <= 0 or self._swap_s <= 0:
            return 1
        return min(self.max_len, math.ceil(self._swap_s / self._step_s))

    def verify_cost(self) -> tuple[float, float] | None:
        """``(v0, v1)`` of ``v(L) = v0 + v1 * (L + 1)`` fitted over recent rounds (:func:`fit_verify`)."""
        return fit_verify(self._verifies)

    def update(self, drafted: int, accepted: int, draft_step_s: float, swap_s: float, verify_s: float = 0.0) -> None:
        """Record one round: ``accepted`` of ``drafted`` drafts, mean draft step, swap and verify seconds."""
        self.update_rounds([(drafted, accepted)], draft_step_s, swap_s, verify_s)

    def update_rounds(self, rounds: list[tuple[int, int]], draft_step_s: float, swap_s: float,
                      verify_s: float = 0.0) -> None:
        """Record rounds ``(drafted, accepted)`` that shared their forwards: in lock step one horizon
        serves the whole batch, whose requests draft together and verify in one forward (its
        ``verify_s``), so they all get the same L and none waits for a longer one."""
        if self.draft_len != "auto" or not rounds:
            return
        drafted = max(d for d, _ in rounds)
        if drafted == 0:  # a plain round (L = 0): its verify is one plain decode step, measured
            if verify_s > 0:
                self._plain_steps.append(verify_s)
                self._mode_s += verify_s
            self._trial_left -= 1
            if self.L == 0 and self._trial_left <= 0:
                self._plain_chosen = self._prefer_plain()
                if not self._plain_chosen or self._mode_s >= self.probe_ratio * self._round_s:
                    self._mode_s, self.L = 0.0, max(1, self._probe_len)  # plain lost, or re-measure drafting
            return
        rounds = [(d, a) for d, a in rounds if d > 0]
        mean_accepted = sum(a for _, a in rounds) / len(rounds)
        if verify_s > 0:
            self._verifies.append((drafted + 1, verify_s))
            if swap_s == 0:  # a swap shares the cores and memory bus with drafting: no rate evidence
                self._round_s = drafted * draft_step_s + verify_s
                self._draft_rate = _ema(self._draft_rate, (mean_accepted + 1) / self._round_s)
                self._mode_s += self._round_s
        self._acc = _ema(self._acc, mean_accepted)
        if draft_step_s > 0:  # steps beside a swap are slower: the first clean one replaces them
            if swap_s == 0 and not self._clean_step:
                self._step_s, self._clean_step = draft_step_s, True
            elif swap_s == 0 or not self._clean_step:
                self._step_s = _ema(self._step_s, draft_step_s)
        # The floor L >= swap / draft step holds while rounds swap (offload: every round). With the
        # full KV resident only the first round swaps (a stored prefix, once); keeping its floor
        # would hold every later round to a long L that a CPU's costly verify blocks do not repay.
        self._swap_s = _ema(self._swap_s, swap_s) if swap_s > 0 else 0.0
        # accepted drafts are successes; the first rejected one (if any) a failure
        self._hits = 0.8 * self._hits + sum(a for _, a in rounds)
        self._trials = 0.8 * self._trials + sum(a + (a < d) for d, a in rounds)
        cost = self.verify_cost()
        if cost is None or self._step_s <= 0:
            all_in = all(a == d for d, a in rounds)
            want = 2 * drafted if all_in else math.ceil(1.5 * self._acc) + 1
        else:
            want = self.best(self._hits / self._trials, self._step_s, *cost)
        L = max(self.l_min, min(self.max_len, want))
        if self.plain_ok and self._draft_rate > 0:
            # Plain decoding's cost is measured, not extrapolated from the verify fit (a 1-token
            # step takes another path than a verify block): a plain trial as soon as a drafting round
            # without a swap was measured, then once drafting has run probe_ratio times as long as a
            # trial takes; plain is chosen where the measured rates prefer it.
            first = self._plain_rate == 0
            self._plain_chosen = not first and self._prefer_plain()
            if first or self._plain_chosen or self._mode_s * self._plain_rate >= self.probe_ratio * self.plain_trial:
                self._trial_left = 0 if self._plain_chosen else self.plain_trial
                self._probe_len, self._mode_s, L = L, 0.0, 0
        self.L = L

    @property
    def _plain_rate(self) -> float:
        """Tokens/s of plain rounds: the median of the recent ones (the first plain steps after
        drafting rounds run slow), 0 before any."""
        return 1.0 / statistics.median(self._plain_steps) if self._plain_steps else 0.0

    def _prefer_plain(self) -> bool:
        """Whether the measured rates choose plain decoding; the mode chosen now stays unless the
        other measured ``switch_margin`` faster (without a margin, noise on a shared machine flips
        the modes every few rounds)."""
        if self._plain_chosen:
            return not self._draft_rate > self.switch_margin * self._plain_rate
        return self._plain_rate > self.switch_margin * self._draft_rate

    def best(self, a: float, t_draft: float, v0: float, v1: float) -> int:
        """The L in [1, max_len] with the most expected tokens per second of a round (0 if max_len is 0)."""
        if self.max_len < 1:
            return 0
        return max(range(1, self.max_len + 1), key=lambda L: rate(L, a, t_draft, v0, v1))


def fit_verify(points) -> tuple[float, float] | None:
    """``(v0, v1)`` of ``v = v0 + v1 * n`` by least squares over ``(tokens verified n, seconds v)``
    points, both clamped at 0, or ``None`` until two different block sizes were verified."""
    points = list(points)
    if len({n for n, _ in points}) < 2:
        return None
    k = len(points)
    mx = sum(n for n, _ in points) / k
    my = sum(v for _, v in points) / k
    var = sum((n - mx) ** 2 for n, _ in points)
    v1 = max(0.0, sum((n - mx) * (v - my) for n, v in points) / var)
    return max(0.0, my - v1 * mx), v1


def rate(L: int, a: float, t_draft: float, v0: float, v1: float) -> float:
    """Expected tokens per second of a round of ``L`` drafts: ``E(L) / (L t_draft + v0 + v1 (L + 1))``."""
    expected = L + 1 if a >= 1 else (1 - a ** (L + 1)) / (1 - a)
    return expected / (L * t_draft + v0 + v1 * (L + 1))
