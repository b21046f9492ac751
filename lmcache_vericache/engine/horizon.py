"""Draft horizon L: fixed, or chosen each round from measurements.

``auto`` picks the L that maximizes the expected tokens per second of a round,

    E(L) / (L * t_draft + v(L + 1)),   E(L) = 1 + a + a^2 + ... + a^L,

with ``a`` the measured per-token acceptance rate (accepted drafts over accept/reject trials, one of
each added: :attr:`Horizon.acceptance`),
``t_draft`` the measured draft step (from rounds without a swap once there is one) and ``v(n)`` the
verify forward of ``n`` tokens, from the seconds measured per block size (:func:`predict`: the
fastest of the last few verifies of that size, as noise only adds time; between two measured sizes
the line between those two only; above them the line through the largest two, never falling with
more tokens; below them the smallest one's cost, as a block's rows pad to whole vectors). Not one line fitted
across sizes: on a CPU a verify block is compute-bound and its cost can switch paths with its size (AMX
tiles from 10 tokens), so a line fitted over short blocks misprices long ones. The swap of the full
prefix must hide behind drafting, so L >= L_min = ceil(T_swap / t_draft) while rounds swap. Until two
block sizes were verified, L starts at ``start_len`` (4), doubles after a round that accepted every
draft and drops to about 1.5x the recent accepted run after a rejection (a first round that drafted
on past its L while its stored prefix arrived, :meth:`~.rounds.Rounds.draft_while_swapping`, grows
from the L chosen, not from what it drafted). With the full KV resident (no swap floor) a round
beside a stored prefix's swap measures no verify cost (its verify reads a cache just written: 20-30%
slower at 8k / batch 8); where nothing was measured yet the next round runs the same L again,
measured (after a rejection too). These first rounds are
what the horizon pays to learn, wasted where drafting does not pay, so they are short: starting at 8
(8 then 16 drafts before the first plain trial) lost 17% at 1k / batch 1 in bf16 and 5% at 2k /
batch 8; at 4, 2% and none (AMX host, 64 tokens; 8k / batch 8 unchanged within noise, 1.32x against
1.33x over 5 runs). The horizon only changes how many drafts are verified at once, never which tokens
are emitted.

Exploration: the model is only as good as its measured sizes, so the L it prefers must be bracketed
by fresh measurements. Where the preferred L was measured but no size above it was measured in the
last ``stale_rounds`` drafting rounds, the next round explores 2L (capped by ``max_len``); where none
below it was, L // 2 (not under L_min); the measurement then decides. An unmeasured preferred L is
simply chosen (measuring it is the exploration). Exploring rounds are at most ``1 + explore_share``
of the drafting rounds, so a stale model is re-measured at a bounded price and a short run still
gets one look beyond its first sizes.

Where drafting does not pay (the draft step costs about a full step: short contexts, where the
weights dominate a step; a CPU whose verify blocks cost several full steps), ``plain_ok`` lets auto
choose L = 0: each round verifies the last token alone, i.e. plain full-KV decoding. The scheduler
sets it only with the full KV resident, where no round after the first swaps. The round after the
first drafting round without a swap (a swap slows the drafting it shares the CPU with, so rounds
beside it say little about drafting's rate) is plain: a plain step takes another attention path
than a verify block, so its cost is measured, not extrapolated from verify blocks; a trial is
``plain_trial`` rounds and their median decides (one slow step does not), unless drafting is
``settle_margin`` (1.25x) faster than even the faster of its own first two rounds: then drafting is
chosen at once (a first plain step after drafting rounds runs up to ~15% slow, and one slow step must
not decide, hence two and the margin; at 8k / batch 8 the 2 rounds saved per trial are 1-2% of a
128-token run). In the first trial drafting's rate there is the larger of the one clean round's
measured rate and the rate the cost model gives at a block size actually verified (the measured
step and verify, none beside the swap, and the acceptance rate):
that round is one sample of acceptance, and its rejections (8k / batch 8, every row of one run:
under 10 tok/s, against ~11.5 in the later rounds) had run all four trial rounds. From then on the
measured tokens/s of plain and drafting rounds decide (the mode in use stays unless the other
measured ``switch_margin`` faster), and each mode is re-measured now and then, so a change in
acceptance or costs is noticed at a bounded price: while plain wins, one drafting round once the
plain rounds have run ``probe_ratio`` times as long as the last drafting round took (none in a
short run), ``close_probe`` (a quarter) of that where plain measured under ``settle_margin`` faster
than drafting: a few slow drafting rounds (a slow phase of a shared machine: in `_s8b`'s sampled
int8 row at 8k / batch 8, L = 4 rounds went from 0.36-0.37 s to 0.39-0.50 s) flip the mode to plain
on a close call, and re-checked only after 16 rounds' time, plain ran 52 rounds (6.3 s of a ~12 s run);
a probe is one round at drafting's measured rate, at worst 1 / settle_margin of plain's, so the
quarter costs under 5% where plain truly wins by a little. While drafting wins, a plain trial once drafting has run ``probe_ratio`` times as long
as a trial takes, times ``2^k`` (at most ``max_probe_scale``) after ``k`` trials in a row that settled
at once. Plain steps cost the same from one trial to the next; what changes is drafting's rate, and
that is measured every round: while it stays ``settle_margin`` above plain's, a trial every ~8 s
(8k / batch 8) re-measured nothing new, each trial ~0.1 s slower than drafting (5 in a 512-token
run). The stretch holds while drafting's rate since the last trial (its tokens over its seconds: one
round with rejections or an exploring round among many does not undo it) stays ``settle_margin``
above plain's; under that the usual interval applies (a trial at once where it has passed).

What is measured is what the caller passes (:class:`~.rounds.Rounds`): draft steps only from
forwards without verify rows and verifies only from forwards without draft rows (a staggered forward
can carry both), the round's seconds (``round_s``) from all of its forwards. Each round is kept in
:attr:`Horizon.record` (L, predicted and measured seconds).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

DraftLen = int | str
# Verifies kept per block size; the fastest is its cost. A shared machine's noise only adds time, and
# a round's first verify after the prefix swap reads a cache just written (8k / batch 8: 0.20-0.26 s
# against 0.17-0.20 later). With the median, two samples of 0.26 and 0.19 s (rounds' seconds less
# their draft steps) priced a 5-token verify at 0.225 s, and a run kept L = 3 for ~18 rounds, until
# its next plain trial (11.5 tok/s per request against L = 4's 12.0). The fastest of more samples is
# lower: the L in use (up to KEEP samples) is favoured a little over a size measured once, the
# model's rates (the first trial's, ``predicted_s``) lean optimistic by about the noise of one sample.
KEEP = 3


def check_draft_len(draft_len: DraftLen, max_len: int) -> None:
    if draft_len == "auto":
        return
    if isinstance(draft_len, bool) or not isinstance(draft_len, int) or not 0 <= draft_len <= max_len:
        raise ValueError(f"draft_len must be an int in [0, {max_len}] or 'auto', got {draft_len!r}")


def _ema(old: float, new: float) -> float:
    return new if old == 0 else 0.5 * old + 0.5 * new


@dataclass
class RoundRecord:
    """One round as its horizon saw it: ``L`` drafts (0: plain), the seconds predicted when L was
    chosen (``L t_draft + v(L + 1)``, a plain round: the median plain step; ``None`` before there
    was a cost model, and for a round that drafted fewer than chosen: cut by the tokens left, an EOS
    or a staggered first round), the seconds measured (the round's draft and verify forwards) and
    whether it explored (an L chosen to measure it, not the model's best)."""

    L: int
    predicted_s: float | None
    measured_s: float
    explore: bool = False


@dataclass
class Horizon:
    """The draft length ``L`` of a staggered request, or of a lock-step batch (the module's docstring)."""

    draft_len: DraftLen = 16
    max_len: int = 64
    start_len: int = 4  # the first round's L (the module's docstring: why short)
    plain_ok: bool = False
    swap_floor: bool = True  # a round's swap floors the next L (offload: every round swaps; resident: only the first)
    probe_ratio: float = 16.0
    close_probe: float = 0.25  # while plain wins by less than settle_margin, drafting is re-probed this much sooner
    max_probe_scale: float = 8.0  # trials that settle at once stretch the time to the next up to this much
    plain_trial: int = 4  # plain rounds per trial (their median decides): one slow step does not
    switch_margin: float = 1.05  # the other mode must measure this much faster to be chosen
    settle_margin: float = 1.25  # a trial ends after two plain rounds where drafting measured this much faster
    explore_share: float = 0.125  # exploring rounds: at most 1 + this share of the drafting rounds
    stale_rounds: int = 32  # a block size not verified for this many drafting rounds no longer brackets L
    L: int = field(init=False)
    record: deque[RoundRecord] = field(init=False, default_factory=lambda: deque(maxlen=4096))  # per round
    _acc: float = field(init=False, default=0.0)
    _step_s: float = field(init=False, default=0.0)
    _clean_step: bool = field(init=False, default=False)  # _step_s measured in a round without a swap
    _swap_s: float = field(init=False, default=0.0)
    _hits: float = field(init=False, default=0.0)  # decayed accept / reject counts
    _trials: float = field(init=False, default=0.0)
    _verify: dict = field(init=False, default_factory=dict)  # tokens verified n -> its last KEEP seconds
    _verified_at: dict = field(init=False, default_factory=dict)  # n -> drafting round it was last verified in
    _drafting: int = field(init=False, default=0)  # drafting rounds so far
    _explored: int = field(init=False, default=0)  # of them, exploring
    _chosen: tuple = field(init=False)  # (L, predicted seconds, explore) of the round now running
    _plain_chosen: bool = field(init=False, default=False)
    _mode_s: float = field(init=False, default=0.0)  # seconds in the current mode (plain or drafting)
    _trial_left: int = field(init=False, default=0)  # plain rounds before this trial may end
    _trial_steps: list = field(init=False, default_factory=list)  # this trial's measured plain steps
    _round_s: float = field(init=False, default=0.0)  # seconds of the last drafting round
    _plain_steps: deque = field(init=False)  # seconds of the last plain_trial plain rounds
    _draft_rate: float = field(init=False, default=0.0)  # measured tokens/s of drafting rounds
    _clean_rounds: int = field(init=False, default=0)  # drafting rounds in _draft_rate (none beside a swap)
    _probe_len: int = field(init=False, default=0)  # the best L >= 1 when plain decoding was chosen
    _probe_scale: float = field(init=False, default=1.0)  # drafting runs probe_ratio x this before a trial
    _mode_tokens: float = field(init=False, default=0.0)  # tokens per request of _mode_s's drafting rounds

    def __post_init__(self) -> None:
        check_draft_len(self.draft_len, self.max_len)
        self.L = min(self.start_len, self.max_len) if self.draft_len == "auto" else int(self.draft_len)
        self._plain_steps = deque(maxlen=self.plain_trial)
        self._chosen = (self.L, None, False)

    @property
    def l_min(self) -> int:
        if self._step_s <= 0 or self._swap_s <= 0:
            return 1
        return min(self.max_len, math.ceil(self._swap_s / self._step_s))

    def verify_s(self, n: int) -> float | None:
        """Predicted seconds of an ``n``-token verify (:func:`predict` over the measured block sizes:
        the fastest of each size's last ``KEEP``); ``None`` for an unmeasured size until two were."""
        return predict(self._costs(), n)

    def _costs(self) -> dict[int, float]:
        return {n: min(v) for n, v in self._verify.items()}

    def round_s(self, L: int) -> float | None:
        """Predicted seconds of a round of ``L`` drafts: ``L t_draft + v(L + 1)``; a plain round (L = 0)
        the median plain step; ``None`` where that is not measured yet."""
        if L == 0:
            return statistics.median(self._plain_steps) if self._plain_steps else None
        v = self.verify_s(L + 1)
        return None if v is None or self._step_s <= 0 else L * self._step_s + v

    def update(self, drafted: int, accepted: int, draft_step_s: float, swap_s: float, verify_s: float = 0.0,
               round_s: float | None = None) -> None:
        """Record one round: ``accepted`` of ``drafted`` drafts, mean draft step, swap and verify
        seconds (0: not measured), the round's seconds (default ``drafted * draft_step_s + verify_s``)."""
        self.update_rounds([(drafted, accepted)], draft_step_s, swap_s, verify_s, round_s)

    def update_rounds(self, rounds: list[tuple[int, int]], draft_step_s: float, swap_s: float,
                      verify_s: float = 0.0, round_s: float | None = None) -> None:
        """Record rounds ``(drafted, accepted)`` that shared their forwards: in lock step one horizon
        serves the whole batch, whose requests draft together and verify in one forward (its
        ``verify_s``), so they all get the same L and none waits for a longer one."""
        if not rounds:
            return
        drafted = max(d for d, _ in rounds)
        round_s = drafted * draft_step_s + verify_s if round_s is None else round_s
        if round_s > 0:
            L, predicted, explore = self._chosen
            self.record.append(RoundRecord(drafted, predicted if drafted == L else None, round_s, explore))
        if self.draft_len != "auto":
            return
        if drafted == 0:  # a plain round (L = 0): its verify is one plain decode step, measured
            if verify_s > 0:
                self._plain_steps.append(verify_s)
                self._trial_steps.append(verify_s)
                self._mode_s += verify_s
            self._trial_left -= 1
            # this trial's own first two plain steps (none of an earlier trial's) both far slower than drafting
            settled = (self.L == 0 and not self._plain_chosen and len(self._trial_steps) == 2
                       and self._trial_rate() * min(self._trial_steps) > self.settle_margin)
            if self.L == 0 and (settled or self._trial_left <= 0):
                self._plain_chosen = False if settled else self._prefer_plain()
                # a trial that settled at once (drafting settle_margin faster) doubles the time to the next
                self._probe_scale = min(self.max_probe_scale, 2 * self._probe_scale) if settled else 1.0
                # a close call (plain under settle_margin faster: a few slow drafting rounds can make
                # it) is re-checked sooner
                close = self._plain_rate < self.settle_margin * self._draft_rate
                probe_s = self.probe_ratio * self._round_s * (self.close_probe if close else 1.0)
                if not self._plain_chosen or self._mode_s >= probe_s:
                    self._mode_s = self._mode_tokens = 0.0  # plain lost, or re-measure drafting
                    self._choose(max(1, self._probe_len))
                    return
            self._choose(self.L)
            return
        rounds = [(d, a) for d, a in rounds if d > 0]
        mean_accepted = sum(a for _, a in rounds) / len(rounds)
        self._drafting += 1
        # With the full KV resident only a stored prefix's first round swaps, and its verify reads a
        # cache the swap has just written (8k / batch 8: 0.20-0.26 s for 5 tokens against 0.17-0.20
        # later): not that size's cost. Kept, it priced 5 tokens high until 5 was run again, which
        # nothing made happen: a sampled row ran L = 9 to its end (11.6 tok/s per request at its step
        # costs) where L = 4 gives 12.8. The next round runs the same L without the swap instead.
        first_swap = swap_s > 0 and not self.swap_floor
        if verify_s > 0 and not first_swap:
            self._verify.setdefault(drafted + 1, deque(maxlen=KEEP)).append(verify_s)
            self._verified_at[drafted + 1] = self._drafting
        if round_s > 0 and swap_s == 0:  # a swap shares the cores and memory bus with drafting: no rate evidence
            self._round_s = round_s
            self._draft_rate = _ema(self._draft_rate, (mean_accepted + 1) / round_s)
            self._clean_rounds += 1
            self._mode_s += round_s
            self._mode_tokens += mean_accepted + 1
        self._acc = _ema(self._acc, mean_accepted)
        if draft_step_s > 0:  # steps beside a swap are slower: the first clean one replaces them
            if swap_s == 0 and not self._clean_step:
                self._step_s, self._clean_step = draft_step_s, True
            elif swap_s == 0 or not self._clean_step:
                self._step_s = _ema(self._step_s, draft_step_s)
        # The floor L >= swap / draft step holds while rounds swap (offload: every round). With the
        # full KV resident only the first round swaps (a stored prefix, once): its floor would hold
        # the next round to a long L (4k, batch 1: 45 drafts where plain decoding wins) and, kept,
        # every later round, which a CPU's costly verify blocks do not repay.
        self._swap_s = _ema(self._swap_s, swap_s) if swap_s > 0 and self.swap_floor else 0.0
        # accepted drafts are successes; the first rejected one (if any) a failure
        self._hits = 0.8 * self._hits + sum(a for _, a in rounds)
        self._trials = 0.8 * self._trials + sum(a + (a < d) for d, a in rounds)
        if len(self._verify) < 2 or self._step_s <= 0:
            all_in = all(a == d for d, a in rounds)
            want = 2 * drafted if all_in else math.ceil(1.5 * self._acc) + 1
            chosen = self._chosen[0]
            if drafted > chosen > 0:  # drafted on past its L while a swap was arriving: grow from the L chosen
                want = min(want, 2 * chosen)  # (resident; the next line decides unless a size was measured)
            if first_swap and not self._verify and chosen > 0:  # its verify unmeasured: the same L, measured
                want = chosen
            L = L_best = max(self.l_min, min(self.max_len, want))
        else:
            costs = self._costs()
            L_best = best(self.acceptance, self._step_s, lambda n: predict(costs, n),
                          self.l_min, self.max_len)
            L = self._explore(L_best)
        if self.plain_ok and self._draft_rate > 0:
            # Plain decoding's cost is measured, not extrapolated from verify blocks (a 1-token step
            # takes another path than a verify block): a plain trial as soon as a drafting round
            # without a swap was measured, then once drafting has run probe_ratio times as long as a
            # trial takes (stretched after trials that settled at once); plain is chosen where the
            # measured rates prefer it.
            first = self._plain_rate == 0
            self._plain_chosen = not first and self._prefer_plain()
            # drafting's rate since the last trial (tokens over seconds) settle_margin above plain's
            far_ahead = self._mode_tokens >= self.settle_margin * self._plain_rate * self._mode_s
            stretch = self._probe_scale if far_ahead else 1.0
            trial_due = self._mode_s * self._plain_rate >= self.probe_ratio * self.plain_trial * stretch
            if first or self._plain_chosen or trial_due:
                self._trial_left = 0 if self._plain_chosen else self.plain_trial
                self._trial_steps = []
                self._probe_len, self._mode_s, self._mode_tokens, L = L_best, 0.0, 0.0, 0
        if L != L_best and L > 0:
            self._explored += 1
        self._choose(L, explore=L != L_best and L > 0)

    @property
    def acceptance(self) -> float:
        """Per-token acceptance from the decayed accept / reject counts, with one of each added (the
        rule of succession): a few rounds that accepted every draft measure a = 1, and at a = 1 every
        longer round looks better where verify costs are flat (batch 1: 45 drafts chosen at 8k, most
        rejected); ``0.5`` before any trial."""
        return (self._hits + 1) / (self._trials + 2)

    def _choose(self, L: int, explore: bool = False) -> None:
        self.L, self._chosen = L, (L, self.round_s(L), explore)

    def _explore(self, L: int) -> int:
        """The L to run: ``L`` (the model's best), or a block size beyond the fresh measurements
        around it (the module's docstring says when, and why)."""
        if L + 1 not in self._verify or self._explored >= 1 + self.explore_share * self._drafting:
            return L
        fresh = [n - 1 for n, at in self._verified_at.items() if self._drafting - at < self.stale_rounds]
        if L < self.max_len and not any(k > L for k in fresh):
            return min(self.max_len, 2 * L)
        if L > self.l_min and not any(k < L for k in fresh):
            return max(self.l_min, L // 2)
        return L

    @property
    def _plain_rate(self) -> float:
        """Tokens/s of plain rounds: the median of the recent ones (the first plain steps after
        drafting rounds run slow), 0 before any."""
        return 1.0 / statistics.median(self._plain_steps) if self._plain_steps else 0.0

    def _trial_rate(self) -> float:
        """Drafting's rate a trial settles on: the measured one, or, while that rests on one clean
        round (the first trial), the larger of it and :meth:`_model_rate`."""
        return self._draft_rate if self._clean_rounds > 1 else max(self._draft_rate, self._model_rate())

    def _model_rate(self) -> float:
        """Expected tokens/s of the best block size verified so far (measured costs, no
        extrapolation: :func:`rate` at its cost, the fastest of its recent verifies), 0 before a
        clean draft step."""
        if not self._clean_step:
            return 0.0
        costs = self._costs()
        return max((rate(n - 1, self.acceptance, self._step_s, costs[n]) for n in costs if n > 1), default=0.0)

    def _prefer_plain(self) -> bool:
        """Whether the measured rates choose plain decoding; the mode chosen now stays unless the
        other measured ``switch_margin`` faster (without a margin, noise on a shared machine flips
        the modes every few rounds)."""
        if self._plain_chosen:
            return not self._draft_rate > self.switch_margin * self._plain_rate
        return self._plain_rate > self.switch_margin * self._draft_rate


def predict(costs: Mapping[int, float], n: int) -> float | None:
    """Cost of an ``n``-token verify from measured ``costs`` per block size: a measured size's own;
    between two measured sizes the line between those two only (a global fit would carry one
    attention path's slope across a switch to another); above them the line through the largest
    two, its slope clamped at >= 0; below them the smallest one's cost. ``None`` for an unmeasured
    size with fewer than two measured.

    Below the measured sizes a block is priced as the smallest measured one, not by a line: on a CPU
    a verify pads its query rows to whole vectors, so its cost is flat across the sizes that fit one
    vector (8k / batch 8 bf16: 2 tokens 0.15-0.21 s, 5 tokens 0.17-0.20 s), and the line through 5
    and 8-9 tokens priced 2 tokens at 0.07-0.08 s and bought a 1-draft round that ran at two thirds of
    L = 4's rate. Where smaller blocks are really cheaper, exploration (:meth:`Horizon._explore`)
    measures one."""
    if n in costs:
        return costs[n]
    if len(costs) < 2:
        return None
    ks = sorted(costs)
    if n < ks[0]:
        return costs[ks[0]]
    i = bisect.bisect(ks, n)
    lo, hi = ks[min(i - 1, len(ks) - 2)], ks[min(i, len(ks) - 1)]
    slope = (costs[hi] - costs[lo]) / (hi - lo)
    if n < hi:
        return costs[lo] + slope * (n - lo)
    return costs[hi] + max(0.0, slope) * (n - hi)  # above the measured sizes: from the largest one


def best(a: float, t_draft: float, verify: Callable[[int], float], lo: int, hi: int) -> int:
    """The L in [max(1, lo), hi] with the most expected tokens per second of a round (:func:`rate`),
    ``verify(n)`` the cost of an ``n``-token verify; 0 if ``hi`` < 1."""
    if hi < 1:
        return 0
    return max(range(max(1, lo), hi + 1), key=lambda L: rate(L, a, t_draft, verify(L + 1)))


def rate(L: int, a: float, t_draft: float, verify: float) -> float:
    """Expected tokens per second of a round of ``L`` drafts and a ``verify``-second verify of L + 1
    tokens: ``E(L) / (L t_draft + verify)``."""
    expected = L + 1 if a >= 1 else (1 - a ** (L + 1)) / (1 - a)
    return expected / (L * t_draft + verify)
