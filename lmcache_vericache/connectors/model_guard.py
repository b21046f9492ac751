"""Who may run the served model's modules now: vLLM's forward first, drafts in the gaps.

vLLM's CPU kernels (oneDNN GEMMs) are not safe to run from two threads at once, so every forward
over the served model holds :attr:`ModelGuard.lock`: vLLM's own (the proposer's forward hooks and
``compute_logits``), the proposer's drafts, and each load-window draft step. A draft step also
waits until vLLM's forward does not want the model (:meth:`ModelGuard.wait_idle`), so drafting
never delays a vLLM step by more than the draft step already running.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ModelGuard:
    """One per vLLM engine (its :class:`~.worker_context.WorkerContext`'s, or the proposer's own
    when no connector runs). Thread-safe; ``lock`` is re-entrant (``compute_logits`` inside a
    forward)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._idle = threading.Event()
        self._idle.set()

    @contextlib.contextmanager
    def vllm(self) -> Iterator[None]:
        """vLLM's thread holds the model: a load-window drafter waits before its next step."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        self._idle.clear()  # the load drafter yields before its next step
        self.lock.acquire()

    def leave(self) -> None:
        self.lock.release()
        self._idle.set()

    def wait_idle(self) -> None:
        """Until vLLM's thread does not want the model."""
        self._idle.wait()
