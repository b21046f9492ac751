"""The proposer's step horizon: one adaptivity mechanism, fed the step costs measured between
``propose`` calls (a fake clock stands in for vLLM's forwards), choosing 0 where drafting does not pay."""

import pytest

from lmcache_vericache.connectors.draft_states import StepHorizon, may_pay


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run(steps: int, draft_step: float, verify, plain: float, run_len: int, batch: int = 4) -> list[int]:
    """Drive a StepHorizon through ``steps`` vLLM steps: a step after L drafts verifies L + 1 tokens in
    ``verify(L)`` seconds and accepts the first ``run_len`` drafts; a plain step takes ``plain``.
    Returns each step's L."""
    clock = Clock()
    h = StepHorizon(8, adaptive=True, clock=clock)
    lengths, last_L, chosen = [1000] * batch, 0, []
    for _ in range(steps):
        emitted = 1 + min(last_L, run_len)
        clock.t += verify(last_L) if last_L else plain
        lengths = [n + emitted for n in lengths]
        h.begin(lengths, [(last_L, emitted - 1)] * batch if last_L else [])
        L = h.L
        chosen.append(L)
        clock.t += L * draft_step
        h.end(L, L * draft_step)
        last_L = L
    return chosen


def test_drafting_that_pays_keeps_drafting():
    # a draft step 30% of a plain step, verifies about as cheap as a plain step, 12 drafts in a row accepted
    chosen = run(120, draft_step=0.03, verify=lambda L: 0.1 + 0.005 * L, plain=0.1, run_len=12)
    assert sum(L > 0 for L in chosen[40:]) > 0.9 * len(chosen[40:])
    assert max(chosen) >= 4


def test_drafting_that_does_not_pay_goes_plain():
    # a draft step costs a plain step (weights dominate) and the third draft is always rejected
    chosen = run(200, draft_step=0.1, verify=lambda L: 0.1 + 0.02 * L, plain=0.1, run_len=2)
    late = chosen[60:]
    assert sum(L == 0 for L in late) > 0.85 * len(late)  # plain, re-probed now and then


def test_batch_changes_are_no_samples():
    clock = Clock()
    h = StepHorizon(8, adaptive=True, clock=clock)
    h.begin([100, 200], [])
    h.end(4, 0.04)
    clock.t += 5.0  # a prefill of a new request joined this step: not a verify of 5 tokens
    h.begin([105, 205, 3000], [(4, 4), (4, 4)])
    assert not h.verify_step_s and not h.horizon._verify


def test_not_adaptive_always_drafts_max():
    clock = Clock()
    h = StepHorizon(6, adaptive=False, clock=clock)
    lengths = [500]
    for _ in range(20):
        clock.t += 1.0
        lengths = [lengths[0] + 1]
        h.begin(lengths, [(6, 0)])
        assert h.L == 6
        h.end(6, 10.0)


@pytest.mark.parametrize("weights,kv,ratio,pays", [
    (270e6, 1.5e9, 0.52, True),  # SmolLM2 bf16, 8k x 8 requests, int8 codes: KV-bound
    (270e6, 47e6, 0.52, False),  # 2k x 1: the weights dominate, nothing to win
    (270e6, 1.5e9, 1.0, False),  # dense copies read every byte
    (None, 1.0, 1.0, True),  # weights unknown: tried, the horizon measures
])
def test_bytes_bound(weights, kv, ratio, pays):
    assert may_pay(weights, kv, ratio) is pays


def test_every_steady_verify_step_is_a_sample():
    # vLLM's first verify is priced too: its one-off cost was the connector re-saving a memory
    # store's chunks (fixed there); after it the first verify costs what later ones do
    clock = Clock()
    h = StepHorizon(8, adaptive=True, clock=clock)
    lengths = [1000, 1000]
    h.begin(lengths, [])
    h.end(4, 0.2)
    for verify in (0.45, 0.5):
        clock.t += verify
        lengths = [n + 5 for n in lengths]
        h.begin(lengths, [(4, 4), (4, 4)])
        h.end(4, 0.2)
    assert list(h.verify_step_s) == pytest.approx([0.45, 0.5])
