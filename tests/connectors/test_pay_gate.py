"""PayGate: the proposer proposes only while tokens per second with proposals beat plain steps.

The gate sees what vLLM shows a proposer: the rows' token counts at each step and the time between
steps. Here a scripted engine plays those steps: a plain step takes ``t_plain`` and emits one token
per row; a step verifying proposals takes ``t_spec`` and emits ``1 + accepted`` per row."""

from __future__ import annotations

from lmcache_vericache.connectors.pay_gate import PayGate


def run(t_plain: float, t_spec: float, accepted: int, steps: int, rows: int = 2) -> tuple[PayGate, list[bool]]:
    now = [0.0]
    gate = PayGate(probe=3, hold=8, max_hold=256, clock=lambda: now[0])
    lengths, modes, on = [100] * rows, [], False
    for _ in range(steps):
        on = gate.step(list(lengths))  # the step that just ran verified the previous call's proposals
        modes.append(on)
        # the next step: its time and tokens depend on whether this call proposed
        now[0] += t_spec if on else t_plain
        lengths = [n + (1 + accepted if on else 1) for n in lengths]
    return gate, modes


def test_proposes_when_it_pays():
    gate, modes = run(t_plain=0.10, t_spec=0.15, accepted=3, steps=400)  # 4 tokens / 0.15 s vs 1 / 0.10 s
    assert gate.decisions and all(gate.decisions)
    assert sum(modes) / len(modes) > 0.8


def test_goes_quiet_when_it_does_not_pay_and_probes_ever_more_rarely():
    gate, modes = run(t_plain=0.10, t_spec=0.30, accepted=1, steps=2000)  # 2 tokens / 0.3 s vs 1 / 0.1 s
    assert gate.decisions and not any(gate.decisions)
    assert sum(modes) / len(modes) < 0.05  # probing costs a small share of the steps
    assert sum(modes[1000:]) / 1000 < 0.025  # and less the longer it runs (hold doubles to max_hold)


def test_batch_changes_are_not_counted():
    now = [0.0]
    gate = PayGate(probe=2, hold=4, clock=lambda: now[0])
    gate.step([10, 20])
    now[0] += 5.0  # a new request prefills: a long step, and the batch changes
    gate.step([11, 21, -1])
    assert gate.measured[False] == [0, 0.0]
    now[0] += 0.1
    gate.step([12, 22, 5])  # joined row: still not steady against the previous lengths (-1)
    now[0] += 0.1
    gate.step([13, 23, 6])
    assert gate.measured[False][0] == 3 and abs(gate.measured[False][1] - 0.1) < 1e-9


def test_a_refilled_row_is_no_decode_step():
    now = [0.0]
    gate = PayGate(probe=2, hold=4, max_step_tokens=9, clock=lambda: now[0])
    gate.step([100, 200])
    now[0] += 0.1
    gate.step([101, 201])
    assert gate.measured[False][0] == 2
    now[0] += 3.0  # row 1's request finished; a new one took the row and prefilled 900 tokens
    gate.step([102, 900])
    assert gate.measured[False][0] == 2  # not counted
    gate.pause()  # a step the gate did not see
    now[0] += 5.0
    gate.step([103, 901])
    assert gate.measured[False][0] == 2 and abs(gate.measured[False][1] - 0.1) < 1e-9  # nothing spans the pause
