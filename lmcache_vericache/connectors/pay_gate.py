"""When drafting pays: the proposer's two checks (``connectors/proposer.py``, option ``gate``).

* The bytes bound (:data:`MAX_BYTES_RATIO`, :func:`weight_bytes`): a draft step must read at most
  3/4 of a plain step's bytes (weights plus KV); where the weights dominate no acceptance can
  make drafting pay, and the proposer does not even probe.
* :class:`PayGate`: where the bound allows it, tokens per second of steps with proposals against
  steps without, measured in the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ..backends.keys import weight_files

#: A draft step must read at most this share of a plain step's bytes for the proposer to probe at all.
MAX_BYTES_RATIO = 0.75


def weight_bytes(folder: str | None, dtype: torch.dtype) -> int | None:
    """Bytes of the served weights in ``dtype``, from the safetensors headers (no tensor is read);
    ``None`` where the model is not a local safetensors folder."""
    files = weight_files(folder) if folder else []
    if not files:
        return None
    from safetensors import safe_open

    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            total += sum(int(np.prod(h.get_slice(n).get_shape())) for n in h.keys())
    return total * size


class PayGate:
    """Proposes only while it pays, from tokens per second measured in the run.

    A cycle: ``probe`` steps without proposals (the plain rate), ``probe`` steps with them, then
    ``hold`` steps in the faster mode; ``hold`` doubles while the decision repeats (up to
    ``max_hold``), so a drafter that never pays costs a vanishing share of steps. A step's time
    (between consecutive ``propose`` calls: vLLM's forward plus this proposer) and its emitted
    tokens are credited to the mode of the proposals it verified; the first step after a switch and
    steps that change the batch (a request joins, leaves or prefills) are not counted."""

    def __init__(self, probe: int = 3, hold: int = 32, max_hold: int = 1024, max_step_tokens: int = 65,
                 clock: Callable[[], float] = time.perf_counter):
        self.probe, self.hold0, self.max_hold, self.hold = probe, hold, max_hold, hold
        self.max_step_tokens, self.clock = max_step_tokens, clock
        self.last_pays: bool | None = None
        self.measured = {False: [0, 0.0], True: [0, 0.0]}  # mode -> [tokens, seconds]
        self.decisions: list[bool] = []
        self._last: float | None = None
        self._prev: list[int] | None = None
        self.on = False
        self._enter("measure_off")

    def _enter(self, phase: str) -> None:
        on = phase in ("measure_on", "hold_on")
        self.skip_next = on != self.on  # that step verifies the other mode's proposals
        self.phase, self.on = phase, on
        self.left = self.probe if phase.startswith("measure") else self.hold

    def step(self, lengths: list[int]) -> bool:
        """Account the step that just ran (rows' token counts ``lengths``, -1 for a row in prefill)
        and say whether this step proposes."""
        now = self.clock()
        prev, self._prev = self._prev, lengths
        # Steady: the same rows, each grown by what one decode step can emit (1 + accepted drafts); a
        # row refilled by a new request jumps by its prompt and is no decode step.
        steady = prev is not None and len(prev) == len(lengths) and all(
            a >= 0 and 0 < b - a <= self.max_step_tokens for a, b in zip(prev, lengths))
        counted = steady and self._last is not None and not self.skip_next
        if counted and self.phase.startswith("measure"):
            m = self.measured[self.on]
            m[0] += sum(b - a for a, b in zip(prev, lengths))
            m[1] += now - self._last
        if counted or not self.phase.startswith("measure"):
            self.left -= 1
        self.skip_next = self.skip_next and not steady
        self._last = now
        if self.left <= 0:
            self._next()
        return self.on

    def pause(self) -> None:
        """A step the gate did not see (the proposer was quiet for another reason): the next
        interval starts afresh rather than spanning it."""
        self._last = self._prev = None

    def _next(self) -> None:
        if self.phase == "measure_off":
            self._enter("measure_on")
        elif self.phase == "measure_on":
            (t_off, s_off), (t_on, s_on) = self.measured[False], self.measured[True]
            pays = t_on * s_off > t_off * s_on  # t_on / s_on > t_off / s_off
            self.hold = min(2 * self.hold, self.max_hold) if pays == self.last_pays else self.hold0
            self.last_pays = pays
            self.decisions.append(pays)
            self.measured = {False: [0, 0.0], True: [0, 0.0]}
            self._enter("hold_on" if pays else "hold_off")
        else:
            self._enter("measure_off")
