"""Where one vLLM engine's VeriCache parts meet: the connector's store, the proposer's drafter.

The connector (:mod:`.vericache_connector`) and the proposer (:mod:`.proposer`) are built by vLLM
separately and are handed nothing of each other; both are handed the engine's ``VllmConfig``.
:meth:`WorkerContext.of` keeps one context on that config object, so:

* **Who creates it:** whichever part asks first (vLLM builds the proposer in ``load_model`` before
  the worker's connector, which needs the KV cache config). The connector's worker side fills
  :attr:`~WorkerContext.source` (the store and key space it loads from and saves to) in
  ``register_kv_caches``; the proposer attaches its runtime to :attr:`~WorkerContext.drafter` in
  ``load_model``. Both hold :attr:`~WorkerContext.guard` around every forward over the model.
* **Lifetime:** the config's, i.e. the engine's; the store belongs to the context and lives as
  long as it (the connector's save writer flushes into it at shutdown).
* **Sharing:** the scheduler and the worker side of one engine share the context (and so a
  ``capacity: memory`` store) where vLLM runs them in one process on one config object. Two engines
  in one process have two configs, hence two contexts and two stores. The context is
  process-local: a pickled or deep-copied config (vLLM ships configs to worker processes) carries
  a fresh, empty one.
* **Threads:** fields are set on vLLM's threads at start-up and only read afterwards; the store
  and the drafter are thread-safe (their own docstrings).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..backends import StoreConfig
from ..backends.keys import KeySpace
from ..backends.store import DualTierStore
from .load_drafter import LoadDrafter
from .model_guard import ModelGuard

ATTR = "_vericache_worker_context"


@dataclass(frozen=True)
class ChunkSource:
    """The connector's store and key space: where the proposer reads compressed prefix chunks."""

    store: DualTierStore
    space: KeySpace
    chunk_size: int


class WorkerContext:
    """The rendezvous of one engine's connector and proposer (see the module docstring)."""

    def __init__(self) -> None:
        self.guard = ModelGuard()
        self.drafter = LoadDrafter(self.guard)
        self.source: ChunkSource | None = None
        self.connectors: dict[str, Any] = {}  # role -> the engine's connector of that role (stats)
        self._store: tuple[str, DualTierStore] | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, vllm_config: Any) -> WorkerContext:
        """The context of the engine ``vllm_config`` configures (made on first use)."""
        ctx = getattr(vllm_config, ATTR, None)
        if ctx is None:
            ctx = cls()
            setattr(vllm_config, ATTR, ctx)
        return ctx

    def store_for(self, config: StoreConfig) -> DualTierStore:
        """The engine's store for ``config``: built by the first caller, shared by the next with the
        same config (a different config gets a store of its own, not shared)."""
        key = repr(config)
        with self._lock:
            if self._store is None:
                self._store = (key, config.build())
            elif self._store[0] != key:
                return config.build()
            return self._store[1]

    def __reduce__(self) -> tuple:
        return (WorkerContext, ())  # process-local: a copy starts empty
